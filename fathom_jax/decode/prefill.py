"""A sparse cache from a prompt: allocated, written layer by layer, and the statistics its index is built with.

    cache = empty_cache(attn, shape)                                        # zeros, placed; host memory checked
    cache = write_prompt(attn, cache, layer, keys, values, lengths, q)      # one prefill layer
    calib = layer_calibration(attn, cache, layer)                           # what a decode step plans with

A prefill layer's statistics are the session's own (:func:`~fathom_jax.calibrate.calibrate_session` of its keys,
stored in the cache per layer and group) or the hook's corpus statistics tiled over the groups; its plane stores
choose their warm planes from the prompt's importance (:func:`~fathom_jax.planner.prompt_importance`) where the
placement keeps any. :class:`~fathom_jax.decode.SparseAttention` delegates its ``init_cache`` and ``write_prompt``
here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from fathom_jax import planner as planner_lib
from fathom_jax.calibrate import SKIP_TOKENS, Calibration, calibrate_session
from fathom_jax.decode import writes as writes_lib
from fathom_jax.decode.cache import SparseCache, allocate, bulk_allocations
from fathom_jax.format import round_capacity
from fathom_jax.index import build_index
from fathom_jax.models.attention import CacheShape
from fathom_jax.placement import host_memory

if TYPE_CHECKING:  # the hook calls these with itself: a type, not an import cycle
    from fathom_jax.decode.hook import SparseAttention


def empty_cache(attn: SparseAttention, shape: CacheShape, *, shared_kv: bool = False) -> SparseCache:
    """See :meth:`SparseAttention.init_cache <fathom_jax.decode.SparseAttention.init_cache>`."""
    options = dict(rows=attn.rows, shared_kv=shared_kv, **_row_cache(attn, shape),
                   session_calibration=session_template(shape.head_dim) if attn.session else None)
    parts = attn.cache_parts(shape.layers)
    if attn.placement.in_host_memory:
        shards = attn.placement.num_shards
        sizes = [size // shards for size in bulk_allocations(parts, shape, **options)]
        host_memory.check(sizes, devices=attn.placement.local_shards,  # this host's share of the mesh
                          what=f"a cache of {round_capacity(shape.capacity)} tokens")
    return allocate(attn.placement.zeros, parts, shape, **options)


def _row_cache(attn: SparseAttention, shape: CacheShape) -> dict:
    """The row cache's slots and mode (``row_cache="last"``: the union's ``G k`` slots of the previous step)."""
    if attn.step.row_cache != "last":
        return dict(row_cache=attn.step.row_cache)
    if not shape.query_heads:
        raise ValueError("SparseAttention: step row_cache='last' keeps the previous step's union of G x k rows: "
                         "the cache shape must give its query heads per KV head (CacheShape.query_heads)")
    return dict(row_cache=shape.query_heads * attn.k, row_cache_mode="last")


@functools.lru_cache(maxsize=None)
def session_template(head_dim: int) -> Calibration:
    """The shapes of one group's session statistics (what a cache holds per layer and group)."""
    shapes = jax.eval_shape(calibrate_session, jax.ShapeDtypeStruct((1, 2 * SKIP_TOKENS + 2, head_dim), jnp.float32))
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), shapes)


def write_prompt(attn: SparseAttention, cache: SparseCache, layer, keys, values, lengths, queries=None
                 ) -> SparseCache:
    """See :meth:`SparseAttention.write_prompt <fathom_jax.decode.SparseAttention.write_prompt>`."""
    b, hkv, t, d = keys.shape
    keys, values = keys.reshape(b * hkv, t, d), values.reshape(b * hkv, t, d)
    lengths = jnp.repeat(jnp.asarray(lengths, jnp.int32), hkv)
    session = None
    if attn.session:
        session = calibrate_session(keys.astype(jnp.float32), length=lengths, skip_tokens=attn.skip_tokens)
    queries = _warm_plane_queries(attn, queries, b * hkv)
    return attn.placement.per_group(
        functools.partial(_write_groups, attn), cache, keys, values, lengths, session, queries,
        jnp.asarray(layer, jnp.int32), axes=(1, 0, 0, 0, 0, 0, None), out_axes=(cache, 1))


def _warm_plane_queries(attn: SparseAttention, queries, groups: int):
    """The prompt's queries per group ``[R, G, T, Dh]`` where the placement chooses warm planes by them, else None."""
    if not attn.placement.warm_planes:
        return None
    if queries is None:
        raise ValueError(f"write_prompt: the placement keeps warm planes (warm_planes={attn.placement.warm_planes}),"
                         " chosen from the prompt's queries: pass queries [B, Hkv, G, T, Dh]")
    return queries.reshape(groups, *queries.shape[2:])


def _write_groups(attn: SparseAttention, cache, keys, values, lengths, session, queries, layer):
    keys, values = writes_lib.materialized(keys, values)
    if attn.rows is not None:  # out-of-range values would come back wrong from the rows (checked at run time)
        valid = (jnp.arange(keys.shape[1]) < lengths[:, None])[..., None]
        attn.rows.check_values("write_prompt", jnp.where(valid, keys, 0), jnp.where(valid, values, 0))
    if session is not None:
        cache = dataclasses.replace(cache, calibration=jax.tree.map(lambda a, s: a.at[layer].set(s),
                                                                    cache.calibration, session))
        calib = session
    else:
        calib = corpus_calibration(attn, layer, keys.shape[0])
    built = build_index(keys.astype(jnp.float32), calib, cache.index.parts, capacity=cache.capacity, length=lengths)
    importance = None if queries is None else planner_lib.prompt_importance(queries, calib.variance, lengths)
    return writes_lib.write_layer(cache, layer, keys, values, built, writes_lib.writer(attn), importance)


def layer_calibration(attn: SparseAttention, cache: SparseCache, layer) -> Calibration | None:
    """This layer's statistics per group ``[R, ...]``: the session's from the cache, or the corpus statistics
    tiled over the batch."""
    if not attn.uses_calibration:
        return None
    if attn.session:
        return jax.tree.map(lambda a: a[layer], cache.calibration)
    return corpus_calibration(attn, layer, cache.groups)


def corpus_calibration(attn: SparseAttention, layer, groups: int) -> Calibration | None:
    """The hook's corpus statistics of ``layer`` tiled over ``groups`` groups (None without them)."""
    if attn.calibration is None or not attn.uses_calibration:
        return None
    calib = jax.tree.map(lambda a: a[layer], attn.calibration)
    if calib.batch_shape[0] != groups:
        calib = jax.tree.map(lambda a: jnp.tile(a, (groups // a.shape[0],) + (1,) * (a.ndim - 1)), calib)
    return calib
