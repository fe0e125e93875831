"""One sparse-attention step: plan -> read -> scan -> select -> union -> fetch -> attend.

Written once, for every scan method and both placements: the decoder's sparse attention
(:mod:`fathom_jax.decode`) calls it per layer inside its layer scan, with the index and K/V cache in
HBM or in ``pinned_host`` memory; the kernels read host arrays in place, the jnp reference reads HBM.

Per KV group ``r`` (``R = batch x KV heads`` groups, ``G`` query heads each):

1. plan: the method's read for the group's queries (Fathom: importance and depths by the planner);
2. read + scan: approximate scores of every stored position (:func:`fathom_jax.scan.execute`);
3. select: per query head 4 sink + 32 local + the top-(k - 36) by approximate score;
4. union: the group's G sets as one fixed-size list (``G k`` slots, duplicates masked);
5. fetch: the union's K/V rows (one copy serves every head of the group);
6. attend: exact softmax attention of each head over its own k rows.

With a row cache (:class:`fathom_jax.sparse_cache.RowCache`) step 5 fetches only the rows its slots miss and takes
the rest from device memory, and the step returns what to store in the slots: the rows attended are the same bits.

During decode the newest token is not yet in the stored cache (stores are written once per step,
after all layers: :class:`NewToken`): its block of every index part and its K/V row are patched in from
device memory, so the step sees exactly the cache that holds it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from fathom_jax import scan as scan_lib
from fathom_jax import store as store_lib
from fathom_jax.calibrate import Calibration
from fathom_jax.format import BLOCK_TOKENS, LANDMARK_TOKENS
from fathom_jax.index import KeyIndex
from fathom_jax.methods.base import KeyRead, LandmarkRead, PlaneRead, ScanMethod
from fathom_jax.placement import Placement, group_window
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS, attend, group_union, select_topk
from fathom_jax.sparse_cache import RowCache, RowFill, join_kv, key_columns, row_lookup, split_kv
from pallas_kernels import backend
from pallas_kernels.row_fetch import row_fetch
from pallas_kernels.topk import TopkConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NewToken:
    """The token a decode step adds, per group: what the stored cache lacks until the step writes it.

    ``position`` is its slot (the length before the step); ``blocks[part]`` the newest 64-token block of
    each plane store after appending it (plane words ``[R, D, 4, 2]``, fp16 scales ``[R, D]``), as
    :func:`fathom_jax.store.append_block` computes; ``landmark`` the newest 8-token block mean.
    """

    position: Int[Array, "R"]
    key: Float[Array, "R D"]
    value: Float[Array, "R D"]
    blocks: dict = dataclasses.field(default_factory=dict)
    landmark: Float[Array, "R D"] | None = None


def _put_block(scores, block_scores, start):
    """``scores [R, G, n]`` with ``block_scores [R, G, m]`` written at position ``start [R]`` (clipped in range)."""
    return jax.vmap(lambda s, b, at: jax.lax.dynamic_update_slice(s, b, (0, at)))(scores, block_scores, start)


def patch_scores(scores, read, new: NewToken):
    """Scores of the newest block from the fresh block data (the stored block is stale until written)."""
    p = new.position
    if isinstance(read, PlaneRead):
        words, scale = new.blocks[read.part]
        codes = store_lib.unpack_planes(words, read.depths)  # [R, 64, D]
        values = store_lib.dequantize_codes(codes, scale.astype(jnp.float32)[:, None, :], read.depths[:, None, :])
        block = scan_lib.dot(read.queries, values)
        if read.shift is not None:
            block = block + read.shift[..., None]
        return _put_block(scores, block, p // BLOCK_TOKENS * BLOCK_TOKENS)
    if isinstance(read, LandmarkRead):
        block = scan_lib.dot(read.queries, new.landmark.astype(jnp.float32)[:, None, :])  # [R, G, 1]
        block = jnp.repeat(block, LANDMARK_TOKENS, axis=-1)
        return _put_block(scores, block, p // LANDMARK_TOKENS * LANDMARK_TOKENS)
    return _put_block(scores, scan_lib.dot(read.queries, new.key[:, None, :].astype(jnp.float32)), p)


def _put_row(x, row, at):
    """``x [R, C, Dh]`` with ``row [R, Dh]`` written at position ``at [R]``."""
    return jax.vmap(lambda a, b, i: jax.lax.dynamic_update_slice(a, b[None].astype(a.dtype), (i, 0)))(x, row, at)


def sparse_attention_step(
    method: ScanMethod,
    q: Float[Array, "R G D"],
    index: KeyIndex,
    kv_cache: Float[Array, "*L R C 2Dh"],
    length: Int[Array, "R"],
    calib: Calibration | None = None,
    *,
    k: int,
    sink: int = SINK_TOKENS,
    local: int = LOCAL_TOKENS,
    layer=None,
    kv_layer=None,
    new: NewToken | None = None,
    placement: Placement = Placement(),
    implementation: backend.Implementation = "xla",
    topk: TopkConfig | None = None,
    row_cache: RowCache | None = None,
):
    """Sparse attention of the ``G`` query heads of every group; returns the output ``[R, G, Dh]`` and bits per
    token ``[R]`` (and, with ``row_cache``, the :class:`~fathom_jax.sparse_cache.RowFill` to store).

    ``index`` holds this layer's small leaves and (with ``layer``) the stacked bulk arrays; ``kv_cache``
    is ``[L, R, C, 2 Dh]`` with ``layer`` (``[R, C, 2 Dh]`` without), each token's key and value side by
    side (:class:`fathom_jax.sparse_cache.SparseCache`); ``length`` counts the valid tokens, the new one
    included; ``new`` patches in the token the stored cache does not hold yet. ``kv_layer`` (default:
    ``layer``) is the layer of the K/V cache to read (0 for a row buffer shared by every layer). ``topk``
    configures the top-k kernels (:class:`pallas_kernels.topk.TopkConfig`; None: their defaults). ``row_cache``:
    slots from which the rows they hold are taken instead of fetched, stacked like the K/V cache (``[L, R, C, ...]``
    read at ``layer``; ``[R, C, ...]`` without one); a dense read fetches every row and ignores it.

    With a stacked cache and ``placement.streams > 1`` the groups are split into that many chunks, each
    stepped on its own GPU stream (:meth:`fathom_jax.placement.Placement.per_stream`); with
    ``placement.chunks(...) > 1`` into that many chunks whose plane transfers are chained (:func:`_pipelined`).
    Either way every group's result is the same as in one chunk.
    """
    kv_layer = layer if kv_layer is None else kv_layer
    kw = dict(k=k, sink=sink, local=local, placement=placement, implementation=implementation, topk=topk)
    groups = q.shape[0]
    if row_cache is not None:
        _check_row_cache(row_cache, groups, kv_cache, stacked=layer is not None)
    chunks = placement.chunks(groups, kv_cache.shape[-2]) if layer is not None else 1
    if groups % chunks:
        raise ValueError(f"placement pipeline={chunks} must divide the {groups} groups (batch x KV heads) of the step")
    if chunks > 1:
        outs = _pipelined(method, q, index, length, calib, new, row_cache, kv_cache, layer, kv_layer, chunks=chunks,
                          **kw)
    else:
        step = functools.partial(_step_groups, method, **kw)
        if layer is None or placement.streams == 1:
            outs = [step(0, groups, q, index, length, calib, new, row_cache, kv_cache, layer, kv_layer)]
        else:
            outs = placement.per_stream(step, groups, (q, index, length, calib, new),
                                        (row_cache, kv_cache, layer, kv_layer))
    out = jax.tree.map(lambda *parts: jnp.concatenate(parts), *outs) if len(outs) > 1 else outs[0]
    return out if row_cache is not None else out[:2]


def _check_row_cache(row_cache: RowCache, groups: int, kv_cache, *, stacked: bool) -> None:
    slots = row_cache.slots
    lead = row_cache.tags.shape[:1] if stacked else ()
    if row_cache.tags.shape != (*lead, groups, slots) or row_cache.tags.dtype != jnp.int32:
        axes = "[L, R, C]" if stacked else "[R, C]"
        raise ValueError(f"row_cache.tags must be i32 {axes} with R = {groups} groups, got {row_cache.tags.dtype} "
                         f"{row_cache.tags.shape}")
    want = (*lead, groups, slots, kv_cache.shape[-1])
    if row_cache.rows.shape != want or row_cache.rows.dtype != kv_cache.dtype:
        raise ValueError(f"row_cache.rows must be {kv_cache.dtype} {list(want)} (the K/V cache's rows), got "
                         f"{row_cache.rows.dtype} {list(row_cache.rows.shape)}")


def _pipelined(method, q, index, length, calib, new, row_cache, kv_cache, layer, kv_layer, *, chunks, placement, **kw):
    """The step in ``chunks`` chunks of groups: one plan for all, then per chunk the rest, each
    chunk's plane transfer ordered after the previous chunk's (and after nothing else), so that it can run
    beside the previous chunk's scan, selection, row fetch and attention (see :mod:`fathom_jax.placement`).

    The next-to-last chunk's row fetch waits for the last chunk's scan (``FETCH_AFTER_NEXT_SCAN``): where both were
    ready together they shared the SMs, and the layer's last scan, which the rest of the layer waits on, ran at half
    speed. Returns the chunks' outputs (a list)."""
    q = q.astype(jnp.float32)
    read = method.read(q, index, calib, implementation=kw["implementation"])
    groups = q.shape[0]
    size = groups // chunks
    outs, staged, pending = [], None, None
    for start in range(0, groups, size):
        chunk = [group_window(a, start, size) for a in (read, q, index, length, new)]
        selected, staged = _select(*chunk, row_cache, start, kv_cache, layer, kv_layer, placement=placement,
                                   after=staged, **kw)
        if not isinstance(selected, _Selected):  # a dense read: attended already
            outs.append(selected)
            continue
        if pending is not None:
            last = start + size == groups
            wait = FETCH_AFTER_NEXT_SCAN == "every" or (FETCH_AFTER_NEXT_SCAN == "last" and last)
            outs.append(_fetch_attend(pending, kv_cache, kv_layer, placement=placement,
                                      after=selected.scores if wait else None, **kw))
        pending = selected
    if pending is not None:
        outs.append(_fetch_attend(pending, kv_cache, kv_layer, placement=placement, **kw))
    return outs


