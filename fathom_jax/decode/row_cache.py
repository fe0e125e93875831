"""Device-memory slots for the K/V rows recent decode steps fetched (``StepConfig(row_cache=...)``).

Consecutive decode steps reselect most of their rows (SmolLM2 on real text: 63-66% of a step's rows were selected by
the step before, ``results/row_reuse_smollm2_*.md``), so a step can fetch from the cache's memory only the rows its
slots miss (:class:`fathom_jax.decode.fetches.CachedRowFetch`). Two ways to hold them (:attr:`RowCache.mode`):

* ``"direct"`` (``row_cache=N``): ``N`` direct-mapped slots per layer and group, token ``t`` in slot ``t mod N``;
* ``"last"`` (``row_cache="last"``): the previous step's selection itself, its union's rows in its slot order, so
  a step finds a token by a search of that sorted list and, after the layer scan, the new selection replaces the old
  one whole (no scatter).

:func:`row_lookup` is a step's half, :func:`commit_rows` (by :func:`row_writes`) the half after the layer scan.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowCache:
    """Device-memory copies of K/V rows: per layer and group ``C`` slots, token ``t`` in slot ``t mod C`` (``mode``
    ``"direct"``), or (``"last"``) the previous step's union of ``C = G k`` slots in its order.

    ``rows``: ``[L, R, C, 2 Dh]`` in the K/V cache's layout; ``tags``: i32 ``[L, R, C]``, one more than the token a
    slot holds (0: empty, so a zero-filled cache is empty); ``hits`` / ``fetched``: i32 ``[L, R]``, the rows the last
    step took from the slots and from the K/V cache. The same class may hold one layer's slots, ``rows [R, C, 2 Dh]``
    and ``tags [R, C]``, and no counts. Tokens are never rewritten once stored, so
    a tag that matches is always the row the K/V cache holds; a prefill of a layer empties that layer's slots.
    """

    rows: Float[Array, "L R C 2Dh"]
    tags: Int[Array, "L R C"]
    hits: Int[Array, "L R"] | None = None
    fetched: Int[Array, "L R"] | None = None
    mode: str = dataclasses.field(default="direct", metadata=dict(static=True))  # or "last" (see the module)

    @property
    def slots(self) -> int:
        return self.tags.shape[-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowFill:
    """What one layer's step leaves for its :class:`RowCache` slots (stacked on ``[L]`` by the layer scan): the
    selected ``tokens`` i32 ``[R, S]`` (negative: padding), which of them were ``hit`` in the slots, and their ``rows
    [R, S, 2 Dh]``. Which rows win a slot is decided after the layer scan (:func:`commit_rows`), so that the step's
    chain of kernels gains no scatter (one in a pipelined chunk's chain broke the chunks' overlap before: NOTES.md)."""

    tokens: Int[Array, "R S"]
    hit: Array  # bool [R, S]
    rows: Float[Array, "R S 2Dh"]


def empty_row_cache(zeros, *, n_layers: int, groups: int, slots: int, width: int, dtype, mode: str = "direct"
                    ) -> RowCache:
    """A :class:`RowCache` of ``slots`` empty slots per layer and group for rows of ``width`` elements (the K/V
    cache's), from ``zeros(shape, dtype)``."""
    return RowCache(rows=zeros((n_layers, groups, slots, width), dtype),
                    tags=zeros((n_layers, groups, slots), jnp.int32),
                    hits=zeros((n_layers, groups), jnp.int32), fetched=zeros((n_layers, groups), jnp.int32),
                    mode=mode)


def _slot_of(tokens, slots: int):
    """Each token's slot (padding, negative: slot 0, never a hit nor written)."""
    return jnp.where(tokens >= 0, tokens % slots, 0)


def row_lookup(cache: RowCache, tokens: Int[Array, "R S"], *, layer=None, group_start: int = 0):
    """Which of a step's selected ``tokens`` (negative: padding) the slots hold.

    ``cache`` is one layer's ``[R, C, ...]``, or with ``layer`` the stacked ``[L, R, C, ...]`` read at that layer and
    groups ``group_start ..`` (gathered in place: slicing the layer out first would copy all its slots). Returns
    ``(hit bool [R, S], cached rows [R, S, 2 Dh])``; ``cached`` is meaningful where ``hit``.
    """
    if cache.mode == "last":
        slot = _last_slot(cache, tokens, layer, group_start)
    else:
        slot = _slot_of(tokens, cache.slots)
    if layer is None:
        tags = jnp.take_along_axis(cache.tags, slot, axis=-1)
        cached = jnp.take_along_axis(cache.rows, slot[..., None], axis=-2)
    else:
        group = group_start + jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None]
        tags, cached = cache.tags[layer, group, slot], cache.rows[layer, group, slot]
    return (tokens >= 0) & (tags == tokens + 1), cached


