"""The stacked cache of sparse decoding: every layer's K/V rows and key index, and what a step changes.

:class:`SparseCache` holds bulk arrays (K/V rows, bit planes, block scales, landmarks) where the placement
puts them (HBM or ``pinned_host``) and small ones (raw tails, lengths, rotations) in device memory;
:func:`cache_bytes` sizes it before allocating; :class:`LayerUpdate` is what one decode step changes in one
layer, written back after the layer scan by :meth:`fathom_jax.decode.SparseAttention.commit`.

:class:`RowCache` (optional, ``Placement(row_cache=slots)``) keeps in device memory copies of the K/V rows that
recent steps fetched: consecutive decode steps reselect most of their rows (SmolLM2 on real text: 63-66% of a
step's rows were selected by the step before, ``results/row_reuse_smollm2_*.md``), so a step fetches from the
cache's memory only the rows its slots miss. :func:`row_lookup` is a step's half, :func:`commit_rows` (by :func:`row_writes`) the half after the layer scan.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from fathom_jax.format import BLOCK_TOKENS, LANDMARK_TOKENS, N_PLANES, plane_words, round_capacity
from fathom_jax.index import KeyIndex
from fathom_jax.methods.base import ScanMethod


def join_kv(keys: Float[Array, "*B Dh"], values: Float[Array, "*B Dh"], dtype) -> Float[Array, "*B 2Dh"]:
    """Rows of the cache's layout: each token's key in the first ``Dh`` features, its value in the last."""
    return jnp.concatenate([keys.astype(dtype), values.astype(dtype)], axis=-1)


def split_kv(rows: Float[Array, "*B 2Dh"]) -> tuple[Float[Array, "*B Dh"], Float[Array, "*B Dh"]]:
    """Keys and values of rows in the cache's layout (the inverse of :func:`join_kv`)."""
    dh = rows.shape[-1] // 2
    return rows[..., :dh], rows[..., dh:]


def key_columns(rows) -> tuple[int, int]:
    """``(start, width)`` of the keys in rows of the cache's layout (what the oracle stages)."""
    return 0, rows.shape[-1] // 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowCache:
    """Device-memory copies of K/V rows, direct-mapped: per layer and group ``C`` slots, token ``t`` in slot ``t mod C``.

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


def empty_row_cache(zeros, *, n_layers: int, groups: int, slots: int, head_dim: int, dtype) -> RowCache:
    """A :class:`RowCache` of ``slots`` empty slots per layer and group, from ``zeros(shape, dtype)``."""
    return RowCache(rows=zeros((n_layers, groups, slots, 2 * head_dim), dtype),
                    tags=zeros((n_layers, groups, slots), jnp.int32),
                    hits=zeros((n_layers, groups), jnp.int32), fetched=zeros((n_layers, groups), jnp.int32))


def _slot_of(tokens, slots: int):
    """Each token's slot (padding, negative: slot 0, never a hit nor written)."""
    return jnp.where(tokens >= 0, tokens % slots, 0)


