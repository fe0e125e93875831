"""The sweep's token selection on the CPU: :func:`fathom_jax.select.select_topk`'s result, bit for bit, in
about half its time.

XLA:CPU's TopK runs ``std::partial_sort`` over every entry of a row, calling a comparator each time. Most
of a row cannot make its top ``k``: a few counting passes find a floor with at least ``k`` entries at or
above it (the top ``k`` all lie there), those ~``k`` entries are gathered in position order, and a radix
sort of plain ``uint32`` words orders them as TopK does: by value (TopK's total order, -0 below +0), ties
by lower position. The same entries come out, in the same order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS, check_k, selection_priority

# Leading bits of the floor: sign, exponent and 7 mantissa bits, so it lies within 1% of the k-th entry; on
# SmolLM2's rows at most k + 20% entries reach it (k = 256). Each bit is a pass over the row.
FLOOR_BITS = 16
WORD = 32  # entries per word of the candidate bitmask


def select_topk(
    scores: Float[Array, "*B G n"],
    length: Int[Array, "*B"],
    k: int,
    *,
    sink: int = SINK_TOKENS,
    local: int = LOCAL_TOKENS,
) -> tuple[Int[Array, "*B G k"], Bool[Array, "*B G k"]]:
    """:func:`fathom_jax.select.select_topk` with ``implementation="xla"``: the same indices and mask."""
    n = scores.shape[-1]
    check_k(k, n, sink, local)
    priority = selection_priority(scores, length, sink=sink, local=local)  # no NaN: see selection_priority
    key = total_order_key(priority)
    keep = key >= _floor(key, k)[..., None]
    slots = min(n, -(-5 * k // 4 // WORD) * WORD)  # room for the entries at or above the floor

    def gathered():
        at = _compact(keep, slots)  # [*B, G, slots] positions, increasing
        filled = jnp.arange(slots) < jnp.sum(keep, axis=-1, keepdims=True)
        values = jnp.take_along_axis(priority, at, axis=-1)
        # Descending key, then ascending slot (= position); empty slots after every candidate.
        order = _sort_slots(jnp.where(filled, ~total_order_key(values), jnp.uint32(0xFFFFFFFF)))[..., :k]
        return jnp.take_along_axis(values, order, axis=-1), jnp.take_along_axis(at, order, axis=-1)

    def whole_rows():  # more candidates than slots in some row (ties at the floor): rank them in place
        # Entries below the floor turned -inf rank after every candidate: a candidate at -inf would tie with
        # them, but then the floor is -inf's key, the lowest there is (no NaN), and none lies below it.
        top, idx = jax.lax.top_k(jnp.where(keep, priority, -jnp.inf), k)
        return top, idx

    top, idx = jax.lax.cond(jnp.all(jnp.sum(keep, axis=-1) <= slots), gathered, whole_rows)
    return idx.astype(jnp.int32), top > -jnp.inf


def total_order_key(x: Float[Array, "..."]) -> jax.Array:
    """``uint32`` keys that order float32 values as TopK's comparator does (-0 below +0; no NaN expected)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _floor(key: jax.Array, k: int) -> jax.Array:
    """The largest key with at most ``FLOOR_BITS`` leading bits set such that at least ``k`` keys of the
    row are at or above it: a bitwise binary search, one counting pass per bit."""

    ones = jnp.ones(key.shape[-1], jnp.float32)

    def narrow(i, floor):
        trial = floor | jnp.left_shift(jnp.uint32(1), (31 - i).astype(jnp.uint32))
        # Counted by a product with ones (exact below 2^24 entries): XLA:CPU runs it faster than a sum.
        count = jnp.einsum("...n,n->...", (key >= trial[..., None]).astype(jnp.float32), ones)
        return jnp.where(count >= k, trial, floor)

    return jax.lax.fori_loop(0, FLOOR_BITS, narrow, jnp.zeros(key.shape[:-1], jnp.uint32))


def _sort_slots(v: jax.Array) -> jax.Array:
    """The slots of each row ordered by ``(v, slot)``, ascending: two passes of a least-significant-digit radix
    sort whose digits carry the slot (or the first pass's rank) in their low bits, so that XLA:CPU sorts plain
    ``uint32`` values, natively (a sort with a comparator calls it per comparison, as TopK does)."""
    slots = v.shape[-1]
    tag = max(1, (slots - 1).bit_length())  # bits of a slot number
    low = 32 - tag  # the first pass sorts by v's low bits, the second by its top `tag` bits
    index = jnp.arange(slots, dtype=jnp.uint32)
    first = jnp.sort(((v & jnp.uint32((1 << low) - 1)) << tag) | index, axis=-1) & jnp.uint32((1 << tag) - 1)
    top = jnp.take_along_axis(v, first.astype(jnp.int32), axis=-1) >> low
    second = jnp.sort((top << tag) | index, axis=-1) & jnp.uint32((1 << tag) - 1)
    return jnp.take_along_axis(first, second.astype(jnp.int32), axis=-1).astype(jnp.int32)


def _compact(keep: Bool[Array, "*R n"], slots: int) -> Int[Array, "*R slots"]:
    """Positions of the first ``slots`` set entries of each row, in increasing order (past the last set
    entry: any position). The row as a bitmask of 32-entry words: the word holding set entry s is found by
    binary search over the words' running counts, the entry within it by halving with popcounts."""
    *batch, n = keep.shape
    pad = -n % WORD
    keep = jnp.pad(keep, [(0, 0)] * len(batch) + [(0, pad)]).reshape(-1, (n + pad) // WORD, WORD)
    words = jnp.sum(keep.astype(jnp.uint32) << jnp.arange(WORD, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
    counts = jax.lax.population_count(words).astype(jnp.int32)
    ends = jnp.cumsum(counts, axis=-1)  # set entries up to the end of each word
    s = jnp.arange(slots, dtype=jnp.int32)
    word = jax.vmap(lambda e: jnp.searchsorted(e, s, side="right", method="scan_unrolled"))(ends)
    word = jnp.minimum(word.astype(jnp.int32), words.shape[-1] - 1)
    bits = jnp.take_along_axis(words, word, axis=-1)
    rank = s - jnp.take_along_axis(ends - counts, word, axis=-1)  # of entry s among its word's set bits
    offset = jnp.zeros_like(rank)
    for width in (16, 8, 4, 2, 1):  # which half of the remaining bits holds it
        low = bits & jnp.uint32((1 << width) - 1)
        below = jax.lax.population_count(low).astype(jnp.int32)
        upper = rank >= below
        rank = jnp.where(upper, rank - below, rank)
        bits = jnp.where(upper, bits >> jnp.uint32(width), low)
        offset = offset + jnp.where(upper, width, 0)
    return jnp.minimum(word * WORD + offset, n - 1).reshape(*batch, slots)
