"""The plane scan as a matrix product on tensor cores: the ``"mma"`` variant of :mod:`pallas_kernels.plane_scan`.

With ``s_p = 2 b_p - 1`` the sign of plane ``p``'s bit, the t-bit mid-rise value of a code is a signed binary
expansion with no constant term (the quantizer is symmetric)::

    value(t) = (c_t + 1/2 - 2^(t-1)) a / 2^(t-1) = a * sum_{p < t} s_p 2^-(p+1)

so for one group, with one row per read (slot ``k``, plane ``p < t_k``) pair::

    score[h, i] = sum_rows W[h, row] * B[row, i],   W = q[h, channel] 2^-(p+1),   B = s_p(i) * a_channel(block(i))

``B`` is exact in fp16 (a sign flip of the fp16 block scale), so the block scales need no per-block weights: one
product covers a whole tile of tokens. ``W`` is split into two fp16 parts ``hi + lo`` (two fp16 products,
accumulated in f32: tensor-core ``mma``/``wgmma`` through Triton's ``dot``), after scaling each group's queries by a
power of two ``2^-e`` (exact, undone on the output) so the largest ``|W|`` lies in ``[2^13, 2^14)``: high in fp16's
range (products with ``|B| < 2^16`` stay far inside f32's) and far above its subnormals.

Error, derived: ``hi`` rounds ``W`` to 11 bits, ``lo`` the remainder to 11 more or, below fp16's normal range, to an
absolute step of ``2^-24``; products of fp16 values are exact in f32. Per term ``|err| <= (2^-22 |W| + 2^-25) a`` in
units of ``2^-e``, i.e. ``2^-22`` relative plus ``2^-38`` of the largest weight, then the f32 accumulation over ``K``
rows (``K 2^-24`` of the sum of ``|terms|`` at worst). The tests hold each score to ``2^-16 m sum_k a_k`` (``m`` the
group's largest ``|q|``, which bounds the sum of ``|terms|``), with margin for the accumulation order; the lanes
kernel is exact to f32 rounding instead. Rows are padded to a multiple of 16 with zero weights; the ``G`` heads to 16
product rows (Triton's ``dot`` needs every dimension >= 16), of which only the first ``G`` are stored.

The row table (which channel and plane each product row reads, and ``W``) is built here in plain jnp from the run
list: any order of slots, any depths. Planes and scales are read in place (``memory_space=ANY``), as the lanes
kernel reads them, resident planes of a tiered store included.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels import backend as B
from pallas_kernels.plane_layout import BLOCK_TOKENS, N_PLANES, WORD_BITS

KERNEL_NAME = "fathom_plane_scan_mma"
MIN_ROWS = 16  # the least M, N and K of a Triton dot


def _head_rows(groups: int) -> int:
    """Product rows for ``groups`` heads: a power of two >= 16."""
    return max(MIN_ROWS, 1 << (groups - 1).bit_length())


def _fp16_normal_part(w: Float[Array, "*s"]) -> Float[Array, "*s"]:
    """``w`` (f32) rounded to nearest-even at 11 significant bits, 0 below fp16's normal range (``2^-14``): an f32
    that converts to fp16 exactly. Integer operations, not an ``f32 -> f16 -> f32`` round trip: XLA's GPU pipeline
    (``xla_allow_excess_precision``, on by default) folds that pair to the identity, which would zero ``lo``."""
    bits = jax.lax.bitcast_convert_type(w, jnp.uint32)
    half = jnp.uint32((1 << 12) - 1) + ((bits >> 13) & 1)  # round half to even on the 13 dropped mantissa bits
    hi = jax.lax.bitcast_convert_type((bits + half) & jnp.uint32(0xFFFFE000), jnp.float32)
    return jnp.where(jnp.abs(w) < 2.0 ** -14, 0.0, hi)


def row_table(q: Float[Array, "R G C"], depths: Int[Array, "R C"], rows: int = MIN_ROWS):
    """The product rows of each group: ``(slot i32 [R, K], plane i32 [R, K], w_hi f16 [R, Gp, K], w_lo f16 [R, Gp, K],
    steps i32 [R], unscale f32 [R])`` with ``K = 4 C`` rounded up to ``rows`` (the rows of one step of the K loop);
    rows of read planes first, the rest with zero weights. ``q``: the query features of each slot."""
    r, g, c = q.shape
    k = -(-N_PLANES * c // rows) * rows
    plane = jnp.arange(N_PLANES, dtype=jnp.int32)
    read = (plane[None, None, :] < depths[..., None]).reshape(r, N_PLANES * c)
    order = jnp.argsort(~read, axis=-1, stable=True).astype(jnp.int32)  # read rows first, slot-major
    read = jnp.take_along_axis(read, order, axis=-1)
    pad = ((0, 0), (0, k - N_PLANES * c))
    slot, plane = jnp.pad(order // N_PLANES, pad), jnp.pad(order % N_PLANES, pad)
    read = jnp.pad(read, pad)
    q = q.astype(jnp.float32)
    top = jnp.max(jnp.abs(q), axis=(1, 2))
    _, e = jnp.frexp(jnp.where(top > 0, top, 1.0))  # top = f 2^e, f in [1/2, 1)
    e = e - 15  # the largest |q| to [2^14, 2^15): fp16's subnormal steps lie 2^-38 below the largest weight
    qs = jnp.ldexp(q, -e[:, None, None])
    w = jnp.take_along_axis(qs, slot[:, None, :], axis=-1) * jnp.ldexp(1.0, -(plane + 1))[:, None, :]
    w = jnp.where(read[:, None, :], w, 0.0)
    w = jnp.pad(w, ((0, 0), (0, _head_rows(g) - g), (0, 0)))
    hi = _fp16_normal_part(w)
    lo = (w - hi).astype(jnp.float16)  # exact remainder in f32, one rounding to fp16
    hi = hi.astype(jnp.float16)  # exact: hi holds 11 significant bits in fp16's normal range
    steps = (jnp.sum(read, axis=-1, dtype=jnp.int32) + rows - 1) // rows
    return slot, plane, hi, lo, steps, jnp.ldexp(jnp.ones_like(top), e)


def plane_scan_mma_reference(q: Float[Array, "R G C"], planes: Int[Array, "R C 4 W"], scales: Float[Array, "R C NB"],
                             length: Int[Array, "R"], depths: Int[Array, "R C"]) -> Float[Array, "R G n"]:
    """The product in plain jnp (f32, unsplit weights): slot ``c`` of ``planes``/``scales`` scored by ``q[..., c]``
    at depth ``depths[c]``; tokens past ``length`` score 0. Independent of the kernel and of the lanes reference:
    signed bits times scales, contracted over (slot, plane)."""
    n = WORD_BITS * planes.shape[-1]
    bits = (planes[..., None] >> jnp.arange(WORD_BITS, dtype=jnp.uint32)) & 1
    signs = 2.0 * bits.reshape(*planes.shape[:-1], n).astype(jnp.float32) - 1.0  # [R, C, 4, n]
    a = jnp.repeat(scales.astype(jnp.float32), BLOCK_TOKENS, axis=-1)[..., None, :]  # [R, C, 1, n]
    weight = jnp.where(jnp.arange(N_PLANES) < depths[..., None], 2.0 ** -(jnp.arange(N_PLANES) + 1.0), 0.0)
    scores = jnp.einsum("rgc,rcp,rcpn->rgn", q.astype(jnp.float32), weight, signs * a,
                        precision=jax.lax.Precision.HIGHEST)
    return jnp.where(jnp.arange(n) < length[:, None, None], scores, 0.0)


def _plane_scan_mma_kernel(
    slot_ref,  # i32 [R, K]          slot (channel of the store) of each product row
    plane_ref,  # i32 [R, K]         plane of each product row
    hi_ref,  # f16 [R, Gp, K]        weights, high part
    lo_ref,  # f16 [R, Gp, K]        weights, low part
    steps_ref,  # i32 [R]            steps of the K loop holding read rows
    unscale_ref,  # f32 [R]          2^e
    len_ref,  # i32 [R]
    layer_ref,  # i32 [1]
    planes_ref,  # u32 [L, R', D, 4, W] (any memory space)
    scales_ref,  # f16 [L, R', D, NB]
    *rest,  # with resident planes: hot u32 [Nh, R', D, W], (p_l, first hot row) i32 [2], store channel i32 [R, K];
    # then the output f32 [R, G, n]
    groups: int,
    head_rows: int,
    rows: int,
    tile: int,
    num_words: int,
    group_start: int,
    hot_group_start: int | None,
):
    *resident, out_ref = rest
    r, t0 = pl.program_id(0), pl.program_id(1) * tile
    layer, src = layer_ref[0], r + group_start
    word = t0 // WORD_BITS + jnp.arange(tile // WORD_BITS, dtype=jnp.int32)
    block = t0 // BLOCK_TOKENS + jnp.arange(tile // BLOCK_TOKENS, dtype=jnp.int32)
    wmask, bmask = (word < num_words)[None, :], (block < num_words // 2)[None, :]
    bit = jnp.arange(WORD_BITS, dtype=jnp.uint32)

    def body(step, acc):
        k = step * rows + jnp.arange(rows, dtype=jnp.int32)
        ch, p = plgpu.load(slot_ref.at[r, k])[:, None], plgpu.load(plane_ref.at[r, k])[:, None]
        if resident:  # plane p from the hot tier or the staged buffer; the other load is masked off
            hot_ref, tier_ref, store_ch_ref = resident
            n_resident, hot_row = tier_ref[0], tier_ref[1]
            words = plgpu.load(planes_ref.at[layer, src, ch, p, word[None, :]], mask=wmask & (p >= n_resident), other=0)
            hot = jnp.clip(hot_row + p, 0, hot_ref.shape[0] - 1)
            words = words | plgpu.load(hot_ref.at[hot, r + hot_group_start, plgpu.load(store_ch_ref.at[r, k])[:, None],
                                                  word[None, :]], mask=wmask & (p < n_resident), other=0)
        else:
            words = plgpu.load(planes_ref.at[layer, src, ch, p, word[None, :]], mask=wmask, other=0)
        bits = ((words[:, :, None] >> bit[None, None, :]) & 1).reshape(rows, tile)
        a = plgpu.load(scales_ref.at[layer, src, ch, block[None, :]], mask=bmask, other=0).astype(jnp.float16)
        a = jnp.broadcast_to(a[:, :, None], (rows, tile // BLOCK_TOKENS, BLOCK_TOKENS)).reshape(rows, tile)
        b = jnp.where(bits != 0, a, -a)
        cols = pl.ds(step * rows, rows)
        hi = plgpu.load(hi_ref.at[r, pl.ds(0, head_rows), cols])
        lo = plgpu.load(lo_ref.at[r, pl.ds(0, head_rows), cols])
        f32 = jnp.float32
        return acc + jnp.dot(hi, b, preferred_element_type=f32) + jnp.dot(lo, b, preferred_element_type=f32)

    acc = jax.lax.fori_loop(0, steps_ref[r], body, jnp.zeros((head_rows, tile), jnp.float32))
    head = jnp.arange(head_rows, dtype=jnp.int32)
    tok = t0 + jnp.arange(tile, dtype=jnp.int32)
    out = jnp.where(tok[None, :] < len_ref[r], acc * unscale_ref[r], 0.0)
    # Padded head rows are masked off (never addressed on the GPU, dropped by interpret mode's scatter); a clipped
    # index would make duplicate writes whose order interpret mode does not fix.
    plgpu.store(out_ref.at[r, head[:, None], tok[None, :]], out,
                mask=(head < groups)[:, None] & (tok < num_words * WORD_BITS)[None, :])


@functools.partial(jax.jit, static_argnames=("tile", "rows", "num_warps", "num_stages", "interpret", "hot_group_start",
                                             "group_start"))
def plane_scan_mma_pallas(q, channels, depths, length, layer, planes, scales, extra: tuple, *, tile: int, rows: int,
                          num_warps: int, num_stages: int | None, interpret: bool, group_start: int,
                          hot_group_start: int | None):
    """Scores ``f32 [R, G, n]`` of queries ``q [R, G, D]`` over slots ``channels, depths [R, C]`` of a stacked store
    ``planes [L, R', D, 4, W]`` / ``scales [L, R', D, NB]`` at ``layer i32 [1]`` (groups ``group_start ..``); ``extra``:
    the resident planes' ``(hot, (p_l, first hot row), store channels [R, C])`` (hot groups ``hot_group_start ..``).
    Operands checked by the caller (:func:`pallas_kernels.plane_scan.plane_scan`)."""
    if tile % BLOCK_TOKENS or not B.is_pow2(tile):
        raise ValueError(f"tile must be a power of two >= {BLOCK_TOKENS}, got {tile}")
    if rows % MIN_ROWS or not B.is_pow2(rows):
        raise ValueError(f"rows must be a power of two >= {MIN_ROWS}, got {rows}")
    if scales.dtype != jnp.float16:
        raise TypeError(f"scales must be float16 for the mma plane scan (exact fp16 operands), got {scales.dtype}")
    r, g, _ = q.shape
    w = planes.shape[-1]
    qc = jnp.take_along_axis(q.astype(jnp.float32), channels[:, None, :], axis=-1)
    slot, plane, hi, lo, steps, unscale = row_table(qc, depths, rows)
    store_ch = jnp.take_along_axis(channels, slot, axis=-1)
    if extra:  # the resident planes are read at the slot's store channel
        extra = (*extra[:2], jnp.take_along_axis(extra[2], slot, axis=-1))
    kernel = functools.partial(_plane_scan_mma_kernel, groups=g, head_rows=hi.shape[1], rows=rows, tile=tile,
                               num_words=w, group_start=group_start, hot_group_start=hot_group_start)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((r, g, w * WORD_BITS), jnp.float32),
        grid=(r, pl.cdiv(w * WORD_BITS, tile)),
        in_specs=[B.any_spec()] * (10 + len(extra)),
        interpret=interpret,
        name=KERNEL_NAME,
        compiler_params=B.compiler_params(num_warps, num_stages),
    )(store_ch, plane, hi, lo, steps, unscale, length, layer, planes, scales, *extra)
