"""Baseline channel scan: ``r`` fixed channels at full 4 bits (the SparQ / Double Sparsity / Loki read).

Layout choice. A per-query channel scan reads ``r`` whole channels, so what it really reads is a
*channel-major nibble* layout: per (sequence, KV head, channel) the 4-bit codes of all tokens packed
8 per uint32 word (token ``i`` is nibble ``i % 8`` of word ``i // 8``, low nibble first), ``nibbles
uint32 [*, D, n/8]``. Every channel is one contiguous run of ``n/2`` bytes, the same bytes as its four
bit planes, but a token's code is one shift-and-mask away instead of four. A token-major layout
(``[n, D/8]`` words) would force reading all ``D`` channels' words to get ``r`` of them, so it is not
what these methods read. :func:`pack_nibbles` builds the layout from a plane store (the same codes and
the same fp16 block scales).

Scores ``[*, G, n]``: ``sum_j q[h, j] * (c + 1/2 - 8) * a / 8`` over the listed channels, 0 at
positions ``>= length`` (equal to the plane scan at depth 4 over the same channels).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as C
from pallas_kernels.plane_layout import BLOCK_TOKENS

KERNEL_NAME = "nibble_scan"
WORDS_PER_BLOCK = BLOCK_TOKENS // 8  # 8 nibbles per uint32 word


@dataclasses.dataclass(frozen=True)
class NibbleScanConfig:
    """``tile``: tokens per program (a power of two >= 64); ``num_warps`` / ``num_stages``: Triton launch
    parameters; the defaults are the ones measured on the H200 (``results/kernels_h200.md``)."""

    tile: int = 512
    num_warps: int = 1
    num_stages: int | None = None

    def __post_init__(self):
        C.check_pow2("tile", self.tile)
        if self.tile < BLOCK_TOKENS:
            raise ValueError(f"tile must be >= {BLOCK_TOKENS} tokens, got {self.tile}")


def pack_nibbles(planes):
    """Channel-major nibble layout ``u32 [*, D, n/8]`` from bit planes ``u32 [*, D, 4, W]``."""
    *batch, d, four, w = planes.shape
    bits = (planes[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1  # [*, D, 4, W, 32]
    codes = (bits[..., 0, :, :] << 3) | (bits[..., 1, :, :] << 2) | (bits[..., 2, :, :] << 1) | bits[..., 3, :, :]
    codes = codes.reshape(*batch, d, w * 4, 8)  # token 8u + v -> word u, nibble v
    return jnp.sum(codes << (4 * jnp.arange(8, dtype=jnp.uint32)), axis=-1, dtype=jnp.uint32)


def _validate(q, nibbles, scales, length, channels):
    C.check_array("q", q, ndim_min=2, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16))
    C.check_array("nibbles", nibbles, ndim_min=2, dtypes=(jnp.uint32,))
    C.check_array("scales", scales, ndim_min=2, dtypes=(jnp.float16, jnp.float32))
    C.check_array("channels", channels, ndim_min=1, dtypes=(jnp.int32,))
    *batch, d, w8 = nibbles.shape
    batch = tuple(batch)
    if w8 % WORDS_PER_BLOCK:
        raise ValueError(f"nibble row of {w8} words is not a whole number of 64-token blocks")
    if q.shape[:-2] != batch or q.shape[-1] != d:
        raise ValueError(f"q must be [*batch, G, D] = [{batch}, G, {d}], got {q.shape}")
    if scales.shape != (*batch, d, w8 // WORDS_PER_BLOCK):
        raise ValueError(f"scales must be {(*batch, d, w8 // WORDS_PER_BLOCK)}, got {scales.shape}")
    if jnp.shape(length) != batch:
        raise ValueError(f"length must have the batch shape {batch}, got {jnp.shape(length)}")
    if channels.shape[:-1] != batch:
        raise ValueError(f"channels must be [*batch, r] = [{batch}, r], got {channels.shape}")


def check_values(channels, head_dim: int) -> None:
    if not C.is_traced(channels) and np.any((np.asarray(channels) < 0) | (np.asarray(channels) >= head_dim)):
        raise ValueError(f"channels must lie in [0, {head_dim})")


def nibble_scan_reference(q, nibbles, scales, length, channels):
    """Plain-jnp scores: unpack the listed channels' nibbles and dequantize at 4 bits."""
    _validate(q, nibbles, scales, length, channels)
    n = nibbles.shape[-1] * 8
    sel = jnp.take_along_axis(nibbles, channels[..., :, None], axis=-2)  # [*, r, n/8]
    codes = ((sel[..., None] >> (4 * jnp.arange(8, dtype=jnp.uint32))) & 15).reshape(*sel.shape[:-1], n)
    a = jnp.repeat(jnp.take_along_axis(scales, channels[..., :, None], axis=-2).astype(jnp.float32), BLOCK_TOKENS, axis=-1)
    value = (codes.astype(jnp.float32) - 7.5) * a / 8.0
    value = jnp.where(jnp.arange(n) < jnp.asarray(length)[..., None, None], value, 0.0)
    qc = jnp.take_along_axis(q.astype(jnp.float32), channels[..., None, :], axis=-1)  # [*, G, r]
    return jnp.einsum("...gc,...cn->...gn", qc, value, precision=jax.lax.Precision.HIGHEST)


