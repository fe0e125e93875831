"""The plane scan's kernel bodies: the same scores by two kinds of arithmetic (``PlaneScanConfig.math``).

Both run one program per (group, tile of tokens), one loop per depth class (t = 4, 3, 2, 1, the depth a
compile-time constant) over the listed channels, and fold the block scale and ``1/2^(t-1)`` into per-(channel,
element) weights ``w_h = q_h a / 2^(t-1)``:

* ``f32``: a thread owns ``lanes`` consecutive tokens; each token's code is assembled with constant shifts and made
  a float by the 2^23 magic number (OR into the mantissa, one exact FADD); ``G`` FFMAs per (token, channel).
* ``f16x2``: a thread owns a whole plane word (32 tokens) as 16 pairs (token ``i``, token ``i + 16``), the two halves
  of one 32-bit register: one shift and one mask-or place a plane's bit of both tokens, the pair becomes two exact
  f16 codes by the 1024 magic number, and each query head costs one ``fma.rn.f16x2`` per pair (half the FMAs and
  half the code work of ``f32``). Weights and sums are f16, so each thread first scales its weights by a power of
  two that bounds its sums by 2^14 (no overflow); the result is exact to within the rounding of f16 weights and f16
  partial sums (:func:`pallas_kernels.plane_scan.f16x2_error_bound`).

Planes and scales are read in place through ``memory_space=ANY`` refs (host or device memory), the resident planes
of a tiered store from its hot tier.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.plane_layout import BLOCK_TOKENS, WORD_BITS

_MAGIC = 0x4B000000  # float32 bits of 2^23: bitcast(_MAGIC | c) == 2^23 + c exactly for c < 2^23
_MAGIC2 = 0x64006400  # two f16 1024.0: (_MAGIC2 | c_lo | c_hi << 16) holds 1024 + c in each half, for c < 1024
_ONE2 = 0x3C003C00  # two f16 1.0
SUM_BOUND_LOG2 = 14  # f16x2: each thread's weights are scaled so its sums stay below 2^14 (f16's largest: 65504)


def _stack_lanes(xs):
    """``[E, len(xs)]`` from a list of ``[E]`` tensors (a tree of two-way stacks: Triton's ``join``)."""
    if len(xs) == 1:
        return xs[0][:, None]
    a, b = _stack_lanes(xs[0::2]), _stack_lanes(xs[1::2])
    e, m = a.shape
    return jnp.stack([a, b], axis=-1).reshape(e, 2 * m)


@dataclasses.dataclass(frozen=True)
class Tile:
    """Where a program's scores lie: group ``r``, elements ``e0 .. e0 + elems - 1`` (``emask``: those inside the
    store), their tokens ``tok [elems, lanes]`` and the group's ``length``."""

    r: jax.Array
    e0: jax.Array
    elems: int
    tok: jax.Array
    emask: jax.Array
    length: jax.Array


def store_scores(refs, tile: Tile, scores) -> None:
    """The plane scan's epilogue: every token's score (0 past the length) into ``out f32 [Rc, G, E, lanes]``."""
    (out_ref,) = refs
    valid = tile.tok < tile.length
    for h, s in enumerate(scores):
        plgpu.store(out_ref.at[tile.r, jnp.int32(h), pl.ds(tile.e0, tile.elems), :], jnp.where(valid, s, 0.0),
                    mask=tile.emask[:, None])


class _Planes:
    """Reads slot ``k``'s plane words and block scales for one program (the store, or with resident planes the hot
    tier for planes below ``p_l``, the warm tier for the planes it holds, and the staged buffer for the rest)."""

    def __init__(self, planes_ref, scales_ref, resident, *, layer, src, r, hot_group_start, emask):
        self.planes_ref, self.scales_ref, self.layer, self.src, self.emask = planes_ref, scales_ref, layer, src, emask
        self.resident = resident
        if resident:
            self.hot_ref, tier_ref, self.rch_ref, *warm = resident
            self.warm_ref, self.wrow_ref = warm or (None, None)
            self.n_resident, self.hot_row = tier_ref[0], tier_ref[1]
            self.warm_layer = tier_ref[2] if warm else None  # the tiers' layer (the staged buffer has none)
            self.hot_group = r + hot_group_start
            self.r = r

    def scale(self, j, block):
        return plgpu.load(self.scales_ref.at[self.layer, self.src, j, block], mask=self.emask,
                          other=0.0).astype(jnp.float32)

    def word(self, k, j, p, cols):
        if not self.resident:
            return plgpu.load(self.planes_ref.at[self.layer, self.src, j, jnp.int32(p), cols], mask=self.emask, other=0)
        # plane p from the hot tier, the warm tier (where it holds it) or the staged buffer; the other loads are
        # masked off
        warm = None
        if self.warm_ref is None:
            staged = plgpu.load(self.planes_ref.at[self.layer, self.src, j, jnp.int32(p), cols],
                                mask=self.emask & (p >= self.n_resident), other=0)
        else:
            wrow = self.wrow_ref[self.r, k, p]
            warm = plgpu.load(self.warm_ref.at[self.warm_layer, self.hot_group, jnp.maximum(wrow, 0), cols],
                              mask=self.emask & (wrow >= 0), other=0)
            staged = plgpu.load(self.planes_ref.at[self.layer, self.src, j, jnp.int32(p), cols],
                                mask=self.emask & (p >= self.n_resident) & (wrow < 0), other=0)
        row = jnp.clip(self.hot_row + p, 0, self.hot_ref.shape[0] - 1)
        words = staged | plgpu.load(self.hot_ref.at[row, self.hot_group, self.rch_ref[self.r, k], cols],
                                    mask=self.emask & (p < self.n_resident), other=0)
        return words if warm is None else words | warm


def _bit_to(w, lane: int, s: int):
    """Word ``w`` shifted so that bit ``lane`` (and ``lane + 16``) lands at bit ``s`` (and ``s + 16``)."""
    if lane > s:
        return w >> (lane - s)
    if lane < s:
        return w << (s - lane)
    return w


def _over_depth_classes(bounds_ref, r, body, carry):
    """``carry`` through ``body(t, k, carry)`` over the listed slots ``k`` of each depth class ``t`` = 4, 3, 2, 1 in
    turn (slots sorted by decreasing depth; ``bounds_ref[r]`` the classes' end offsets): one loop per class, ``t`` a
    compile-time constant."""
    start = jnp.int32(0)
    for cls, t in enumerate((4, 3, 2, 1)):
        end = bounds_ref[r, cls]
        carry = jax.lax.fori_loop(start, end, functools.partial(body, t), carry)
        start = end
    return carry


def f32_body(qc_ref, ch_ref, bounds_ref, len_ref, layer_ref, planes_ref, scales_ref, *rest, groups: int, elems: int,
             lanes: int, num_words: int, group_start: int, hot_group_start: int | None, interpret: bool,
             n_resident: int, epilogue):
    """``f32`` arithmetic; ``rest``: the ``n_resident`` refs of the resident planes, then the epilogue's refs, which
    ``epilogue`` (:class:`Tile`) writes from the tile's scores."""
    del interpret
    resident, tail = rest[:n_resident], rest[n_resident:]
    split = WORD_BITS // lanes
    r = pl.program_id(0)
    e0 = pl.program_id(1) * elems
    e = e0 + jnp.arange(elems, dtype=jnp.int32)
    word = e // split if split > 1 else e
    emask = word < num_words
    src = _Planes(planes_ref, scales_ref, resident, layer=layer_ref[0], src=r + group_start, r=r,
                  hot_group_start=hot_group_start, emask=emask)
    block = e // (BLOCK_TOKENS // lanes)
    part_shift = ((e % split) * lanes).astype(jnp.uint32) if split > 1 else None
    cols = word if split > 1 else pl.ds(e0, elems)
    computed = range(lanes)
    acc = tuple(tuple(jnp.zeros((elems,), jnp.float32) for _ in computed) for _ in range(groups))
    bias = tuple(jnp.zeros((elems,), jnp.float32) for _ in range(groups))
    magic = jnp.full((elems,), _MAGIC, jnp.uint32)

    def body(t, k, carry):
        acc, bias = carry
        half = float(2 ** (t - 1))
        j = ch_ref[r, k]
        a = src.scale(j, block) * (1.0 / half)
        wts = [qc_ref[r, h, k] * a for h in range(groups)]
        bias = tuple(bias[h] + wts[h] * (0.5 - half) for h in range(groups))
        words = [src.word(k, j, p, cols) for p in range(t)]
        words = [w >> part_shift for w in words] if split > 1 else words
        new = [list(acc[h]) for h in range(groups)]
        for i, lane in enumerate(computed):
            code = magic
            for p in range(t):
                s = t - 1 - p  # plane p is bit s of c_t
                code = code | (_bit_to(words[p], lane, s) & jnp.uint32(1 << s))
            v = jax.lax.bitcast_convert_type(code, jnp.float32) - float(2**23)  # exact: c_t
            for h in range(groups):
                new[h][i] = new[h][i] + wts[h] * v
        return tuple(tuple(x) for x in new), bias

    acc, bias = _over_depth_classes(bounds_ref, r, body, (acc, bias))

    tok = e[:, None] * lanes + jnp.arange(lanes, dtype=jnp.int32)[None, :]
    scores = [_stack_lanes([x + bias[h] for x in acc[h]]) for h in range(groups)]
    epilogue(tail, Tile(r=r, e0=e0, elems=elems, tok=tok, emask=emask, length=len_ref[r]), scores)


# ----------------------------------------------------------------------------------------------
# f16x2: two tokens per 32-bit register


def _f16_to_f32(bits):
    """The f16 in the low 16 bits of ``bits`` (u32) as f32."""
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)