# Which pipelined chunks' row fetches wait for the next chunk's scan: "last" (the next-to-last chunk's, for the last
# scan), "every" or "none". The scan of one group of 1M tokens took 35 us alone and 63 us beside the previous chunk's
# fetch; on the H200 (run aa2) "every" against "none" took 17.65 against 18.79 ms per 128k step (2 chunks: the same
# as "last") and 67.21 against 66.72 at 1M (8 chunks).
FETCH_AFTER_NEXT_SCAN = "last"


def _step_groups(method, group_start, size, q, index, length, calib, new, row_cache, kv_cache, layer, kv_layer, **kw):
    """The step for groups ``group_start .. group_start + size - 1`` of the stacked cache (all of them when
    unstacked): per-group arguments hold those groups only, the bulk arrays all of them."""
    q = q.astype(jnp.float32)
    # a key read plans nothing from the keys themselves
    read = method.read(q, index, calib, implementation=kw["implementation"])
    selected, _ = _select(read, q, index, length, new, row_cache, group_start, kv_cache, layer, kv_layer, **kw)
    if not isinstance(selected, _Selected):  # a dense read: attended already
        return selected
    return _fetch_attend(selected, kv_cache, kv_layer, **kw)


@dataclasses.dataclass(frozen=True)
class _Selected:
    """A chunk's selection, before its rows are fetched: ``slots [Rc, S]`` (the union, -1 where masked), ``wanted``
    (the slots to fetch: those the row cache misses), ``member`` (which head attends which slot), the row cache's
    ``hit`` / ``cached`` rows (None without one), and the chunk's ``scores`` (what a later fetch may wait for)."""

    q: jax.Array
    bits: jax.Array
    slots: jax.Array
    wanted: jax.Array
    member: jax.Array
    hit: jax.Array | None
    cached: jax.Array | None
    scores: jax.Array
    group_start: int
    new: NewToken | None


