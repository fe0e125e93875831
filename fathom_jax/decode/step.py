"""One sparse-attention step of one layer: plan -> read -> scan -> select -> union -> fetch -> attend.

    out = sparse_attention_step(method, q, view, ctx)      # StepResult(out [R, G, Dh], bits [R], fill, ...)
    out, update = layer_step(method, ctx, write, q, key, value, position, calib, cache, layer)   # over the cache

Written once, for every scan method and placement: the decoder's sparse attention (:mod:`fathom_jax.decode.hook`)
calls :func:`layer_step` per layer inside its layer scan, which builds the layer's view of the stacked cache and
runs the step. ``view`` (:class:`CacheView`) is what the layer reads (its index, K/V rows,
lengths, the new token); ``ctx`` (:class:`StepContext`) is how: ``k``, the sink and local
window, and the resolved step (:class:`~fathom_jax.decode.config.ResolvedStep`) with its read strategy (index in HBM,
staged from host, read in place from host) and fetch strategy (with or without a row cache); the selection is
:mod:`fathom_jax.decode.selection`.

Per KV group ``r`` (``R = batch x KV heads`` groups, ``G`` query heads each):

1. plan: the method's read for the group's queries (Fathom: importance and depths by the planner);
2. read + scan: approximate scores of every stored position (the read strategy);
3. select: per query head 4 sink + 32 local + the top-(k - 36) by approximate score;
4. union: the group's G sets as one fixed-size list (``G k`` slots in position order, duplicates masked);
5. fetch: the union's K/V rows (the fetch strategy; one copy serves every head of the group);
6. attend: exact softmax attention of each head over its own k rows.

With ``ctx.run.chunks > 1`` the groups go through steps 2-6 in chunks whose plane transfers are chained: chunk
``i + 1``'s transfer is ordered after chunk ``i``'s (and after nothing else), so it runs beside chunk ``i``'s scan,
selection, fetch and attention; and the next-to-last chunk's row fetch waits for the last chunk's scan, which the
rest of the layer waits on and which ran at half speed beside it (NOTES.md). Every group's result is the same as
in one chunk. Dense attention (a method that selects every row) has its own path, :func:`dense_attention_step`.

During decode the newest token is not yet in the stored cache (stores are written after the step, or after all
layers): its block of every index part and its K/V row are patched in from device memory (:class:`NewToken`), so
the step sees exactly the cache that holds it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from fathom_jax.calibrate import Calibration
from fathom_jax.decode import selection as selection_lib
from fathom_jax.decode import sharing as sharing_lib
from fathom_jax.decode import writes as writes_lib
from fathom_jax.decode.cache import LayerUpdate, SparseCache
from fathom_jax.decode.config import ResolvedStep
from fathom_jax.decode.row_cache import RowCache, RowFill, check_row_cache
from fathom_jax.decode.selection import Selection
from fathom_jax.decode.sharing import LayerSharing, SharedSet
from fathom_jax.index import KeyIndex
from fathom_jax.methods.base import ScanMethod
from fathom_jax.rows.layout import RowLayout
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS, attend


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NewToken:
    """The token a decode step adds, per group: what the stored cache lacks until the step writes it.

    ``position`` is its slot (the length before the step); ``blocks[part]`` the newest block of each index part
    after appending it (:class:`~fathom_jax.index.parts.PlaneBlock`, :class:`~fathom_jax.index.parts.LandmarkBlock`,
    :class:`~fathom_jax.index.parts.PageBlock`).
    """

    position: Int[Array, "R"]
    key: Float[Array, "R D"]
    value: Float[Array, "R D"]
    blocks: dict = dataclasses.field(default_factory=dict)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheView:
    """What one layer's step reads.

    ``index``: the layer's small leaves and (with ``layer``) the stacked bulk arrays ``[L, R, ...]``; ``kv``: K/V rows
    ``[L, R, C, W]`` read at ``kv_layer`` (default ``layer``; 0 for a row buffer shared by every layer), or
    ``[R, C, W]`` without a layer, stored as ``layout`` says (static; None: ``W = 2 Dh`` rows in ``kv``'s dtype); ``length``: valid tokens per group, the new one included; ``calib``: the
    layer's statistics per group; ``new``: the token the stored cache does not hold yet; ``row_cache``: slots
    stacked like ``kv`` (read at ``layer``), with a :class:`~fathom_jax.decode.fetches.CachedRowFetch`.
    """

    index: KeyIndex
    kv: Float[Array, "*L R C W"]
    length: Int[Array, "R"]
    calib: Calibration | None = None
    layer: Int[Array, ""] | None = None
    kv_layer: Int[Array, ""] | None = None
    new: NewToken | None = None
    row_cache: RowCache | None = None
    layout: RowLayout | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        if self.kv_layer is None and self.layer is not None:
            object.__setattr__(self, "kv_layer", self.layer)

    @property
    def rows(self) -> RowLayout:
        """How ``kv`` stores each token's row."""
        return self.layout or RowLayout(self.kv.shape[-1] // 2, self.kv.dtype)


@dataclasses.dataclass(frozen=True)
class StepContext:
    """How a step runs: ``k`` rows per query head (the ``sink`` first and ``local`` last tokens included) and the
    resolved step configuration (static)."""

    k: int
    run: ResolvedStep
    sink: int = SINK_TOKENS
    local: int = LOCAL_TOKENS
    share: LayerSharing | None = None  # a selection shared across layers (None: every layer selects its own)


class StepResult(NamedTuple):
    out: Float[Array, "R G Dh"]
    bits: Float[Array, "R"]
    fill: RowFill | None = None  # what to store in the row-cache slots (None without a row cache)
    scores: Float[Array, "R G n"] | None = None  # every position's score, where asked for


def sparse_attention_step(method: ScanMethod, q: Float[Array, "R G D"], view: CacheView, ctx: StepContext
                          ) -> StepResult:
    """Sparse attention of the ``G`` query heads of every group (dense attention for a method that selects every
    row: :func:`dense_attention_step`); returns the output, bits per token read and the row-cache fill."""
    if method.selects_all:
        return dense_attention_step(method, q, view, ctx)
    q = q.astype(jnp.float32)
    return _read_step(method.read(q, view.index, view.calib, implementation=ctx.run.implementation), q, view, ctx)


def _read_step(read, q: Float[Array, "R G D"], view: CacheView, ctx: StepContext, keep_scores: bool = False
               ) -> StepResult:
    """:func:`sparse_attention_step` of a method's ``read`` of the f32 queries ``q`` (planned once); with
    ``keep_scores`` the result keeps every chunk's scores."""
    groups = q.shape[0]
    if view.row_cache is not None:
        check_row_cache(view.row_cache, groups, view.kv, stacked=view.layer is not None)
    chunks = ctx.run.chunks if view.layer is not None else 1
    if groups % chunks:
        raise ValueError(f"step pipeline={chunks} must divide the {groups} groups (batch x KV heads) of the step")
    size = groups // chunks
    bulk = view.index.bulk()
    outs, scores, staged, pending = [], [], None, None
    for start in range(0, groups, size):
        chunk_read, chunk_q, chunk_index, chunk_length, chunk_new = _groups(
            (read, q, view.index, view.length, view.new), (False, False, bulk, False, False), start, size)
        chunk = dataclasses.replace(view, index=chunk_index, length=chunk_length, new=chunk_new)
        selection, staged = _select(chunk_read, chunk_q, chunk, ctx, start, after=staged)
        if pending is not None:  # the next-to-last chunk's fetch waits for the last chunk's scan
            last = start + size == groups
            outs.append(_fetch_attend(pending, view, ctx, after=selection.scores if last else None))
        pending = selection
        scores.append(selection.scores)
    outs.append(_fetch_attend(pending, view, ctx))
    out = outs[0] if len(outs) == 1 else jax.tree.map(lambda *parts: jnp.concatenate(parts), *outs)
    if keep_scores:
        out = out._replace(scores=jnp.concatenate(scores) if len(scores) > 1 else scores[0])
    return out


def layer_step(method: ScanMethod, ctx: StepContext, write: writes_lib.Writer, q: Float[Array, "R G D"], key: Float[Array, "R D"],
               value: Float[Array, "R D"], position: Int[Array, "R"], calib: Calibration | None, cache: SparseCache,
               layer, shared: SharedSet | None = None, *, selects: bool | None = None
               ) -> tuple[Float[Array, "R G Dh"], LayerUpdate, SharedSet | None]:
    """One layer of a decode step over the stacked cache (what :meth:`SparseAttention.attend
    <fathom_jax.decode.SparseAttention.attend>` runs per device): the new token in every index part's newest block,
    the layer's :class:`CacheView`, the step, and where ``ctx.run.in_place`` says so the token's writes. With a
    shared selection (``ctx.share``) a selection layer also publishes its set and a sharing layer attends ``shared``,
    the set it returns for the next layer; ``selects`` (static) says which this layer is (None: the traced layer
    decides, by a conditional)."""
    key, value = writes_lib.materialized(key, value)
    key32 = key.astype(jnp.float32)
    index, views, blocks = cache.index, [], {}
    for part, stacked in zip(index.parts, index.data):
        view, blocks[part.name] = part.add_token(stacked, layer, position, key32)
        views.append(view)
    new = NewToken(position=position, key=key32, value=value, blocks=blocks)
    view = CacheView(index=KeyIndex(index.length[layer], index.parts, tuple(views)), kv=cache.kv,
                     length=position + 1, calib=calib, layer=layer, kv_layer=0 if cache.shared_kv else layer,
                     new=new, row_cache=cache.row_cache, layout=cache.layout)  # the row cache is read in place
    if ctx.share is None:
        result = sparse_attention_step(method, q, view, ctx)
        out, fill = result.out, result.fill
    else:
        out, fill, shared = _shared_step(method, q, view, ctx, shared, selects)
    update = LayerUpdate(key=key, value=value, blocks=blocks, rows=fill)
    if ctx.run.in_place:
        # This layer's K/V row and newest blocks go to host memory now: the write kernels depend only on the new
        # key, so they run beside this layer's plane transfers instead of as one serial burst of scattered writes
        # after the scan (the step reads neither: NewToken patches both in).
        *_, tokens = writes_lib.write_token(cache, jax.tree.map(lambda a: a[None], update), position, layer, write,
                                            ctx.run.index_writes)
        update = dataclasses.replace(update, written=jnp.concatenate(tokens))
    return out, update, shared


def _shared_step(method: ScanMethod, q, view: CacheView, ctx: StepContext, shared: SharedSet,
                 selects: bool | None):
    """A layer of a shared selection, ``(out, fill, the set for the next layer)``: a selection layer runs the step
    and publishes its set, a sharing layer attends the last one; which, ``selects`` says (static), else the traced
    layer index under ``lax.cond``."""
    share = ctx.share
    q = q.astype(jnp.float32)

    def selecting():
        read = method.read(q, view.index, view.calib, implementation=ctx.run.implementation)
        result = _read_step(read, q, view, ctx, keep_scores=True)
        published = sharing_lib.publish(q, view, ctx, share.selection, share.kv_heads, result.scores)
        return result.out, result.fill, published

    def following():
        out, fill = sharing_lib.attend_shared(q, view, ctx, shared, share.selection, share.kv_heads)
        return out.astype(jnp.float32), fill, shared

    if selects is not None:
        return selecting() if selects else following()
    return jax.lax.cond(jnp.asarray(share.selects)[view.layer], selecting, following)


def dense_attention_step(method: ScanMethod, q: Float[Array, "R G D"], view: CacheView, ctx: StepContext
                         ) -> StepResult:
    """Exact attention of every group's heads over all its valid rows (no scan, no selection)."""
    q = q.astype(jnp.float32)
    rows = ctx.run.reader.stage(view.kv, view.kv_layer, groups=(0, q.shape[0]))
    if view.new is not None:  # the newest row as the cache will store it
        rows = _put_row(rows, view.rows.join(view.new.key, view.new.value), view.new.position)
    keys, values = view.rows.split(rows)
    mask = jnp.arange(keys.shape[-2]) < view.length[:, None, None]
    out = attend(q, keys, values, jnp.broadcast_to(mask, q.shape[:-1] + keys.shape[-2:-1]))
    bits = jnp.full(q.shape[:1], method.fixed_bits_per_token(q.shape[-1]), jnp.float32)
    return StepResult(out, bits, None)


def _select(read, q, view: CacheView, ctx: StepContext, group_start: int, after=None):
    """Execute ``read`` for the view's groups (from ``group_start`` of the stacked cache) and select; returns the
    :class:`~fathom_jax.decode.selection.Selection` and the staged planes a chained transfer waits for (None where
    nothing was staged); the plane transfer itself waits for ``after``."""
    source = ctx.run.reader.source(view, group_start=group_start, after=after)
    return selection_lib.select(read, q, source, view, ctx, group_start), source.staged


def _fetch_attend(sel: Selection, view: CacheView, ctx: StepContext, after=None) -> StepResult:
    """Fetch a selection's rows (after ``after``: arrays the fetch waits for and never reads) and attend."""
    chunk = dataclasses.replace(view, new=sel.new)
    out, fill = ctx.run.fetcher.attend(sel.q, sel.slots, sel.member, chunk, group_start=sel.group_start, after=after)
    return StepResult(out, sel.bits, fill)


def _groups(trees, bulk_masks, start: int, size: int):
    """``trees`` with every per-group ``[R, ...]`` leaf cut to groups ``start .. start + size - 1``; bulk leaves
    (stacked ``[L, R, ...]`` cache arrays, possibly in host memory, where no XLA op may slice them) stay whole for
    the kernels to read at that group offset."""
    def cut(tree, bulk):
        if bulk is False:
            return jax.tree.map(lambda x: x[start:start + size], tree)
        return jax.tree.map(lambda x, b: x if b else x[start:start + size], tree, bulk)

    return tuple(cut(tree, bulk) for tree, bulk in zip(trees, bulk_masks))


def _put_row(x, row, at):
    """``x [R, C, W]`` with ``row [R, W]`` written at position ``at [R]``."""
    return jax.vmap(lambda a, b, i: jax.lax.dynamic_update_slice(a, b[None].astype(a.dtype), (i, 0)))(x, row, at)
