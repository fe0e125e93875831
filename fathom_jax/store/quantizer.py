"""The 4-bit block quantizer and its bit planes: the arithmetic every key store is made of.

Semantics (fixed by the design; every test of exactness leans on them):

* Tokens are grouped in blocks of ``BLOCK_TOKENS = 64`` (``fathom_jax.format``). For block ``b`` and channel ``j`` the scale is
  ``a = max |k|`` over the block's valid tokens, stored as float16. The quantizer cell is ``s = a / 8``
  and the code is ``c = clip(floor(k / s), -8, 7) + 8`` in ``[0, 16)``; codes are computed from the
  *fp16-rounded* scale so that dequantization with the stored scale is self-consistent.
* Bit ``p`` (0 = most significant) of the codes is plane ``p``. Reading the first ``t`` planes gives
  ``c_t = c >> (4 - t)`` and the value ``(c_t + 1/2 - 2^(t-1)) * a / 2^(t-1)``: exactly the t-bit
  mid-rise quantizer of ``[-a, a)`` under the same scale. ``t = 0`` reads nothing (value 0).
* Token ``i`` of a plane is bit ``i % 32`` of word ``i // 32``, channel-major (``[..., D, 4, W]``); the store
  that holds them is :mod:`fathom_jax.store`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Float16, Int, UInt32

from fathom_jax.checks import CheckError, fail_if, is_traced
from fathom_jax.format import BLOCK_TOKENS, FP16_MAX, N_PLANES, WORD_BITS

# ----------------------------------------------------------------------------------------------
# Quantization


def exact_cell(keys, width, ratio):
    """``floor(keys / width)`` exactly (0 where ``width`` is 0), from a quotient ``ratio`` that may be one ulp off.

    XLA on a GPU may divide as a multiply by the reciprocal, in one program and not in another, which puts a key
    on a cell boundary (frequent for bf16 keys) one cell low: the index built after a decode step then differed
    from the index built from all keys. ``j * width`` is exact (an fp16 scale / 8 times an integer |j| <= 8), so
    one comparison each way settles the cell."""
    cell = jnp.floor(ratio)
    cell = jnp.where((width > 0) & (cell * width > keys), cell - 1, cell)
    return jnp.where((width > 0) & ((cell + 1) * width <= keys), cell + 1, cell)


def quantize_blocks(
    keys: Float[Array, "*B NB 64 D"], valid: Any = None
) -> tuple[Int[Array, "*B NB 64 D"], Float16[Array, "*B NB D"]]:
    """4-bit codes and fp16 absmax scales of whole blocks. ``valid`` masks tokens out of the scale."""
    keys = keys.astype(jnp.float32)
    # XLA flushes subnormal quotients (and, inside a fusion, inputs) to zero; a strictly negative key
    # still belongs to a negative cell (Eq. 2), so its sign comes from the bits. The barrier keeps XLA
    # from folding the bit test into a float comparison that would see the flushed value (it did: under
    # jit a -1e-42 key got code 8, eagerly 7).
    bits = jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(keys, jnp.uint32))
    negative = (bits >> 31 == 1) & ((bits & 0x7FFFFFFF) != 0)
    if valid is not None:
        keys = jnp.where(valid[..., None], keys, 0.0)
        negative = negative & valid[..., None]
    absmax = jnp.max(jnp.abs(keys), axis=-2)
    scale16 = jnp.minimum(absmax, FP16_MAX).astype(jnp.float16)
    width = scale16.astype(jnp.float32)[..., None, :] / 8.0
    ratio = jnp.where(width > 0, keys / jnp.where(width > 0, width, 1.0), 0.0)
    codes = jnp.clip(exact_cell(keys, width, ratio), -8, 7).astype(jnp.int32) + 8
    codes = jnp.where(negative & (codes >= 8) & (width > 0), 7, codes)
    return codes, scale16


def dequantize_codes(
    code_t: Int[Array, "... D"], scales: Float[Array, "... D"], depth: Int[Array, "*#... D"] | int
) -> Float[Array, "... D"]:
    """Value of a ``depth``-bit code ``c_t = c >> (4 - t)``: ``(c_t + 1/2 - 2^(t-1)) * a / 2^(t-1)``; 0 at t = 0."""
    depth = jnp.asarray(depth, jnp.int32)
    half_range = jnp.left_shift(1, jnp.maximum(depth, 1) - 1).astype(jnp.float32)
    value = (jnp.asarray(code_t).astype(jnp.float32) + 0.5 - half_range) * (scales.astype(jnp.float32) / half_range)
    return jnp.where(depth > 0, value, 0.0)


def check_depth(name: str, depth) -> None:
    """Depths are whole planes read per channel, 0..4. Concrete: a CheckError. Traced depths come from a planner
    on the decode path: checked in checkify mode only (:mod:`fathom_jax.checks`); otherwise a channel read at
    an out-of-range depth comes out NaN (``dequantize``) rather than as a plausible wrong value."""
    dtype = depth.dtype if hasattr(depth, "dtype") else np.asarray(depth).dtype
    if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_)):
        raise TypeError(f"{name}: depth must be whole planes (an integer array), got dtype {dtype}")
    d = depth if is_traced(depth) else np.asarray(depth)
    if np.size(d) == 0:
        return
    fail_if((d < 0) | (d > N_PLANES), lambda got: f"{name}: depth must lie in [0, {N_PLANES}] planes per channel, "
            f"got values in [{got.min()}, {got.max()}]", d, hot=True)


def check_depth_shape(name: str, depth, batch_shape: tuple[int, ...], head_dim: int) -> None:
    """``depth`` must broadcast to ``[*B, D]`` (one depth per channel; a scalar reads every channel alike)."""
    want = (*batch_shape, head_dim)
    try:
        ok = np.broadcast_shapes(np.shape(depth), want) == want
    except ValueError:
        ok = False
    if not ok:
        raise CheckError(f"{name}: depth must broadcast to [*batch, D] = {list(want)}, got shape {list(np.shape(depth))}")


# ----------------------------------------------------------------------------------------------
# Packing


def pack_planes(codes: Int[Array, "*B n D"]) -> UInt32[Array, "*B D 4 W"]:
    """Pack token-major 4-bit codes (n a multiple of 32) into channel-major bit planes."""
    *batch, n, d = codes.shape
    if n % WORD_BITS:
        raise ValueError(f"pack_planes: token count must be a multiple of {WORD_BITS}, got {n}")
    codes = jnp.swapaxes(codes.astype(jnp.uint32), -1, -2)  # [*B, D, n]
    shifts = jnp.arange(N_PLANES - 1, -1, -1, dtype=jnp.uint32)  # plane p holds bit 3 - p
    bits = (codes[..., None, :] >> shifts[:, None]) & 1  # [*B, D, 4, n]
    bits = bits.reshape(*batch, d, N_PLANES, n // WORD_BITS, WORD_BITS)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(WORD_BITS, dtype=jnp.uint32))
    return jnp.sum(bits * weights, axis=-1, dtype=jnp.uint32)


def unpack_planes(planes: UInt32[Array, "*B D 4 W"], depth: Int[Array, "*B D"] | int = N_PLANES) -> Int[Array, "*B n D"]:
    """Codes from the first ``depth`` planes (per channel): ``c >> (4 - depth)``, token-major."""
    check_depth("unpack_planes", depth)
    # Transpose as its own op: fused into the bit extraction, XLA:CPU ran the whole unpack strided (measured slower).
    return jnp.swapaxes(jax.lax.optimization_barrier(unpack_planes_channels(planes, depth)), -1, -2)


def unpack_planes_channels(planes: UInt32[Array, "*B D 4 W"], depth: Int[Array, "*B D"] | int = N_PLANES
                           ) -> Int[Array, "*B D n"]:
    """:func:`unpack_planes` in the planes' own channel-major order ``[*B, D, n]``."""
    *batch, d, _, w = planes.shape
    bit_index = jnp.arange(WORD_BITS, dtype=jnp.uint32)
    bits = ((planes[..., None] >> bit_index) & 1).astype(jnp.int32).reshape(*batch, d, N_PLANES, w * WORD_BITS)
    depth = jnp.broadcast_to(jnp.asarray(depth, jnp.int32), (*batch, d))
    plane = jnp.arange(N_PLANES, dtype=jnp.int32)
    # Plane p contributes bit (depth - 1 - p) of the truncated code, and nothing once p >= depth.
    weight = jnp.where(plane < depth[..., None], jnp.left_shift(1, jnp.maximum(depth[..., None] - 1 - plane, 0)), 0)
    return jnp.sum(bits * weight[..., None], axis=-2)


def pack_block(tail: Float[Array, "64 D"], count: Int[Array, ""]) -> tuple[UInt32[Array, "D 4 2"], Float16[Array, "D"]]:
    """Plane words and fp16 scales of one block whose first ``count`` rows of ``tail`` are valid.

    The same arithmetic as :func:`fathom_jax.store.build_store` applies to that block, so the result is its block, bit for bit.
    """
    valid = jnp.arange(BLOCK_TOKENS) < count
    codes, scale = quantize_blocks(tail, valid)
    codes = jnp.where(valid[:, None], codes, 0)
    return pack_planes(codes), scale


def block_tail(keys: Float[Array, "*B n D"], length: Int[Array, "*B"], block: int) -> Float[Array, "*B block D"]:
    """Raw keys of each sequence's last, partially filled ``block``-token block (zeros past ``length``;
    ``length`` at most ``n``, which need not be a whole number of blocks)."""
    n = keys.shape[-2]
    idx = (length // block * block)[..., None] + jnp.arange(block)
    tail = jnp.take_along_axis(keys, jnp.minimum(idx, n - 1)[..., None], axis=-2)
    return jnp.where((idx < length[..., None])[..., None], tail, 0.0)
