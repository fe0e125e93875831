"""The attention protocol the decoders drive: attention with a cache of its own.

A decoder (:mod:`fathom_jax.models.decoder`) knows nothing of how a cache is laid out or where it lives. It asks an
attention object for an empty cache, runs each layer of a prompt through :meth:`~PromptAttention.attend_prompt` (the
prompt's attention at that layer, and the cache with the layer's keys and values written), and in a decode step calls
:meth:`~CacheAttention.attend` per layer inside its layer scan (the new token's post-RoPE query, key and value; the
cache does not hold the token yet; a carry it hands from layer to layer, :meth:`~CacheAttention.decode_carry` at the
first) and :meth:`~CacheAttention.commit` once after the scan with every layer's update.
Programs that take and return the cache are made by the attention object (:meth:`~CacheAttention.program`), which
knows how its cache must be donated and placed.

:class:`DenseCache` is the protocol over the dense :class:`~fathom_jax.models.cache.KVCache`, with any
:class:`~fathom_jax.models.cache.AttentionFn` over it; sparse attention (``fathom_jax.decode.SparseAttention``)
implements the same protocol outside this package, and q/k/v capture (:mod:`fathom_jax.models.capture`) implements
its prompt half.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from fathom_jax.models.cache import AttentionFn, KVCache, softmax_attention
from fathom_jax.models.prompt_attention import PREFILL_MLP_CHUNK, prefill_attention


@dataclasses.dataclass(frozen=True)
class CacheShape:
    """The shape of an attention cache: ``layers`` x ``batch`` sequences x ``kv_heads``, ``capacity`` tokens of
    ``head_dim`` channels, rows in ``dtype``; ``query_heads``: the query heads that share each KV head (0: not given,
    so the cache keeps nothing per query head); ``layer_ids``: the model layer of each cache layer, of
    ``model_layers`` (empty, 0: the cache's layers are the model's)."""

    layers: int
    batch: int
    kv_heads: int
    capacity: int
    head_dim: int
    dtype: Any
    query_heads: int = 0
    layer_ids: tuple[int, ...] = ()
    model_layers: int = 0

    @property
    def groups(self) -> int:
        return self.batch * self.kv_heads


def layer_runs(kinds: tuple | None, layers: int) -> tuple[tuple[int, int, Any], ...]:
    """``layers`` as runs of consecutive layers of one kind, ``(start, stop, kind)`` in order: one run of every layer
    where ``kinds`` is None (:attr:`CacheAttention.layer_kinds`)."""
    if kinds is None:
        return ((0, layers, None),)
    if len(kinds) != layers:
        raise ValueError(f"layer_runs: {len(kinds)} layer kinds for {layers} layers")
    starts = [i for i in range(layers) if i == 0 or kinds[i] != kinds[i - 1]]
    return tuple((a, b, kinds[a]) for a, b in zip(starts, [*starts[1:], layers]))


def scan_runs(body_of: Callable, carry, runs: tuple, *, unroll: int = 1):
    """``lax.scan`` of ``body_of(kind)`` over each run's layer indices in turn (``runs`` as :func:`layer_runs` gives
    them; ``unroll`` layers per loop iteration), the carry threaded through: ``(carry, ys stacked over every run's
    layers in order)``."""
    ys = []
    for start, stop, kind in runs:
        carry, run_ys = jax.lax.scan(body_of(kind), carry, jnp.arange(start, stop, dtype=jnp.int32),
                                     unroll=min(unroll, stop - start))
        ys.append(run_ys)
    return carry, ys[0] if len(ys) == 1 else jax.tree.map(lambda *parts: jnp.concatenate(parts), *ys)


@runtime_checkable
class PromptAttention(Protocol):
    """The attention of a prompt, layer by layer, with a cache of its own (what ``forward_prompt`` drives).

    ``mlp_chunk``: tokens per chunk of the prompt's MLP (None: all at once); chunks bound the ``[T, intermediate]``
    activations of a long prompt.
    """

    mlp_chunk: int | None

    def init_cache(self, shape: CacheShape) -> Any:
        """An empty cache of ``shape``."""

    def attend_prompt(self, cache, layer, q: Float[Array, "B Hkv G T D"], keys: Float[Array, "B Hkv T D"],
                      values: Float[Array, "B Hkv T D"], lengths: Int[Array, "B"]) -> tuple[Array, Any]:
        """Causal attention of the prompt at ``layer`` (post-RoPE; ``lengths [B]`` valid tokens per right-padded
        sequence): ``(o [B, Hkv, G, T, D], the cache with the layer's keys and values written)``."""


@runtime_checkable
class CacheAttention(PromptAttention, Protocol):
    """Attention with a cache of its own, as the decoder drives it through a prompt and then decode steps.

    ``fused``: a whole generation may be one program (the cache can ride in loop carries); ``ragged``: sequences of
    different lengths decode together; ``min_capacity``: the fewest cache slots it works with; ``layer_unroll``:
    layers per iteration of the decode step's layer scan; ``compiler_options``: XLA options for the programs that run
    its steps; ``offloaded``: the cache lives in host memory (it sizes itself; no device-memory check applies);
    ``layer_kinds``: per cache layer, a static key of the program :meth:`attend` runs there (None: every layer the
    same). A decoder scans each run of one kind on its own (:func:`layer_runs`) and passes the kind to :meth:`attend`,
    which then picks that layer's program by the key instead of branching on the traced layer (a GPU conditional
    blocks the host on its predicate every time it runs).
    Shapes in a decode step: ``q [B, Hkv, G, D]``, ``key``/``value [B, Hkv, D]``.
    """

    fused: bool
    ragged: bool
    min_capacity: int
    layer_unroll: int
    compiler_options: dict
    offloaded: bool
    layer_kinds: tuple | None

    def bind(self, shape: CacheShape) -> "CacheAttention":
        """This attention for caches of ``shape`` (checked; any configuration resolved once, before tracing)."""

    def start_decode(self, cache, lengths) -> Any:
        """The cache after the last prompt layer, its sequences ``lengths [B]`` long."""

    def positions(self, cache) -> Int[Array, "B"]:
        """Where each sequence's next token goes."""

    def decode_carry(self, cache) -> Any:
        """What a decode step carries from layer to layer (None: nothing; a selection shared across layers: the
        positions the last selection layer chose), the first layer's ``carry`` in :meth:`attend`."""

    def attend(self, cache, layer, q, key, value, carry=None, kind=None) -> tuple[Array, Any, Any]:
        """One layer of a decode step: ``(o [B, Hkv, G, D], this layer's update for commit, the carry for the next
        layer)``; ``kind``: ``layer_kinds[layer]`` where the decoder scans runs of one kind (None: not known)."""

    def commit(self, cache, updates) -> Any:
        """The cache with every layer's update (stacked on a leading layer axis) written."""

    def program(self, fn: Callable, cache, *, static: tuple = (), options: dict | None = None) -> Callable:
        """``fn(*static, attention, *args, cache) -> (outs, cache)`` as one compiled program, called as
        ``run(*args, cache=cache) -> (outs, cache)``; the cache is donated."""


@dataclasses.dataclass(frozen=True)
class DenseCache:
    """The dense KV cache (:class:`KVCache`, one shared length: equal-length prompts) with decode attention ``fn``
    over the whole cache (:func:`softmax_attention` by default, or any :class:`AttentionFn`: a plain function is
    hashed into the program, a callable pytree passes its arrays as traced arguments)."""

    fn: AttentionFn = softmax_attention
    fused = True
    ragged = False
    min_capacity = 1
    layer_unroll = 1
    offloaded = False
    layer_kinds = None
    mlp_chunk = PREFILL_MLP_CHUNK

    @property
    def compiler_options(self) -> dict:
        return {}

    def bind(self, shape: CacheShape) -> "DenseCache":
        return self

    def init_cache(self, shape: CacheShape) -> KVCache:
        dims = (shape.layers, shape.batch, shape.kv_heads, shape.capacity, shape.head_dim)
        return KVCache(jnp.zeros(dims, shape.dtype), jnp.zeros(dims, shape.dtype), jnp.zeros((), jnp.int32))

    def attend_prompt(self, cache: KVCache, layer, q, keys, values, lengths):
        return prefill_attention(q, keys, values), self.write_prompt(cache, layer, keys, values)

    @staticmethod
    def write_prompt(cache: KVCache, layer, keys, values) -> KVCache:
        at = (layer, 0, 0, 0, 0)
        return dataclasses.replace(cache, k=jax.lax.dynamic_update_slice(cache.k, keys[None].astype(cache.k.dtype), at),
                                   v=jax.lax.dynamic_update_slice(cache.v, values[None].astype(cache.v.dtype), at))

    def start_decode(self, cache: KVCache, lengths) -> KVCache:
        return dataclasses.replace(cache, length=jnp.asarray(lengths, jnp.int32)[0])

    def positions(self, cache: KVCache) -> Int[Array, "B"]:
        return jnp.full(cache.k.shape[1:2], cache.length, jnp.int32)

    def decode_carry(self, cache: KVCache) -> None:
        return None

    def attend(self, cache: KVCache, layer, q, key, value, carry=None, kind=None):
        at = (0, 0, cache.length, 0)
        k = jax.lax.dynamic_update_slice(cache.k[layer], key[:, :, None].astype(cache.k.dtype), at)
        v = jax.lax.dynamic_update_slice(cache.v[layer], value[:, :, None].astype(cache.v.dtype), at)
        return self.fn(q, k, v, cache.length + 1, layer), (key, value), carry

    def commit(self, cache: KVCache, updates) -> KVCache:
        keys, values = updates  # [L, B, Hkv, D]
        at = (0, 0, 0, cache.length, 0)
        put = lambda dst, src: jax.lax.dynamic_update_slice(dst, src[:, :, :, None].astype(dst.dtype), at)  # noqa: E731
        return KVCache(put(cache.k, keys), put(cache.v, values), cache.length + 1)

    def program(self, fn, cache, *, static=(), options=None):
        jitted = _dense_program(fn, static, tuple(sorted((options or {}).items())))
        leaves, treedef = jax.tree.flatten(self)
        return lambda *args, cache: jitted(treedef, leaves, args, cache)


def _flatten(d: DenseCache):
    # A plain function hook is static (hashed into the program); a callable pytree passes its arrays as traced leaves.
    leaves, treedef = jax.tree.flatten(d.fn)
    if len(leaves) == 1 and leaves[0] is d.fn:
        return (), d.fn
    return (tuple(leaves),), treedef


def _unflatten(aux, children):
    if isinstance(aux, jax.tree_util.PyTreeDef):
        return DenseCache(jax.tree.unflatten(aux, children[0]))
    return DenseCache(aux)


jax.tree_util.register_pytree_node(DenseCache, _flatten, _unflatten)


@functools.lru_cache(maxsize=None)
def _dense_program(fn, static, options):
    def body(treedef, leaves, args, cache):
        return fn(*static, jax.tree.unflatten(treedef, leaves), *args, cache)

    return jax.jit(body, static_argnums=(0,), donate_argnums=(3,), compiler_options=dict(options) or None)
