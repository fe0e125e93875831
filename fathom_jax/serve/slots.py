"""A pool cache's slots: one session's slices of a stacked :class:`~fathom_jax.decode.SparseCache`, moved in and out.

A pool's cache is a ``SparseCache`` of ``slots`` sequences: every leaf of rank >= 2 is ``[L, R, ...]`` with ``R =
slots x KV heads`` (sequence major), ``length`` is ``[slots]``, and ``writes`` (the completion tokens of in-place
writes) belongs to no sequence. A session is the same tree for one sequence (``R = KV heads``, ``length [1]``):
what :func:`extract` cuts out of a slot and :func:`insert` writes into one. Both are compiled once per pool layout
(the slot is a traced value), so moving sessions never compiles again.

Small leaves move by XLA slices. The bulk leaves of the offloaded layout move as its decode step writes them, by
kernels (:mod:`pallas_kernels.slot_copy`) that reach them in place: in ``pinned_host`` memory no XLA op may touch
them, so the read copies the slot's groups into device memory and the write goes through the pointer of the host
array, which the program neither donates nor returns (:mod:`fathom_jax.decode.cache_program`'s rule). With the
kernels interpreted on a CPU, device memory stands in for the host.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax.decode.cache import SparseCache
from fathom_jax.placement import GROUP_AXIS, Placement, attach_bulk, host_memory_available, join_bulk, split_bulk
from pallas_kernels import slot_copy


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
    """``leaf_fn(x, bulk, *others)`` over every per-sequence leaf of rank >= 2 (``bulk``: whether the placement puts
    it with the bulk leaves, host or resident) and ``length_fn`` over ``length`` (``rest``: trees like ``cache``
    whose leaves go along)."""
    def one(x, bulk, *others):
        return leaf_fn(x, bool(bulk), *others) if x.ndim >= 2 else None

    moved = jax.tree.map(one, _per_sequence(cache), _per_sequence(cache.bulk()), *[_per_sequence(r) for r in rest])
    return dataclasses.replace(moved, length=length_fn(cache.length, *[r.length for r in rest]))


def check_moves(placement: Placement, implementation: str | None) -> bool:
    """Whether a pool's bulk leaves move by the :mod:`pallas_kernels.slot_copy` kernels (the rest by XLA slices): for
    the offloaded layout with the kernels, as its decode step writes them. In real host memory nothing else can."""
    implementation = placement.check(implementation)
    by_kernel = placement.offloaded and implementation == "triton" and placement.mesh is None
    if placement.in_host_memory and not by_kernel:
        raise ValueError("SessionPool: a pool cache in pinned_host memory moves its slots by the slot_copy kernels, "
                         "which run on one device: use a placement without a mesh (or placement 'device' with a "
                         "mesh: parked sessions still live in host memory)")
    return by_kernel


@functools.partial(jax.jit, static_argnames=("heads", "by_kernel"))
def _extract(cache: SparseCache, slot, heads: int, by_kernel: bool = False) -> SparseCache:
    start = slot * heads

    def leaf(x, bulk):
        if bulk and by_kernel:  # read in place, wherever it lives
            return slot_copy.slot_read(x, start, heads, implementation="triton")
        return jax.lax.dynamic_slice_in_dim(x, start, heads, axis=GROUP_AXIS)

    return _move(leaf, lambda n: jax.lax.dynamic_slice_in_dim(n, slot, 1), cache)


def extract(cache: SparseCache, slot: int, heads: int, placement: Placement | None = None,
            implementation: str | None = None) -> SparseCache:
    """The session in ``slot`` (a tree of one sequence, in device memory; the pool cache is unchanged). With a
    ``placement`` (the pool's) and ``implementation``, its bulk leaves are read as :func:`check_moves` says."""
    by_kernel = placement is not None and check_moves(placement, implementation)
    return _extract(cache, jnp.int32(slot), heads, by_kernel=by_kernel)


@functools.lru_cache(maxsize=None)
def _insert_program(shardings, by_kernel: bool, in_place: bool):
    def write(cache, session, slot):
        start = slot * session.groups
        tokens = []

        def leaf(x, bulk, s):
            s = s.astype(x.dtype)
            if not (bulk and by_kernel):
                return jax.lax.dynamic_update_slice_in_dim(x, s, start, axis=GROUP_AXIS)
            if in_place:  # through the pointer, as the decode step writes a host cache: nothing copied or returned
                tokens.append(slot_copy.slot_write_in_place(x, s, start))
                return x
            return slot_copy.slot_write(x, s, start, implementation="triton")

        moved = _move(leaf, lambda n, s: jax.lax.dynamic_update_slice_in_dim(n, s, slot, 0), cache, session)
        moved = dataclasses.replace(moved, writes=cache.writes)
        done = jnp.concatenate(tokens) if tokens else jnp.zeros((0,), jnp.int32)
        return moved, done

    out_shardings = jax.tree.unflatten(*shardings)  # the whole cache's, or its small leaves' in place
    if not in_place:
        # The pool cache keeps its shardings (the step program's signature); it is donated: updated in place.
        return jax.jit(lambda cache, session, slot: write(cache, session, slot)[0], donate_argnums=(0,),
                       out_shardings=out_shardings)

    # In host memory, as the step's programs (fathom_jax.decode.cache_program): the small leaves donated and
    # returned, the bulk ones written in place and neither donated (XLA would free them) nor returned (XLA would copy
    # them); the completion tokens are an output, so the writes are never dropped.
    def body(small, bulk_leaves, session, slot):
        cache = join_bulk(small, bulk_leaves)
        moved, done = write(cache, session, slot)
        return split_bulk(moved, cache.bulk())[0], done

    return jax.jit(body, donate_argnums=(0,), out_shardings=(out_shardings, None))


def insert_program(cache: SparseCache, placement: Placement, implementation: str | None = None):
    """``(program, in_place)``: the compiled insert for pools like ``cache``; in place, it takes ``(small, bulk
    leaves, session, slot)`` (:func:`~fathom_jax.placement.split_bulk`) and returns ``(small, completion tokens)``,
    else ``(cache, session, slot)`` and returns the cache."""
    bulk = cache.bulk()
    by_kernel = check_moves(placement, implementation)
    in_place = by_kernel and placement.in_host_memory
    shardings = placement.shardings(cache, bulk)
    leaves, treedef = jax.tree.flatten(split_bulk(shardings, bulk)[0] if in_place else shardings)
    return _insert_program((treedef, tuple(leaves)), by_kernel, in_place), in_place


def insert(cache: SparseCache, session: SparseCache, slot: int, placement: Placement,
           implementation: str | None = None) -> SparseCache:
    """``cache`` with ``session`` written into ``slot`` (the cache is donated; in host memory its bulk leaves are
    written in place and the same arrays come back)."""
    bulk = cache.bulk()
    program, in_place = insert_program(cache, placement, implementation)
    if not in_place:
        return program(cache, session, jnp.int32(slot))
    small, _ = program(*split_bulk(cache, bulk), session, jnp.int32(slot))  # the tokens: the writes were kept
    return attach_bulk(small, cache, bulk)


def clear(cache: SparseCache, slot: int) -> SparseCache:
    """``cache`` with ``slot``'s length 0 (a free slot: masked in the step, never past its capacity)."""
    return dataclasses.replace(cache, length=_clear_length(cache.length, jnp.int32(slot)))


@functools.partial(jax.jit, donate_argnums=(0,))
def _clear_length(length, slot):
    return length.at[slot].set(0)


# ----------------------------------------------------------------------------------------------
# The model's own per-sequence state (Gemma 3's window rings), beside the cache: every leaf holds one entry per slot on
# the axis the state names (``own.sequence_axes()``, :meth:`~fathom_jax.models.decoder.Decoder.split_state`). It lives
# in device memory and moves by XLA slices.


def own_axes(own, slots: int) -> tuple[int, ...]:
    """Each leaf's sequence axis of a pool's own state (arrays or shapes) of ``slots`` sequences, checked."""
    if not callable(getattr(own, "sequence_axes", None)):
        raise ValueError(f"SessionPool: the model keeps per-sequence state ({type(own).__name__}) without a "
                         "sequence_axes() method: the pool cannot tell which sequence each part belongs to")
    axes = jax.tree.leaves(own.sequence_axes())
    leaves = jax.tree_util.tree_flatten_with_path(own)[0]
    if len(axes) != len(leaves):
        raise ValueError(f"SessionPool: {type(own).__name__}.sequence_axes() names {len(axes)} axes for its "
                         f"{len(leaves)} leaves")
    for (path, x), axis in zip(leaves, axes):
        if not (isinstance(axis, int) and 0 <= axis < x.ndim and x.shape[axis] == slots):
            raise ValueError(f"SessionPool: model state leaf {jax.tree_util.keystr(path)} of shape {x.shape} has "
                             f"no axis {axis!r} of the {slots} sequences")
    return tuple(axes)


@functools.partial(jax.jit, static_argnames=("axes",))
def extract_own(own, slot, axes: tuple[int, ...]):
    """The own state of the sequence in ``slot`` (the pool's unchanged)."""
    leaves, treedef = jax.tree.flatten(own)
    return jax.tree.unflatten(treedef, [jax.lax.dynamic_slice_in_dim(x, slot, 1, a) for x, a in zip(leaves, axes)])


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnums=(0,))
def insert_own(own, one, slot, axes: tuple[int, ...]):
    """``own`` (donated) with ``one``'s sequence written into ``slot``."""
    leaves, treedef = jax.tree.flatten(own)
    return jax.tree.unflatten(treedef, [jax.lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), slot, a)
                                        for x, y, a in zip(leaves, jax.tree.leaves(one), axes)])


