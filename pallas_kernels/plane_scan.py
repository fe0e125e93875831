"""Fathom plane scan: approximate scores of all tokens from the first ``t_j`` bit planes of active channels.

For one (sequence, KV head) and its ``G`` query heads::

    score[h, i] = sum_j q[h, j] * value_j(i; t_j)
    value(t) = (c_t + 1/2 - 2^(t-1)) * a / 2^(t-1),  c_t = c >> (4 - t),  0 at t = 0

with ``a`` the token's fp16 block scale (64-token blocks). Tokens at positions ``>= length`` score 0,
so the result equals ``q @ store.dequantize(store, depth).T`` (in the store's basis: pass KLT-rotated
queries for a KLT store).

The active channels come as a fixed-size list ``channels [*, C]`` / ``depths [*, C]``; slots of depth 0
cost nothing. :func:`active_channels` builds the list from per-channel depths (e.g. ``ReadPlan.depths``),
sorted by decreasing depth. Two kernels (``lanes=``): the default "lanes" kernel is described at
``_plane_scan_lanes_kernel``; the first ("blocked", ``lanes=0``) kernel runs one loop per *depth class* (t = 4, 3, 2, 1) with the depth a
compile-time constant, so each channel loads exactly its ``t`` planes and assembles its integer code
``c_t`` with static shifts; accumulation is f32. One program handles one (sequence, KV head) and a tile of
``tile`` tokens for all ``G`` heads; the tile is laid out ``[tile/64 blocks, 2 words, 32 bits]`` so a
block's scale broadcasts over its 64 tokens without a gather.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as C

KERNEL_NAME = "fathom_plane_scan"
BLOCK_TOKENS = 64
N_PLANES = 4


# ----------------------------------------------------------------------------------------------
# Active-channel list


def active_channels(depths, max_active: int | None = None):
    """Fixed-size active-channel list from per-channel depths ``[*, D]`` (e.g. ``ReadPlan.depths``).

    Returns ``(channels [*, C], depths [*, C])`` int32 with ``C = max_active`` (default ``D``), sorted by
    decreasing depth (stable in channel index); slots past the active channels have depth 0. If more than
    ``C`` channels are active the shallowest ones are dropped (use ``C = D`` to keep all).
    """
    depths = jnp.asarray(depths, jnp.int32)
    d = depths.shape[-1]
    c = d if max_active is None else int(max_active)
    if not 1 <= c <= d:
        raise ValueError(f"max_active must lie in [1, {d}], got {c}")
    order = jnp.argsort(-depths, axis=-1, stable=True)[..., :c].astype(jnp.int32)
    return order, jnp.take_along_axis(depths, order, axis=-1)


def _class_bounds(depths):
    """``[*, 4]`` end offsets of the depth classes 4, 3, 2, 1 in a list sorted by decreasing depth."""
    counts = jnp.stack([jnp.sum(depths == t, axis=-1) for t in (4, 3, 2, 1)], axis=-1)
    return jnp.cumsum(counts, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Validation


def _validate(q, planes, scales, length, channels, depths):
    C.check_array("q", q, ndim_min=2, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16))
    C.check_array("planes", planes, ndim_min=3, dtypes=(jnp.uint32,))
    C.check_array("scales", scales, ndim_min=2, dtypes=(jnp.float16, jnp.float32))
    C.check_array("channels", channels, ndim_min=1, dtypes=(jnp.int32,))
    C.check_array("depths", depths, ndim_min=1, dtypes=(jnp.int32,))
    *batch, d, four, w = planes.shape
    batch = tuple(batch)
    if four != N_PLANES:
        raise ValueError(f"planes must be [*, D, 4, W], got {planes.shape}")
    if w % 2:
        raise ValueError(f"plane width W={w} must be even (capacity a multiple of 64)")
    if q.shape[:-2] != batch or q.shape[-1] != d:
        raise ValueError(f"q must be [*batch, G, D] = [{batch}, G, {d}], got {q.shape}")
    if scales.shape != (*batch, d, w // 2):
        raise ValueError(f"scales must be {(*batch, d, w // 2)}, got {scales.shape}")
    if jnp.shape(length) != batch:
        raise ValueError(f"length must have the batch shape {batch}, got {jnp.shape(length)}")
    if channels.shape[:-1] != batch or depths.shape != channels.shape:
        raise ValueError(f"channels/depths must both be [*batch, C] = [{batch}, C], got {channels.shape}, {depths.shape}")


def check_values(channels, depths, head_dim: int) -> None:
    """Value checks (eager only: skipped for traced arrays)."""
    if not C.is_concrete(channels, depths):
        return
    ch, dp = np.asarray(channels), np.asarray(depths)
    if np.any((ch < 0) | (ch >= head_dim)):
        raise ValueError(f"channels must lie in [0, {head_dim})")
    if np.any((dp < 0) | (dp > N_PLANES)):
        raise ValueError("depths must lie in [0, 4]")


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp, independent of the kernel)


def plane_scan_reference(q, planes, scales, length, channels, depths):
    """Scores ``[*, G, n]`` by unpacking the selected channels' planes to codes and dequantizing."""
    _validate(q, planes, scales, length, channels, depths)
    *batch, d, _, w = planes.shape
    n = 32 * w
    sel = jnp.take_along_axis(planes, channels[..., :, None, None], axis=-3)  # [*, C, 4, W]
    bits = (sel[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1  # [*, C, 4, W, 32]
    bits = bits.reshape(*sel.shape[:-1], n).astype(jnp.int32)  # [*, C, 4, n]
    t = depths[..., :, None]  # [*, C, 1]
    code = jnp.zeros(bits.shape[:-2] + (n,), jnp.int32)
    for p in range(N_PLANES):  # plane p is bit (t-1-p) of c_t when p < t
        code = code + jnp.where(p < t, bits[..., p, :] << jnp.maximum(t - 1 - p, 0), 0)
    half = jnp.left_shift(1, jnp.maximum(t, 1) - 1).astype(jnp.float32)
    a = jnp.take_along_axis(scales, channels[..., :, None], axis=-2).astype(jnp.float32)  # [*, C, NB]
    a = jnp.repeat(a, BLOCK_TOKENS, axis=-1)  # [*, C, n]
    value = jnp.where(t > 0, (code.astype(jnp.float32) + 0.5 - half) * a / half, 0.0)
    value = jnp.where(jnp.arange(n) < jnp.asarray(length)[..., None, None], value, 0.0)
    qc = jnp.take_along_axis(q.astype(jnp.float32), channels[..., None, :], axis=-1)  # [*, G, C]
    return jnp.einsum("...gc,...cn->...gn", qc, value, precision=jax.lax.Precision.HIGHEST)


# ----------------------------------------------------------------------------------------------
# Kernel


def _plane_scan_kernel(
    # inputs
    qc_ref,  # f32 [BH, G, C]       query weights of the listed channels
    ch_ref,  # i32 [BH, C]          channel list, sorted by decreasing depth
    bounds_ref,  # i32 [BH, 4]      end offsets of depth classes 4, 3, 2, 1
    len_ref,  # i32 [BH]            valid tokens
    planes_ref,  # u32 [BH, D, 4, NB, 2]
    scales_ref,  # f16 [BH, D, NB]
    # outputs
    out_ref,  # f32 [BH, G, NB, 2, 32]
    *,
    groups: int,
    tile_blocks: int,
    num_blocks: int,
):
    bh = pl.program_id(0)
    b0 = pl.program_id(1) * tile_blocks
    blk = b0 + jnp.arange(tile_blocks, dtype=jnp.int32)
    bmask = blk < num_blocks
    lanes = jnp.arange(32, dtype=jnp.uint32)[None, None, :]
    acc = tuple(jnp.zeros((tile_blocks, 2, 32), jnp.float32) for _ in range(groups))

    start = jnp.int32(0)
    for cls, t in enumerate((4, 3, 2, 1)):
        end = bounds_ref[bh, cls]
        half = float(2 ** (t - 1))

        def body(k, acc, t=t, half=half):
            j = ch_ref[bh, k]
            a = plgpu.load(scales_ref.at[bh, j, pl.ds(b0, tile_blocks)], mask=bmask, other=0.0)
            a = a.astype(jnp.float32) * (1.0 / half)
            code = None
            for p in range(t):
                w = plgpu.load(planes_ref.at[bh, j, jnp.int32(p), pl.ds(b0, tile_blocks), :], mask=bmask[:, None], other=0)
                bit = (w[:, :, None] >> lanes) & 1
                if t - 1 - p:
                    bit = bit << (t - 1 - p)
                code = bit if code is None else code | bit
            va = (code.astype(jnp.float32) + (0.5 - half)) * a[:, None, None]
            return tuple(acc[h] + qc_ref[bh, h, k] * va for h in range(groups))

        acc = jax.lax.fori_loop(start, end, body, acc)
        start = end

    tok = (blk[:, None, None] * 2 + jnp.arange(2, dtype=jnp.int32)[None, :, None]) * 32 + jnp.arange(
        32, dtype=jnp.int32
    )[None, None, :]
    valid = tok < len_ref[bh]
    for h in range(groups):
        plgpu.store(
            out_ref.at[bh, jnp.int32(h), pl.ds(b0, tile_blocks)], jnp.where(valid, acc[h], 0.0), mask=bmask[:, None, None]
        )


# ----------------------------------------------------------------------------------------------
# Kernel, "lanes" variant: one thread owns ``lanes`` consecutive tokens (a whole plane word or a part of one),
# unrolled at compile time, so each token's bit is one constant shift + one mask-or (no per-token layout
# broadcasts); codes become floats by the 2^23 magic-number trick (OR into the mantissa, one exact FADD)
# and the block scale and 1/2^(t-1) are folded into per-(channel, element) weights w_h = q_h * a / 2^(t-1):
# score = sum_j w_h c_t + sum_j w_h (1/2 - 2^(t-1)), the second sum once per element, not per token.

_MAGIC = 0x4B000000  # float32 bits of 2^23: bitcast(_MAGIC | c) == 2^23 + c exactly for c < 2^23


def _stack_lanes(xs):
    """``[E, len(xs)]`` from a list of ``[E]`` tensors (a tree of two-way stacks: Triton's ``join``)."""
    if len(xs) == 1:
        return xs[0][:, None]
    a, b = _stack_lanes(xs[0::2]), _stack_lanes(xs[1::2])
    e, m = a.shape
    return jnp.stack([a, b], axis=-1).reshape(e, 2 * m)


def _plane_scan_lanes_kernel(
    qc_ref,  # f32 [BH, G, C]
    ch_ref,  # i32 [BH, C]
    bounds_ref,  # i32 [BH, 4]
    len_ref,  # i32 [BH]
    planes_ref,  # u32 [BH, D, 4, W]
    scales_ref,  # f16 [BH, D, NB]
    out_ref,  # f32 [BH, G, W * S, lanes]
    *,
    groups: int,
    elems: int,
    lanes: int,
    num_words: int,
):
    split = 32 // lanes
    bh = pl.program_id(0)
    e0 = pl.program_id(1) * elems
    e = e0 + jnp.arange(elems, dtype=jnp.int32)
    word = e // split if split > 1 else e
    emask = word < num_words
    block = e // (BLOCK_TOKENS // lanes)
    part_shift = ((e % split) * lanes).astype(jnp.uint32) if split > 1 else None
    acc = tuple(tuple(jnp.zeros((elems,), jnp.float32) for _ in range(lanes)) for _ in range(groups))
    bias = tuple(jnp.zeros((elems,), jnp.float32) for _ in range(groups))
    magic = jnp.full((elems,), _MAGIC, jnp.uint32)

    start = jnp.int32(0)
    for cls, t in enumerate((4, 3, 2, 1)):
        end = bounds_ref[bh, cls]
        half = float(2 ** (t - 1))

        def body(k, carry, t=t, half=half):
            acc, bias = carry
            j = ch_ref[bh, k]
            a = plgpu.load(scales_ref.at[bh, j, block], mask=emask, other=0.0).astype(jnp.float32) * (1.0 / half)
            wts = [qc_ref[bh, h, k] * a for h in range(groups)]
            bias = tuple(bias[h] + wts[h] * (0.5 - half) for h in range(groups))
            words = []
            for p in range(t):
                if split > 1:
                    w = plgpu.load(planes_ref.at[bh, j, jnp.int32(p), word], mask=emask, other=0)
                    w = w >> part_shift
                else:
                    w = plgpu.load(planes_ref.at[bh, j, jnp.int32(p), pl.ds(e0, elems)], mask=emask, other=0)
                words.append(w)
            new = []
            for h in range(groups):
                new.append(list(acc[h]))
            for l in range(lanes):
                code = magic
                for p in range(t):
                    s = t - 1 - p  # plane p is bit s of c_t
                    w = words[p]
                    if l > s:
                        w = w >> (l - s)
                    elif l < s:
                        w = w << (s - l)
                    code = code | (w & jnp.uint32(1 << s))
                v = jax.lax.bitcast_convert_type(code, jnp.float32) - float(2**23)  # exact: c_t
                for h in range(groups):
                    new[h][l] = new[h][l] + wts[h] * v
            return tuple(tuple(x) for x in new), bias

        acc, bias = jax.lax.fori_loop(start, end, body, (acc, bias))
        start = end

    tok = e[:, None] * lanes + jnp.arange(lanes, dtype=jnp.int32)[None, :]
    valid = tok < len_ref[bh]
    for h in range(groups):
        plgpu.store(out_ref.at[bh, jnp.int32(h), pl.ds(e0, elems), :],
                    jnp.where(valid, _stack_lanes([x + bias[h] for x in acc[h]]), 0.0), mask=emask[:, None])


@functools.partial(jax.jit, static_argnames=("tile", "num_warps", "num_stages", "interpret", "assume_sorted", "lanes"))
def _plane_scan_pallas(q, planes, scales, length, channels, depths, *, tile, num_warps, num_stages, interpret, assume_sorted,
                       lanes):
    *batch, d, _, w = planes.shape
    g = q.shape[-2]
    nb = w // 2
    bh = C.prod(batch)
    if not assume_sorted:
        order = jnp.argsort(-depths, axis=-1, stable=True)
        channels = jnp.take_along_axis(channels, order, axis=-1)
        depths = jnp.take_along_axis(depths, order, axis=-1)
    c = channels.shape[-1]
    channels = channels.reshape(bh, c)
    bounds = _class_bounds(depths.reshape(bh, c))
    qc = jnp.take_along_axis(q.astype(jnp.float32).reshape(bh, g, d), channels[:, None, :], axis=-1)
    args = (qc, channels, bounds, jnp.asarray(length, jnp.int32).reshape(bh))
    if lanes:
        split = 32 // lanes
        elems = tile // lanes
        kernel = functools.partial(_plane_scan_lanes_kernel, groups=g, elems=elems, lanes=lanes, num_words=w)
        out = pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((bh, g, w * split, lanes), jnp.float32),
            grid=(bh, pl.cdiv(w * split, elems)),
            interpret=interpret,
            name=KERNEL_NAME,
            compiler_params=C.compiler_params(num_warps, num_stages),
        )(*args, planes.reshape(bh, d, N_PLANES, w), scales.reshape(bh, d, nb))
        return out.reshape(*batch, g, w * 32)
    tile_blocks = tile // BLOCK_TOKENS
    kernel = functools.partial(_plane_scan_kernel, groups=g, tile_blocks=tile_blocks, num_blocks=nb)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((bh, g, nb, 2, 32), jnp.float32),
        grid=(bh, pl.cdiv(nb, tile_blocks)),
        interpret=interpret,
        name=KERNEL_NAME,
        compiler_params=C.compiler_params(num_warps, num_stages),
    )(*args, planes.reshape(bh, d, N_PLANES, nb, 2), scales.reshape(bh, d, nb))
    return out.reshape(*batch, g, nb * BLOCK_TOKENS)