def row_lookup(cache: RowCache, tokens: Int[Array, "R S"], *, layer=None, group_start: int = 0):
    """Which of a step's selected ``tokens`` (negative: padding) the slots hold.

    ``cache`` is one layer's ``[R, C, ...]``, or with ``layer`` the stacked ``[L, R, C, ...]`` read at that layer and
    groups ``group_start ..`` (gathered in place: slicing the layer out first would copy all its slots). Returns
    ``(hit bool [R, S], cached rows [R, S, 2 Dh])``; ``cached`` is meaningful where ``hit``.
    """
    slot = _slot_of(tokens, cache.slots)
    if layer is None:
        tags = jnp.take_along_axis(cache.tags, slot, axis=-1)
        cached = jnp.take_along_axis(cache.rows, slot[..., None], axis=-2)
    else:
        group = group_start + jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None]
        tags, cached = cache.tags[layer, group, slot], cache.rows[layer, group, slot]
    return (tokens >= 0) & (tags == tokens + 1), cached


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
    """``cache`` with every layer's ``fill`` (stacked ``[L, R, S, ...]``) stored (see :func:`row_writes`)."""
    slot, hits, fetched = row_writes(cache.slots, fill.tokens, fill.hit)
    n_layers, groups, _ = slot.shape
    layer = jnp.arange(n_layers)[:, None, None]
    group = jnp.arange(groups)[None, :, None]
    put = lambda dst, src: dst.at[layer, group, slot].set(src, mode="drop")  # noqa: E731
    return RowCache(rows=put(cache.rows, fill.rows), tags=put(cache.tags, fill.tokens + 1), hits=hits, fetched=fetched)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseCache:
    """K/V rows and key index of every layer, stacked ``[L, R, ...]`` (``R = batch x KV heads``).

    ``kv``: ``[L, R, C, 2 Dh]`` in the model dtype, each token's key in the first ``Dh`` features and its
    value in the last, so that fetching a selected token reads one contiguous run (from host memory the
    pages touched cost more than the bytes: see :mod:`pallas_kernels.row_fetch`); ``[1, R, C, 2 Dh]``:
    one row buffer shared by every layer, a benchmark mode for caches larger than the host. ``index``: a
    :class:`KeyIndex` whose leaves are ``[L, R, ...]`` (no ``keys`` part: the oracle reads the keys of
    ``kv``); ``length``: tokens per sequence ``[B]``. In host memory the kernels write the bulk arrays in
    place; ``writes`` holds the tokens of the last writes, so the programs that made them return something
    that depends on them. ``row_cache``: device-memory copies of recently fetched rows (:class:`RowCache`), or None.
    """

    kv: Float[Array, "L R C 2Dh"]
    index: KeyIndex
    length: Int[Array, "B"]
    writes: Int[Array, "W"] | None = None  # completion tokens of in-place writes into host memory (see below)
    row_cache: RowCache | None = None

    @property
    def k(self) -> Float[Array, "L R C Dh"]:
        """The keys (a copy: ``kv[..., :Dh]``), for inspection; the step reads ``kv`` in place."""
        return split_kv(self.kv)[0]

    @property
    def v(self) -> Float[Array, "L R C Dh"]:
        """The values (a copy: ``kv[..., Dh:]``)."""
        return split_kv(self.kv)[1]

    @property
    def head_dim(self) -> int:
        return self.kv.shape[-1] // 2

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]

    @property
    def n_layers(self) -> int:
        return self.index.length.shape[0]

    @property
    def groups(self) -> int:
        return self.kv.shape[1]

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    @property
    def shared_kv(self) -> bool:
        return self.kv.shape[0] != self.n_layers

    def group_length(self) -> Int[Array, "R"]:
        return jnp.repeat(self.length, self.groups // self.batch)

    def nbytes(self) -> dict[str, int]:
        """Bytes of the bulk arrays (K/V rows, planes + scales, landmarks): what lives in host memory."""
        out = {"kv": self.kv.nbytes, "planes": 0, "landmarks": 0}
        for store in self.index.stores:
            out["planes"] += store.planes.nbytes + store.scales.nbytes
        if self.index.landmarks is not None:
            out["landmarks"] = self.index.landmarks.nbytes
        return out


def cache_bytes(method: ScanMethod, *, n_layers: int, groups: int, capacity: int, head_dim: int,
                kv_itemsize: int, shared_kv: bool = False) -> dict[str, int]:
    """Bulk bytes of a :class:`SparseCache` before allocating it (the host memory it will need)."""
    capacity = round_capacity(capacity)
    kv_layers = 1 if shared_kv else n_layers
    out = {"kv": 2 * kv_layers * groups * capacity * head_dim * kv_itemsize, "planes": 0, "landmarks": 0}
    stores = len({"raw", "klt", "loki"} & method.parts)
    per_store = groups * head_dim * (N_PLANES * plane_words(capacity) * 4 + capacity // BLOCK_TOKENS * 2)
    out["planes"] = n_layers * stores * per_store
    if "landmarks" in method.parts:
        out["landmarks"] = n_layers * groups * capacity // LANDMARK_TOKENS * head_dim * 2
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerUpdate:
    """What one decode step changes in one layer (stacked on [L] by the layer scan)."""

    key: Float[Array, "R Dh"]
    value: Float[Array, "R Dh"]
    blocks: dict  # part -> (plane words [R, D, 4, 2], scales [R, D], raw tail [R, 64, D])
    landmark: tuple | None = None  # (fp16 mean [R, D], raw tail [R, 8, D])
    # completion tokens i32 [writes] of the bulk writes the layer already made in the layer scan
    # (``Placement.writes_in_scan``); None: the commit after the scan makes them
    written: Array | None = None
    rows: RowFill | None = None  # the rows this layer stores in its RowCache slots (None: no row cache)