def _select(read, q, index, length, new, row_cache, group_start, kv_cache, layer, kv_layer, *, k, sink, local,
            placement, implementation, topk=None, after=None):
    """Execute ``read`` for groups ``group_start ..`` (their per-group arguments) and select; returns
    ``(selected, staged)``: a :class:`_Selected` (or, for a dense read, the finished ``(out, bits, None)``) and the
    staged planes a chained transfer waits for (None where nothing was staged); the plane transfer itself waits for
    ``after``."""
    groups = (group_start, q.shape[0])
    staged = None
    if isinstance(read, KeyRead) and read.dense:
        keys, values = split_kv(placement.stage(kv_cache, kv_layer, implementation, groups=groups))
        if new is not None:
            keys, values = _put_row(keys, new.key, new.position), _put_row(values, new.value, new.position)
        mask = jnp.arange(keys.shape[-2]) < length[:, None, None]
        out = attend(q, keys, values, jnp.broadcast_to(mask, q.shape[:-1] + keys.shape[-2:-1]))
        return (out, read.bits, None), None
    if isinstance(read, KeyRead):  # the oracle scores the cache's keys: the first half of each row, staged
        keys = placement.stage(kv_cache, kv_layer, implementation, columns=key_columns(kv_cache), groups=groups)
        scores = scan_lib.execute(read, dataclasses.replace(index, keys=keys), length, implementation=implementation)
    else:
        scores, staged = scan_lib.execute_chained(read, index, length, layer=layer, group_start=group_start,
                                                  placement=placement, implementation=implementation, after=after)
    raw_scores = scores
    if new is not None:
        scores = patch_scores(scores, read, new)
    # No masking pass over the scores: both selections take positions >= length as invalid (the pass cost
    # 2.3 ms per 36-layer step at 1M tokens on the H200).
    idx, mask = select_topk(scores, length, k, sink=sink, local=local, implementation=implementation, config=topk)
    # Sorted by one XLA sort even though the Pallas top-k lists each head's tokens in order: the sort-free union
    # (group_union(sorted_heads=True)), faster alone, made the pipelined step slower (H200, run v3: 66.7 -> 77.1 ms
    # at 1M tokens, 18.6 -> 20.0 at 128k).
    union, union_mask, member = group_union(idx, mask)
    slots = jnp.where(union_mask, union, -1)
    wanted, hit, cached = slots, None, None
    if row_cache is not None:  # the kernel skips negative entries: only the misses cross the link
        hit, cached = row_lookup(row_cache, slots, layer=layer, group_start=group_start)
        wanted = jnp.where(hit, -1, slots)
    return _Selected(q=q, bits=read.bits, slots=slots, wanted=wanted, member=member, hit=hit, cached=cached,
                     scores=raw_scores, group_start=group_start, new=new), staged


def _fetch_attend(sel: _Selected, kv_cache, kv_layer, *, placement, implementation, after=None, **_):
    """Fetch a selection's rows (after ``after``: arrays the fetch waits for and never reads) and attend; returns
    ``(out, bits, fill)``, ``fill`` the :class:`RowFill` for the row cache (None without one)."""
    rows, _, _ = row_fetch(kv_cache, None, sel.wanted, layer=kv_layer, group_start=sel.group_start, after=after,
                           implementation=implementation, config=placement.row_fetch_config)  # one run per token
    if sel.hit is not None:
        rows = jnp.where(sel.hit[..., None], sel.cached, rows)
    new = sel.new
    if new is not None:  # the newest token's row is not stored yet: patched in (and so cached as it will be stored)
        hit_new = (sel.slots == new.position[:, None])[..., None]
        rows = jnp.where(hit_new, join_kv(new.key, new.value, rows.dtype)[:, None, :], rows)
    fill = None if sel.hit is None else RowFill(tokens=sel.slots, hit=sel.hit, rows=rows)
    k_rows, v_rows = split_kv(rows)
    return attend(sel.q, k_rows, v_rows, sel.member), sel.bits, fill
