"""The compiled programs that take and return a placed sparse cache, and the ones that need no model.

A program over a cache takes it as two arguments, its small leaves and its bulk leaves (:func:`~fathom_jax.placement.
split_bulk`). The small leaves are donated (XLA updates them in place: lengths, tails, a row cache of gigabytes). In
device memory the bulk leaves are donated too and the whole cache is returned. In host memory the kernels write the
bulk arrays in place and the program returns the cache without them: returning a host array from a program makes
XLA copy it, and donating one it does not return would free it.

* :func:`cache_program`: any ``fn(*static, attention, *args, cache) -> (outs, cache)`` so compiled (the decoder's
  prefill-layer and decode-step programs are made this way, :meth:`SparseAttention.program`);
* :func:`attention_step`: the attention part of one decode step for every layer, without the weight GEMMs (the
  paper's offload benchmark);
* :func:`flush`: :meth:`SparseAttention.flush` as one program;
* :func:`cache_from_dense`: a sparse cache built from a dense prefill's K/V cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from fathom_jax.decode.cache import SparseCache
from fathom_jax.decode.hook import SparseAttention
from fathom_jax.models.attention import CacheShape
from fathom_jax.placement import attach_bulk, join_bulk, split_bulk


def cache_program(attn: SparseAttention, fn, cache: SparseCache, *, static: tuple = (), options: dict | None = None):
    """``run(*args, cache=cache) -> (outs, cache)`` running ``fn(*static, attn, *args, cache)`` as one program:
    the cache donated (see the module docstring), ``outs`` replicated over the mesh, compiled with the step's XLA
    options and ``options`` on top. Programs are made once per (fn, static, hook, cache layout, options)."""
    placement = attn.placement
    bulk = cache.bulk()
    in_place = placement.in_host_memory
    leaves, treedef = jax.tree.flatten(placement.shardings(cache, bulk))
    merged = dict(attn.context.run.compiler_options) | dict(options or {})
    attn_leaves, attn_static = jax.tree.flatten(attn)
    jitted = _compiled(fn, static, attn_static, (treedef, tuple(leaves)), in_place, tuple(sorted(merged.items())),
                       placement.replicated())

    def run(*args, cache: SparseCache):
        small, bulk_leaves = split_bulk(cache, bulk)
        # Committed where the program runs (replicated over a mesh): an uncommitted argument (a fresh token array)
        # is another jit signature than the committed one the previous step returned, and would compile again.
        args, hook_leaves = jax.device_put((args, attn_leaves), placement.replicated())
        outs, small = jitted(hook_leaves, args, small, bulk_leaves)
        return outs, (attach_bulk(small, cache, bulk) if in_place else small)

    run.lower = lambda *args, cache: jitted.lower(attn_leaves, args, *split_bulk(cache, bulk))  # nothing runs
    run.trace = lambda *args, cache: jitted.trace(attn_leaves, args, *split_bulk(cache, bulk))  # its jaxpr
    run.jit = jitted  # the program itself (its arguments: the hook's leaves, the args, small and bulk leaves)
    return run


@functools.lru_cache(maxsize=None)
def _compiled(fn, static, attn_static, cache_shardings, in_place, options, out_sharding):
    def detach(cache):
        return split_bulk(cache, cache.bulk())[0] if in_place else cache

    def body(attn_leaves, args, small, bulk):
        attention = jax.tree.unflatten(attn_static, attn_leaves)
        outs, cache = fn(*static, attention, *args, join_bulk(small, bulk))
        return outs, detach(cache)

    shardings = jax.tree.unflatten(*cache_shardings)
    out_shardings = detach(shardings) if in_place else shardings
    donate = (2,) if in_place else (2, 3)  # the small leaves, and the bulk ones unless written in place
    return jax.jit(body, donate_argnums=donate, out_shardings=(out_sharding, out_shardings),
                   compiler_options=dict(options) or None)


def _attention_layers(attn: SparseAttention, q, key, value, cache: SparseCache):
    """Every layer's sparse step for given queries and new keys/values, then the writes (a decode step without the
    model: ``q [L, R, G, D]``, ``key, value [L, R, D]``)."""
    groups = q.shape[1]
    batch = cache.batch

    def body(previous, xs):
        q_l, k_l, v_l, layer = xs
        # Layer l starts after layer l - 1's output, as in the model, where its query is computed from that output.
        # A loop iteration per layer serializes them anyway; unrolled (``StepConfig.layer_unroll``), XLA would
        # otherwise run independent layers side by side, which no decoder can.
        q_l, _ = jax.lax.optimization_barrier((q_l, previous))
        shape = (batch, groups // batch)
        out, update = attn.attend(cache, layer, q_l.reshape(*shape, *q_l.shape[1:]), k_l.reshape(*shape, -1),
                                  v_l.reshape(*shape, -1))
        out = out.reshape(q_l.shape)
        return out.astype(previous.dtype), (out, update)

    _, (out, updates) = jax.lax.scan(body, jnp.zeros(q.shape[1:], q.dtype),
                                     (q, key, value, jnp.arange(cache.n_layers, dtype=jnp.int32)),
                                     unroll=attn.layer_unroll)
    return out, attn.commit(cache, updates)


def attention_step(q: Float[Array, "L R G D"], key: Float[Array, "L R D"], value: Float[Array, "L R D"],
                   cache: SparseCache, attn: SparseAttention):
    """The attention part of one decode step for every layer (one program): ``(outputs [L, R, G, D], cache)``; the
    cache is donated. ``attn`` is bound to the cache (:meth:`SparseAttention.bind`)."""
    return attn.program(_attention_fn, cache)(q, key, value, cache=cache)


def _attention_fn(attn, q, key, value, cache):
    return _attention_layers(attn, q, key, value, cache)


def flush(cache: SparseCache, attn: SparseAttention) -> SparseCache:
    """:meth:`SparseAttention.flush` as one program (the partial newest plane blocks written into the stores, where
    they live); needed with ``StepConfig(index_writes="full_blocks")`` before reading the stores."""
    return attn.program(_flush_fn, cache)(cache=cache)[1]


def _flush_fn(attn, cache):
    return None, attn.flush(cache)


def cache_shape(cache: SparseCache) -> CacheShape:
    """The shape of the caches like ``cache`` (what :meth:`SparseAttention.bind` takes)."""
    return CacheShape(layers=cache.n_layers, batch=cache.batch, kv_heads=cache.groups // cache.batch,
                      capacity=cache.capacity, head_dim=cache.head_dim, dtype=cache.layout.dtype)


def cache_from_dense(kv, lengths, attn: SparseAttention) -> tuple[SparseCache, SparseAttention]:
    """A sparse cache built from a dense prefill's :class:`~fathom_jax.models.KVCache` (post-RoPE keys ``[L, B, Hkv,
    C, D]``), and the hook bound to it.

    One dense prefill can serve every method: each builds its own index from the same K/V rows (and, if
    session-calibrated, its statistics from the same prompt keys). ``lengths [B]`` are the valid tokens per sequence
    (right-padded prompts). Runs layer by layer in the hook's placement (jit it whole for device memory).
    """
    n_layers, b, hkv, capacity, d = kv.k.shape
    shape = CacheShape(layers=n_layers, batch=b, kv_heads=hkv, capacity=capacity, head_dim=d, dtype=kv.k.dtype)
    attn = attn.bind(shape)
    cache = attn.init_cache(shape)
    for layer in range(n_layers):
        cache = attn.write_prompt(cache, layer, kv.k[layer], kv.v[layer], lengths)
    return attn.start_decode(cache, lengths), attn