def _last_slot(cache: RowCache, tokens, layer, group_start: int):
    """Where the previous step's union holds each token, if anywhere: its tags are that union's tokens (plus one) in
    increasing order with zeros at masked slots, so their running maximum is sorted and the first slot reaching a
    token is the one that holds it (checked against its tag by the caller)."""
    tags = cache.tags if layer is None else jax.lax.dynamic_index_in_dim(cache.tags, layer, keepdims=False)
    tags = tags[group_start:group_start + tokens.shape[0]]
    reached = jax.lax.cummax(tags, axis=tags.ndim - 1)
    slot = jnp.sum(reached[..., None, :] < (tokens + 1)[..., :, None], axis=-1, dtype=jnp.int32)
    return jnp.minimum(slot, cache.slots - 1)


def row_writes(slots: int, tokens: Int[Array, "*B S"], hit):
    """Where a step's rows go: ``(slot i32 [*B, S], hits i32 [*B], fetched i32 [*B])``. Of the tokens of one group that
    map to one slot the largest wins (a scatter-max: the winner does not depend on the order XLA scatters in); only
    winners the slot does not hold yet are written, the rest get slot ``slots`` (past the end: dropped), so every
    written slot has exactly one writer."""
    valid = tokens >= 0
    slot = _slot_of(tokens, slots)
    lead = jnp.indices(tokens.shape[:-1], sparse=True)
    index = tuple(i[..., None] for i in lead) + (slot,)
    best = jnp.zeros(tokens.shape[:-1] + (slots,), jnp.int32).at[index].max(jnp.where(valid, tokens + 1, 0))
    won = valid & (best[index] == tokens + 1)
    count = lambda m: jnp.sum(m, axis=-1, dtype=jnp.int32)  # noqa: E731
    return jnp.where(won & ~hit, slot, slots), count(hit), count(valid & ~hit)


def commit_rows(cache: RowCache, fill: RowFill) -> RowCache:
    """``cache`` with every layer's ``fill`` (stacked ``[L, R, S, ...]``) stored (see :func:`row_writes`; the
    ``"last"`` mode keeps the step's selection whole)."""
    if cache.mode == "last":
        valid = fill.tokens >= 0
        count = lambda m: jnp.sum(m, axis=-1, dtype=jnp.int32)  # noqa: E731
        return dataclasses.replace(cache, rows=fill.rows.astype(cache.rows.dtype),
                                   tags=jnp.where(valid, fill.tokens + 1, 0), hits=count(fill.hit),
                                   fetched=count(valid & ~fill.hit))
    slot, hits, fetched = row_writes(cache.slots, fill.tokens, fill.hit)
    n_layers, groups, _ = slot.shape
    layer = jnp.arange(n_layers)[:, None, None]
    group = jnp.arange(groups)[None, :, None]
    put = lambda dst, src: dst.at[layer, group, slot].set(src, mode="drop")  # noqa: E731
    return RowCache(rows=put(cache.rows, fill.rows), tags=put(cache.tags, fill.tokens + 1), hits=hits, fetched=fetched,
                    mode=cache.mode)


def check_row_cache(row_cache: RowCache, groups: int, kv, *, stacked: bool) -> None:
    """Trace-time shape checks of a row cache against the step's groups and K/V rows (ValueError naming it)."""
    slots = row_cache.slots
    lead = row_cache.tags.shape[:1] if stacked else ()
    if row_cache.tags.shape != (*lead, groups, slots) or row_cache.tags.dtype != jnp.int32:
        axes = "[L, R, C]" if stacked else "[R, C]"
        raise ValueError(f"row_cache.tags must be i32 {axes} with R = {groups} groups, got {row_cache.tags.dtype} "
                         f"{row_cache.tags.shape}")
    want = (*lead, groups, slots, kv.shape[-1])
    if row_cache.rows.shape != want or row_cache.rows.dtype != kv.dtype:
        raise ValueError(f"row_cache.rows must be {kv.dtype} {list(want)} (the K/V cache's rows), got "
                         f"{row_cache.rows.dtype} {list(row_cache.rows.shape)}")