def plane_scan(
    q,  # [*, G, D] queries (store basis)
    planes,  # u32 [*, D, 4, W]
    scales,  # f16 [*, D, NB]
    length,  # i32 [*]
    channels,  # i32 [*, C]
    depths,  # i32 [*, C]
    *,
    implementation: str = "pallas",
    tile: int = 512,
    num_warps: int = 1,
    num_stages: int | None = None,
    interpret: bool | None = None,
    assume_sorted: bool = False,
    lanes: int = 16,
):
    """Approximate scores ``f32 [*, G, n]`` (``n = 32 W``) of every token for the ``G`` query heads.

    ``assume_sorted=True`` skips the (tiny) sort of the list by depth when it comes from
    :func:`active_channels`. ``tile`` (tokens, a power of two >= 64) and ``num_warps`` are static tuning knobs.
    ``lanes`` picks the kernel: 16 (default; also 8 or 32, ``tile >= 32 * lanes``) the lanes kernel, 0 the
    first (blocked) kernel. H200, batch 4 x 8 KV heads, 128k, Fathom 48: 0.140 ms (lanes 16, tile 512, 1 warp)
    vs 0.181 ms (blocked, tile 2048, 2 warps); results/kernels_h200.md.
    """
    C.check_implementation(implementation)
    _validate(q, planes, scales, length, channels, depths)
    check_values(channels, depths, planes.shape[-3])
    if implementation == "xla":
        return plane_scan_reference(q, planes, scales, length, channels, depths)
    C.check_pow2("tile", tile)
    if tile < BLOCK_TOKENS:
        raise ValueError(f"tile must be >= {BLOCK_TOKENS} tokens, got {tile}")
    if lanes and (lanes not in (8, 16, 32) or tile < 32 * lanes):
        raise ValueError(f"lanes must be 0 (blocked kernel) or 8, 16, 32 with tile >= 32 * lanes, got {lanes}, tile {tile}")
    return _plane_scan_pallas(
        q, planes, scales, jnp.asarray(length, jnp.int32), channels, depths,
        tile=tile, num_warps=num_warps, num_stages=num_stages, interpret=C.resolve_interpret(interpret),
        assume_sorted=assume_sorted, lanes=int(lanes),
    )


def plane_scan_store(q, store, depths, *, max_active: int | None = None, **kwargs):
    """Convenience: scan a ``fathom_jax.store.PlaneStore`` at per-channel ``depths [*, D]`` (e.g. a ReadPlan's)."""
    channels, dep = active_channels(depths, max_active)
    return plane_scan(q, store.planes, store.scales, store.length, channels, dep, assume_sorted=True, **kwargs)