# ----------------------------------------------------------------------------------------------
# Where a parked session lives: host memory (pinned where the backend has it), as a tree of one sequence.


def to_host(session, placement: Placement):
    """``session`` (a tree of one sequence: its cache, the model's own state) copied to host memory: ``pinned_host``
    arrays on a backend with them, numpy arrays elsewhere."""
    if not host_memory_available():
        return jax.device_get(session)
    host = placement.replicated().with_memory_kind("pinned_host")

    def one(x):
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host") if isinstance(x, jax.Array) else host)

    return jax.tree.map(one, session)


def to_device(session, placement: Placement):
    """A parked session back in device memory, replicated over the placement's devices (the insert program then
    splits it like the pool)."""
    return jax.device_put(session, placement.replicated())


# ----------------------------------------------------------------------------------------------
# Bytes, by where they live: what admission counts.


def nbytes(x) -> int:
    """Bytes of an array or a ``jax.ShapeDtypeStruct``."""
    return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def slot_bytes(cache: SparseCache, slots: int, placement: Placement, model_state=None) -> dict[str, dict[str, int]]:
    """One slot's bytes in a pool ``cache`` of ``slots`` slots (arrays or shapes), with the model's ``own`` state of
    them if any (kind ``model_state``, in device memory): ``{"host": {kind: bytes}, "hbm": {kind: bytes}}``.

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
    if model_state is not None:
        out["hbm"]["model_state"] = sum(nbytes(x) for x in jax.tree.leaves(model_state)) // slots
    return out


def total(by_kind: dict[str, int]) -> int:
    return int(sum(by_kind.values()))


