"""Flax NNX decoder for the Llama family (Llama 2/3.x, SmolLM2, Qwen2, Qwen3).

Layout choices, and why:
- Layers are built with `nnx.vmap`, so every layer parameter carries a leading [n_layers] axis and
  the forward pass is one `lax.scan` over layers: compile time does not grow with depth, and the
  layer index reaches the attention hook as a traced int.
- The KV cache is an explicit pytree (`KVCache`, `cache.py`) holding *post-RoPE* keys, threaded through
  the layers as part of the scan carry so that XLA updates it in place.
- `prefill` (many tokens, dense causal attention) and `decode_step` (one token, pluggable
  `attention_fn`) are separate entry points. `generation.py` drives generation with any attention that keeps
  a cache of its own (the `CacheAttention` protocol, `attention.py`: the dense cache, or sparse decoding in HBM
  or host memory), built from the same layers (`scan_layers`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from fathom_jax.models.attention import CacheAttention, CacheShape
from fathom_jax.models.cache import AttentionFn, KVCache, causal_attention, dense_attention
from fathom_jax.models.config import LlamaConfig
from fathom_jax.models.layers import DecoderLayer, RMSNorm, _linear
from fathom_jax.models.prefill import PREFILL_MLP_CHUNK, prefill_attention

# attend(q [B,Hkv,G,T,D], k_layer, v_layer, start, layer) -> [B,Hkv,G,T,D]
_Attend = Callable[..., jax.Array]


class LlamaForCausalLM(nnx.Module):
    """Decoder-only LM. Parameters of `layers` are stacked on a leading [n_layers] axis."""

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(config.vocab, config.hidden, dtype=dtype, param_dtype=dtype, rngs=rngs)

        @nnx.split_rngs(splits=config.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(r):
            return DecoderLayer(config, dtype=dtype, rngs=r)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(config.hidden, config.rms_norm_eps, dtype=dtype)
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config.hidden, config.vocab, False, dtype, rngs)

    # -- the decoder interface the generation drivers use (generation.py) ------------------
    # The decode state is the attention's cache itself (the model keeps nothing of its own between steps).
    ragged = True  # sequences of different lengths decode together where the attention allows it
    layerwise_prompt = True  # a prompt can be run one layer (one program) at a time

    def cache_shape(self, batch: int, capacity: int) -> CacheShape:
        cfg = self.config
        return CacheShape(layers=cfg.n_layers, batch=batch, kv_heads=cfg.n_kv_heads, capacity=capacity,
                          head_dim=cfg.head_dim, dtype=self.dtype)

    def init_state(self, attention: CacheAttention, batch: int, capacity: int):
        return attention.init_cache(self.cache_shape(batch, capacity))

    @staticmethod
    def split_state(state):
        """``(own, cache)``: what the model keeps between steps (nothing) and the attention's cache."""
        return None, state

    @staticmethod
    def join_state(own, cache):
        return cache

    def prompt_layer(self, attention: CacheAttention, h, lengths, cache, layer):
        """One layer of the prompt: the next hidden states and the cache with this layer's keys and values written."""
        graphdef, layer_state = nnx.split(self.layers)
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], layer_state))

        def attend(q, k, v):
            return prefill_attention(q, k, v), (k, v)

        h, (k, v) = block(self.config, h, jnp.arange(h.shape[1], dtype=jnp.int32), attend, mlp_chunk=PREFILL_MLP_CHUNK)
        return h, attention.write_prompt(cache, layer, k, v, lengths)

    def last_logits(self, h, lengths):
        """f32 logits [B, V] at each sequence's last prompt token."""
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return self.logits(self.norm(last))

    def forward_prompt(self, attention: CacheAttention, prompt, lengths, state):
        """The whole prompt in one program (a layer scan): ``(logits at each last prompt token [B, V], state)``."""
        def layer_body(carry, layer):
            h, cache = carry
            return self.prompt_layer(attention, h, lengths, cache, layer), None

        (h, cache), _ = jax.lax.scan(layer_body, (self.embed_tokens(prompt), state),
                                     jnp.arange(self.config.n_layers, dtype=jnp.int32))
        return self.last_logits(h, lengths), cache

    def forward_token(self, attention: CacheAttention, tokens, state):
        """One decode step of every sequence at its own position: ``(f32 logits [B, V], state)``. Each layer calls
        ``attention.attend`` inside the layer scan, ``attention.commit`` runs once after it."""
        cache = state

        def attend_layer(layer, q, k, v):
            o, update = attention.attend(cache, layer, q[:, :, :, 0], k[:, :, 0], v[:, :, 0])
            return o[:, :, :, None], update

        positions = attention.positions(cache)[:, None]
        x, updates = self.scan_layers(self.embed_tokens(tokens[:, None]), positions, attend_layer,
                                      unroll=attention.layer_unroll)
        return self.logits(self.norm(x[:, 0])), attention.commit(cache, updates)

    def capture_qkv(self, tokens: Int[Array, "T"]) -> dict[str, Float[Array, "..."]]:
        """Post-RoPE q [L,H,T,D], k [L,Hkv,T,D], v [L,Hkv,T,D] (f32) of one sequence's dense prefill."""
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim != 1:
            raise ValueError(f"capture_qkv takes one sequence [T], got shape {tokens.shape}")
        graphdef, state = nnx.split(self)
        return _capture(graphdef, state, tokens[None])

    # -- core ------------------------------------------------------------------------------

    def scan_layers(self, x, positions, attend_layer, *, unroll: int = 1):
        """``lax.scan`` of the decoder layers with ``x`` as the carry (``unroll`` layers per loop iteration).

        ``attend_layer(layer_index, q, k, v) -> (o, ys)``; returns ``(x, ys stacked on [n_layers])``.
        """
        cfg = self.config
        graphdef, layer_state = nnx.split(self.layers)

        def body(x, scanned):
            state, idx = scanned
            layer = nnx.merge(graphdef, state)
            return layer(cfg, x, positions, lambda q, k, v: attend_layer(idx, q, k, v))

        return jax.lax.scan(body, x, (layer_state, jnp.arange(cfg.n_layers, dtype=jnp.int32)), unroll=unroll)

    def _forward(self, tokens: Int[Array, "B T"], cache: KVCache, attend: _Attend, capture: bool):
        """Runs all layers on tokens at positions cache.length + [0, T); returns final hidden,
        the updated cache, and (if capture) per-layer post-RoPE q/k/v."""
        cfg = self.config
        start = cache.length
        positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        graphdef, layer_state = nnx.split(self.layers)

        def body(carry, scanned):
            x, k_all, v_all = carry  # the cache rides in the carry, so XLA updates it in place
            state, idx = scanned
            layer = nnx.merge(graphdef, state)

            def attend_here(q, k, v):
                # Write this chunk's post-RoPE keys/values into the cache, then attend over the cache.
                at = (idx, 0, 0, start, 0)
                k2 = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), at)
                v2 = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), at)
                return attend(q, k2[idx], v2[idx], start, idx), ((q, k, v) if capture else None, k2, v2)

            x, (ys, k_all, v_all) = layer(cfg, x, positions, attend_here)
            return (x, k_all, v_all), ys

        (x, k_all, v_all), ys = jax.lax.scan(
            body, (self.embed_tokens(tokens), cache.k, cache.v),
            (layer_state, jnp.arange(cfg.n_layers, dtype=jnp.int32)),
        )
        return self.norm(x), KVCache(k_all, v_all, start + tokens.shape[1]), ys

    def logits(self, h: Float[Array, "... E"]) -> Float[Array, "... V"]:
        out = self.embed_tokens.attend(h) if self.config.tie_word_embeddings else self.lm_head(h)
        return out.astype(jnp.float32)

    # -- public ----------------------------------------------------------------------------

    def prefill(
        self, tokens: Int[Array, "B T"], cache: KVCache, *, last_only: bool = False
    ) -> tuple[Float[Array, "B T V"], KVCache]:
        """Dense causal forward of `tokens` at positions cache.length + [0, T).

        Returns f32 logits [B, T, V] (or [B, V] for the last token if `last_only`, which saves
        T*V floats on long prompts) and the cache with length += T. Starting from a non-empty
        cache (chunked prefill) works: the chunk attends to everything already cached.
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim != 2:
            raise ValueError(f"prefill takes tokens [batch, T], got shape {tokens.shape}")
        check_fits(tokens.shape[1], cache)
        graphdef, state = nnx.split(self)
        return _prefill(graphdef, state, tokens, cache, last_only)

    def decode_step(
        self,
        token: Int[Array, "B"],
        cache: KVCache,
        position: Int[Array, ""] | int | None = None,
        *,
        attention_fn: AttentionFn = dense_attention,
    ) -> tuple[Float[Array, "B V"], KVCache]:
        """One token per sequence at `position` (default cache.length), attention via `attention_fn`.

        The new key/value is written to slot `position` and `attention_fn` sees length
        position + 1. Returns f32 logits [B, V] and the cache with length = position + 1.
        `position` must be < capacity (under jit it cannot be checked; XLA would clamp the write).
        Attention with a cache of its own (:class:`~fathom_jax.models.attention.CacheAttention`) decodes through
        :func:`fathom_jax.models.generation.decode_step`.
        """
        if isinstance(attention_fn, CacheAttention):
            raise TypeError(
                "decode_step takes a dense-cache AttentionFn; attention with its own cache (e.g. a SparseAttention) "
                "decodes through fathom_jax.models.generation.prefill / decode_step, or generate(..., attention_fn=)"
            )
        if position is not None:
            cache = dataclasses.replace(cache, length=jnp.asarray(position, jnp.int32))
        check_fits(1, cache)
        graphdef, state = nnx.split(self)
        attn_static, attn_leaves = split_attention(attention_fn)
        return _decode_step(graphdef, state, jnp.asarray(token, jnp.int32), cache, attn_static, attn_leaves)


# The public methods run through these jitted pure functions, so eager calls are fast too (the
# module is split into a static graphdef and a state pytree, and rebuilt inside the trace).
@functools.partial(jax.jit, static_argnames=("graphdef", "last_only"))
def _prefill(graphdef, state, tokens, cache, last_only):
    model = nnx.merge(graphdef, state)
    h, cache, _ = model._forward(tokens, cache, dense_attend, capture=False)
    return model.logits(h[:, -1] if last_only else h), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "attn_static"))
def _decode_step(graphdef, state, token, cache, attn_static, attn_leaves):
    model = nnx.merge(graphdef, state)
    attention_fn = join_attention(attn_static, attn_leaves)

    def attend(q, k, v, start, layer):
        return attention_fn(q[:, :, :, 0], k, v, start + 1, layer)[:, :, :, None]

    h, cache, _ = model._forward(token[:, None], cache, attend, capture=False)
    return model.logits(h[:, 0]), cache


def split_attention(fn) -> tuple:
    """(static part, traced leaves) of an attention hook.

    A plain callable (no pytree leaves but itself) is a static jit argument: hashed, baked into
    the program. A callable *pytree* (e.g. a frozen dataclass registered with
    `jax.tree_util.register_dataclass` that holds calibration arrays) passes its array leaves as
    traced arguments, so new arrays of the same shapes reuse the compiled program.
    """
    leaves, treedef = jax.tree.flatten(fn)
    if len(leaves) == 1 and leaves[0] is fn:
        return fn, ()
    return treedef, tuple(leaves)


def join_attention(static, leaves):
    return jax.tree.unflatten(static, leaves) if isinstance(static, jax.tree_util.PyTreeDef) else static


def dense_attend(q, k, v, start, layer):
    del layer
    return causal_attention(q, k, v, start)


def check_fits(n_new: int, cache: KVCache) -> None:
    if n_new > cache.capacity:
        raise ValueError(f"{n_new} tokens do not fit in a KV cache of capacity {cache.capacity}")
    try:  # concrete length (outside jit): check the end too
        end = int(cache.length) + n_new
    except (jax.errors.ConcretizationTypeError, TypeError):
        return
    if end > cache.capacity:
        raise ValueError(
            f"cache length {int(cache.length)} + {n_new} new tokens exceeds capacity {cache.capacity}"
        )


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _capture(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    cache = KVCache.init(model.config, 1, tokens.shape[1], model.dtype)
    _, _, (q, k, v) = model._forward(tokens, cache, dense_attend, capture=True)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    # q: [L,1,Hkv,G,T,D] -> [L,H,T,D]; k, v: [L,1,Hkv,T,D] -> [L,Hkv,T,D]
    q = q[:, 0].reshape(q.shape[0], -1, q.shape[-2], q.shape[-1])
    return {"q": f32(q), "k": f32(k[:, 0]), "v": f32(v[:, 0])}
