"""The compiled programs that take and return a placed sparse cache, and the ones that need no model.

* :func:`attention_step`: the attention part of one decode step for every layer, without the weight GEMMs (the
  paper's offload benchmark);
* :func:`flush`: :meth:`SparseAttention.flush` as one program;
* :func:`cache_from_dense`: a sparse cache built from a dense prefill's K/V cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from fathom_jax.decode.cache import SparseCache
from fathom_jax.models.attention import CacheShape, layer_runs, scan_runs

if TYPE_CHECKING:  # the hook makes its programs here (SparseAttention.program): a type, not an import cycle
    from fathom_jax.decode.hook import SparseAttention


def _attention_layers(attn: SparseAttention, q, key, value, cache: SparseCache):
    """Every layer's sparse step for given queries and new keys/values, then the writes (a decode step without the
    model: ``q [L, R, G, D]``, ``key, value [L, R, D]``)."""
    groups = q.shape[1]
    batch = cache.batch

    def body_of(kind):
        def body(carried, layer):
            previous, carry = carried
            q_l, k_l, v_l = (jax.lax.dynamic_index_in_dim(a, layer, 0, False) for a in (q, key, value))
            # Layer l starts after layer l - 1's output, as in the model, where its query is computed from that
            # output. A loop iteration per layer serializes them anyway; unrolled (``StepConfig.layer_unroll``), XLA
            # would otherwise run independent layers side by side, which no decoder can.
            q_l, _ = jax.lax.optimization_barrier((q_l, previous))
            shape = (batch, groups // batch)
            out, update, carry = attn.attend(cache, layer, q_l.reshape(*shape, *q_l.shape[1:]),
                                             k_l.reshape(*shape, -1), v_l.reshape(*shape, -1), carry, kind=kind)
            out = out.reshape(q_l.shape)
            return (out.astype(previous.dtype), carry), (out, update)
        return body

    # one scan per run of layers of one kind (a shared selection's selecting and sharing layers), as the models run them
    _, (out, updates) = scan_runs(body_of, (jnp.zeros(q.shape[1:], q.dtype), attn.decode_carry(cache)),
                                  layer_runs(attn.layer_kinds, cache.n_layers), unroll=attn.layer_unroll)
    return out, attn.commit(cache, updates)


def attention_step(q: Float[Array, "L R G D"], key: Float[Array, "L R D"], value: Float[Array, "L R D"],
                   cache: SparseCache, attn: SparseAttention):
    """The attention part of one decode step for every layer (one program): ``(outputs [L, R, G, D], cache)``; the
    cache is donated. ``attn`` is bound to the cache (:meth:`SparseAttention.bind`)."""
    return attention_program(attn, cache)(q, key, value, cache=cache)


def attention_program(attn: SparseAttention, cache: SparseCache):
    """The program :func:`attention_step` runs, ``program(q, key, value, cache=cache)`` (to lower it and read its
    HLO: ``scripts/offload_measure.py``)."""
    return attn.program(_attention_fn, cache)


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


def cache_from_dense(kv, lengths, attn: SparseAttention, layer_ids: tuple[int, ...] = (),
                     model_layers: int = 0) -> tuple[SparseCache, SparseAttention]:
    """A sparse cache built from a dense prefill's :class:`~fathom_jax.models.KVCache` (post-RoPE keys ``[L, B, Hkv,
    C, D]``), and the hook bound to it. ``layer_ids`` / ``model_layers``: the model layer of each cache layer, as the
    model's ``cache_shape`` names them (Gemma 3's global layers; a shared selection names model layers), static.

    One dense prefill can serve every method: each builds its own index from the same K/V rows (and, if
    session-calibrated, its statistics from the same prompt keys). ``lengths [B]`` are the valid tokens per sequence
    (right-padded prompts). Runs layer by layer in the hook's placement (jit it whole for device memory).
    """
    n_layers, b, hkv, capacity, d = kv.k.shape
    shape = CacheShape(layers=n_layers, batch=b, kv_heads=hkv, capacity=capacity, head_dim=d, dtype=kv.k.dtype,
                       layer_ids=tuple(layer_ids), model_layers=model_layers)
    attn = attn.bind(shape)
    cache = attn.init_cache(shape)
    for layer in range(n_layers):
        cache = attn.write_prompt(cache, layer, kv.k[layer], kv.v[layer], lengths)
    return attn.start_decode(cache, lengths), attn