def _nibble_scan_kernel(
    # inputs
    qc_ref,  # f32 [BH, G, r]
    ch_ref,  # i32 [BH, r]
    len_ref,  # i32 [BH]
    nib_ref,  # u32 [BH, D, NB, 8]
    scales_ref,  # f16 [BH, D, NB]
    # outputs
    out_ref,  # f32 [BH, G, NB, 8, 8]
    *,
    groups: int,
    tile_blocks: int,
    num_blocks: int,
    channels: int,
):
    bh = pl.program_id(0)
    b0 = pl.program_id(1) * tile_blocks
    blk = b0 + jnp.arange(tile_blocks, dtype=jnp.int32)
    bmask = blk < num_blocks
    shifts = (4 * jnp.arange(8, dtype=jnp.uint32))[None, None, :]

    def body(k, acc):
        j = ch_ref[bh, k]
        a = plgpu.load(scales_ref.at[bh, j, pl.ds(b0, tile_blocks)], mask=bmask, other=0.0)
        a = a.astype(jnp.float32) * 0.125
        w = plgpu.load(nib_ref.at[bh, j, pl.ds(b0, tile_blocks), :], mask=bmask[:, None], other=0)
        code = (w[:, :, None] >> shifts) & 15
        va = (code.astype(jnp.float32) - 7.5) * a[:, None, None]
        return tuple(acc[h] + qc_ref[bh, h, k] * va for h in range(groups))

    acc = tuple(jnp.zeros((tile_blocks, 8, 8), jnp.float32) for _ in range(groups))
    acc = jax.lax.fori_loop(0, channels, body, acc)
    tok = (blk[:, None, None] * 8 + jnp.arange(8, dtype=jnp.int32)[None, :, None]) * 8 + jnp.arange(
        8, dtype=jnp.int32
    )[None, None, :]
    valid = tok < len_ref[bh]
    for h in range(groups):
        plgpu.store(out_ref.at[bh, jnp.int32(h), pl.ds(b0, tile_blocks)], jnp.where(valid, acc[h], 0.0), mask=bmask[:, None, None])


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _nibble_scan_pallas(q, nibbles, scales, length, channels, *, config, interpret):
    tile, num_warps, num_stages = config.tile, config.num_warps, config.num_stages
    *batch, d, w8 = nibbles.shape
    g = q.shape[-2]
    nb = w8 // WORDS_PER_BLOCK
    bh = C.prod(batch)
    r = channels.shape[-1]
    channels = channels.reshape(bh, r)
    qc = jnp.take_along_axis(q.astype(jnp.float32).reshape(bh, g, d), channels[:, None, :], axis=-1)
    tile_blocks = tile // BLOCK_TOKENS
    kernel = functools.partial(_nibble_scan_kernel, groups=g, tile_blocks=tile_blocks, num_blocks=nb, channels=r)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((bh, g, nb, 8, 8), jnp.float32),
        grid=(bh, pl.cdiv(nb, tile_blocks)),
        interpret=interpret,
        name=KERNEL_NAME,
        compiler_params=C.compiler_params(num_warps, num_stages),
    )(qc, channels, jnp.asarray(length, jnp.int32).reshape(bh), nibbles.reshape(bh, d, nb, 8), scales.reshape(bh, d, nb))
    return out.reshape(*batch, g, nb * BLOCK_TOKENS)


def nibble_scan(
    q,  # [*, G, D]
    nibbles,  # u32 [*, D, n/8]   (see pack_nibbles)
    scales,  # f16 [*, D, NB]
    length,  # i32 [*]
    channels,  # i32 [*, r]
    *,
    implementation: C.Implementation | None = None,
    config: NibbleScanConfig | None = None,
    interpret: bool | None = None,
):
    """Scores ``f32 [*, G, n]`` from ``r`` channels read at 4 bits from the nibble layout."""
    implementation = C.resolve_implementation(implementation)
    _validate(q, nibbles, scales, length, channels)
    check_values(channels, nibbles.shape[-2])
    if implementation == "xla":
        return nibble_scan_reference(q, nibbles, scales, length, channels)
    return _nibble_scan_pallas(
        q, nibbles, scales, jnp.asarray(length, jnp.int32), channels,
        config=config or NibbleScanConfig(), interpret=C.resolve_interpret(interpret),
    )

