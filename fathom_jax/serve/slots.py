"""A pool cache's slots: one session's slices of a stacked :class:`~fathom_jax.decode.SparseCache`, moved in and out.

A pool's cache is a ``SparseCache`` of ``slots`` sequences: every leaf of rank >= 2 is ``[L, R, ...]`` with ``R =
slots x KV heads`` (sequence major), ``length`` is ``[slots]``, and ``writes`` (the completion tokens of in-place
writes) belongs to no sequence. A session is the same tree for one sequence (``R = KV heads``, ``length [1]``):
what :func:`extract` cuts out of a slot and :func:`insert` writes into one. Both are compiled once per pool layout
(the slot is a traced value), so moving sessions never compiles again.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax.decode.cache import SparseCache
from fathom_jax.placement import GROUP_AXIS, Placement, host_memory_available


def _per_sequence(cache: SparseCache) -> SparseCache:
    """``cache`` without the leaf that belongs to no sequence (the write tokens): what a session carries."""
    return dataclasses.replace(cache, writes=None)


def session_of(cache: SparseCache) -> SparseCache:
    """A one-sequence cache (a prefill's) as a session: its per-sequence leaves."""
    if cache.batch != 1:
        raise ValueError(f"session_of: a session is one sequence, got a cache of {cache.batch}")
    return _per_sequence(cache)


def session_template(cache: SparseCache, heads: int) -> SparseCache:
    """The shapes and dtypes of one session of a pool ``cache`` (``heads`` KV heads per sequence)."""
    return jax.eval_shape(lambda c: _extract(c, jnp.int32(0), heads), cache)


def check_layout(cache: SparseCache) -> None:
    """Every per-sequence leaf of rank >= 2 must hold its groups on axis 1 (what the slot moves assume)."""
    for path, x in jax.tree_util.tree_flatten_with_path(_per_sequence(cache))[0]:
        if x.ndim < 2 and jax.tree_util.keystr(path) != ".length":
            raise ValueError(f"SessionPool: cache leaf {jax.tree_util.keystr(path)} of shape {x.shape} is neither "
                             "[L, R, ...] nor the lengths: the pool cannot tell which sequence it belongs to")
        if x.ndim >= 2 and x.shape[GROUP_AXIS] != cache.groups:
            raise ValueError(f"SessionPool: cache leaf {jax.tree_util.keystr(path)} has shape {x.shape}; a pool needs "
                             f"every [L, R, ...] leaf to hold its R = {cache.groups} groups on axis {GROUP_AXIS}")


def _move(leaf_fn, length_fn, cache: SparseCache, *rest):
    """``leaf_fn`` over every per-sequence leaf of rank >= 2 and ``length_fn`` over ``length`` (``rest``: trees
    like ``cache`` whose leaves go along)."""
    def one(x, *others):
        return leaf_fn(x, *others) if x.ndim >= 2 else None

    moved = jax.tree.map(one, _per_sequence(cache), *[_per_sequence(r) for r in rest])
    return dataclasses.replace(moved, length=length_fn(cache.length, *[r.length for r in rest]))


@functools.partial(jax.jit, static_argnames=("heads",))
def _extract(cache: SparseCache, slot, heads: int) -> SparseCache:
    start = slot * heads
    return _move(lambda x: jax.lax.dynamic_slice_in_dim(x, start, heads, axis=GROUP_AXIS),
                 lambda n: jax.lax.dynamic_slice_in_dim(n, slot, 1), cache)


def extract(cache: SparseCache, slot: int, heads: int) -> SparseCache:
    """The session in ``slot`` (a tree of one sequence, in device memory; the pool cache is unchanged)."""
    return _extract(cache, jnp.int32(slot), heads)


@functools.lru_cache(maxsize=None)
def _insert_program(shardings):
    def body(cache, session, slot):
        heads = session.groups
        start = slot * heads
        moved = _move(lambda x, s: jax.lax.dynamic_update_slice_in_dim(x, s.astype(x.dtype), start, axis=GROUP_AXIS),
                      lambda n, s: jax.lax.dynamic_update_slice_in_dim(n, s, slot, 0), cache, session)
        return dataclasses.replace(moved, writes=cache.writes)

    # The pool cache keeps its shardings (the step program's signature); it is donated: updated in place.
    return jax.jit(body, donate_argnums=(0,), out_shardings=jax.tree.unflatten(*shardings))


def insert(cache: SparseCache, session: SparseCache, slot: int, placement: Placement) -> SparseCache:
    """``cache`` with ``session`` written into ``slot`` (the cache is donated)."""
    leaves, treedef = jax.tree.flatten(placement.shardings(cache, cache.bulk()))
    return _insert_program((treedef, tuple(leaves)))(cache, session, jnp.int32(slot))


def clear(cache: SparseCache, slot: int) -> SparseCache:
    """``cache`` with ``slot``'s length 0 (a free slot: masked in the step, never past its capacity)."""
    return dataclasses.replace(cache, length=_clear_length(cache.length, jnp.int32(slot)))


@functools.partial(jax.jit, donate_argnums=(0,))
def _clear_length(length, slot):
    return length.at[slot].set(0)


# ----------------------------------------------------------------------------------------------
# Where a parked session lives: host memory (pinned where the backend has it), as a tree of one sequence.


def to_host(session: SparseCache, placement: Placement) -> SparseCache:
    """``session`` copied to host memory: ``pinned_host`` arrays on a backend with them, numpy arrays elsewhere."""
    if not host_memory_available():
        return jax.device_get(session)
    host = placement.replicated().with_memory_kind("pinned_host")

    def one(x):
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host") if isinstance(x, jax.Array) else host)

    return jax.tree.map(one, session)


def to_device(session: SparseCache, placement: Placement) -> SparseCache:
    """A parked session back in device memory, replicated over the placement's devices (the insert program then
    splits it like the pool)."""
    return jax.device_put(session, placement.replicated())


# ----------------------------------------------------------------------------------------------
# Bytes, by where they live: what admission counts.


def nbytes(x) -> int:
    """Bytes of an array or a ``jax.ShapeDtypeStruct``."""
    return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def slot_bytes(cache: SparseCache, slots: int, placement: Placement) -> dict[str, dict[str, int]]:
    """One slot's bytes in a pool ``cache`` of ``slots`` slots (arrays or shapes): ``{"host": {kind: bytes}, "hbm":
    {kind: bytes}}``.

    Bulk kinds as :meth:`SparseCache.nbytes` names them (``kv``, plane stores, ...) sit in host memory when the
    placement puts them there; ``*_hbm`` kinds (resident planes) and the small leaves (tails, lengths, session
    statistics, row-cache slots: kind ``small``) in device memory."""
    by_kind = {"kv": nbytes(cache.kv)}
    for part, data in zip(cache.index.parts, cache.index.data):
        for x, where in zip(jax.tree.leaves(data), jax.tree.leaves(part.bulk(data))):
            if where:
                key = part.kind + ("_hbm" if where == "device" else "")
                by_kind[key] = by_kind.get(key, 0) + nbytes(x)
    out: dict[str, dict[str, int]] = {"host": {}, "hbm": {}}
    for kind, size in by_kind.items():
        where = "hbm" if kind.endswith("_hbm") or not placement.in_host_memory else "host"
        out[where][kind] = size // slots
    own = _per_sequence(cache)
    small = sum(nbytes(x) for x, b in zip(jax.tree.leaves(own), jax.tree.leaves(own.bulk())) if not b and x.ndim >= 2)
    out["hbm"]["small"] = small // slots + np.dtype(cache.length.dtype).itemsize
    return out


def total(by_kind: dict[str, int]) -> int:
    return int(sum(by_kind.values()))