def _f32_to_f16_bits(x):
    """``x`` rounded to f16 (to nearest even), its bits in the low half of a u32."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint16).astype(jnp.uint32)


def _hfma2(a, b, c, interpret: bool):
    """``a * b + c`` on two f16 per u32 (``fma.rn.f16x2``); interpreted: emulated in f32 (the product of two f16 is
    exact in f32, the sum rounds to f32 and then to f16: equal to the fused rounding but for rare double roundings)."""
    if not interpret:  # Triton's inline asm takes signless integers: i32 in and out
        i32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
        [out] = plgpu.elementwise_inline_asm(
            "fma.rn.f16x2 $0, $1, $2, $3;", args=[i32(a), i32(b), i32(c)], constraints="=r,r,r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)])
        return jax.lax.bitcast_convert_type(out, jnp.uint32)
    half = lambda x, shift: _f16_to_f32(x >> shift if shift else x & 0xFFFF)
    lo, hi = (_f32_to_f16_bits(half(a, s) * half(b, s) + half(c, s)) for s in (0, 16))
    return lo | (hi << 16)


def _pow2_from_exponent(bits):
    """``2^(bits - 127)`` as f32 from an i32 biased exponent in [1, 254]."""
    return jax.lax.bitcast_convert_type((bits << 23).astype(jnp.uint32), jnp.float32)


def f16x2_body(qc_ref, qbound_ref, ch_ref, bounds_ref, len_ref, layer_ref, planes_ref, scales_ref, *rest, groups: int,
               elems: int, lanes: int, num_words: int, group_start: int, hot_group_start: int | None, interpret: bool,
               n_resident: int, epilogue):
    """``f16x2`` arithmetic (``lanes`` = 32: a thread owns a word); ``rest`` as :func:`f32_body`'s. ``qbound [Rc]``:
    the sum over the listed channels of the largest ``|q|`` of the group's heads (bounds each thread's sums)."""
    assert lanes == WORD_BITS
    resident, tail = rest[:n_resident], rest[n_resident:]
    pairs = WORD_BITS // 2
    r = pl.program_id(0)
    e0 = pl.program_id(1) * elems
    e = e0 + jnp.arange(elems, dtype=jnp.int32)  # the thread's word
    emask = e < num_words
    src = _Planes(planes_ref, scales_ref, resident, layer=layer_ref[0], src=r + group_start, r=r,
                  hot_group_start=hot_group_start, emask=emask)
    block = e // (BLOCK_TOKENS // WORD_BITS)
    cols = pl.ds(e0, elems)
    full = lambda value: jnp.full((elems,), value, jnp.uint32)

    # Each thread's sums are at most qbound * (its block's largest listed scale): scale its weights by s = 2^m with
    # that product times s in [2^13, 2^14), so no partial sum overflows f16 and the scores keep f16's relative
    # precision.
    top = jax.lax.fori_loop(0, bounds_ref[r, 3], lambda k, m: jnp.maximum(m, src.scale(ch_ref[r, k], block)),
                            jnp.zeros((elems,), jnp.float32))
    exponent = (jax.lax.bitcast_convert_type(top * qbound_ref[r], jnp.int32) >> 23) & 0xFF
    scale_bits = jnp.clip(127 + SUM_BOUND_LOG2 - 1 + 127 - exponent, 1, 253)  # s and 1/s normal floats (no flush)
    s, inv_s = _pow2_from_exponent(scale_bits), _pow2_from_exponent(254 - scale_bits)

    acc = tuple(tuple(jnp.zeros((elems,), jnp.uint32) for _ in range(pairs)) for _ in range(groups))
    bias = tuple(jnp.zeros((elems,), jnp.float32) for _ in range(groups))
    # two f16 -(1024 + 2^(t-1)) per depth: (1024 + c) - (1024 + 2^(t-1)) = c - 2^(t-1), exact
    offsets = {t: full((0xE400 + 2 ** (t - 1)) * 0x10001) for t in (4, 3, 2, 1)}

    def body(t, k, carry):
        acc, bias = carry
        half = float(2 ** (t - 1))
        j = ch_ref[r, k]
        a = src.scale(j, block) * (1.0 / half)
        q = [qc_ref[r, h, k] for h in range(groups)]
        bias = tuple(bias[h] + q[h] * a * 0.5 for h in range(groups))  # value = (c - 2^(t-1)) a / 2^(t-1) + a / 2^t
        wts = [_f32_to_f16_bits(q[h] * a * s) * 0x10001 for h in range(groups)]
        words = [src.word(k, j, p, cols) for p in range(t)]
        new = [list(acc[h]) for h in range(groups)]
        for i in range(pairs):
            code = full(_MAGIC2)
            for p in range(t):
                s_bit = t - 1 - p  # plane p is bit s_bit of c_t, for token i and token i + 16
                code = code | (_bit_to(words[p], i, s_bit) & jnp.uint32((1 << s_bit) | (1 << (s_bit + 16))))
            v = _hfma2(code, full(_ONE2), offsets[t], interpret)
            for h in range(groups):
                new[h][i] = _hfma2(wts[h], v, new[h][i], interpret)
        return tuple(tuple(x) for x in new), bias

    acc, bias = _over_depth_classes(bounds_ref, r, body, (acc, bias))

    tok = e[:, None] * WORD_BITS + jnp.arange(WORD_BITS, dtype=jnp.int32)[None, :]
    scores = []
    for h in range(groups):
        lo = [_f16_to_f32(x & 0xFFFF) * inv_s + bias[h] for x in acc[h]]
        hi = [_f16_to_f32(x >> 16) * inv_s + bias[h] for x in acc[h]]
        scores.append(_stack_lanes(lo + hi))
    epilogue(tail, Tile(r=r, e0=e0, elems=elems, tok=tok, emask=emask, length=len_ref[r]), scores)
