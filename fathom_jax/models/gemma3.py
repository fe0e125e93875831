"""Flax NNX decoder for Gemma 3 (text): ``sliding_window_pattern - 1`` sliding-window ("local") layers, then one
global layer, repeated; a few local layers may follow the last global one (the "tail").

Layout choices, and why:
- Parameters are stacked per kind, in the order the loop reads them: ``local_layers`` [n_blocks * (P - 1)],
  ``global_layers`` [n_blocks], ``tail_layers`` [n_tail] (only if n_tail > 0). The forward pass is one
  ``lax.scan`` over the pattern's repeats whose body scans the block's P - 1 local layers (their stacked
  parameters seen as [n_blocks, P - 1], a free reshape) and then runs its global layer; the tail is a second
  scan. Compile time does not grow with depth, and no layer's weights are gathered or copied per step.
- Each kind has its own attention callback (:meth:`Gemma3ForCausalLM.run_layers`): local layers attend over a
  window ring buffer, global layers through a pluggable hook that receives the *global* layer ordinal.
  :meth:`~Gemma3ForCausalLM.prefill` / :meth:`~Gemma3ForCausalLM.decode_step` keep a dense cache
  (:class:`~fathom_jax.models.gemma3_cache.Gemma3Cache`, post-RoPE keys, threaded through the scans in the
  carry so that XLA updates it in place) and take an :class:`~fathom_jax.models.AttentionFn` for the global
  layers, as the Llama decoder does. ``generation.py`` drives generation with any
  :class:`~fathom_jax.models.attention.CacheAttention` (dense, or a sparse step) on the global layers only, through
  the decoder interface both models implement (``forward_prompt``, ``forward_token``, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from fathom_jax.models.attention import CacheAttention, CacheShape
from fathom_jax.models.cache import AttentionFn, dense_attention
from fathom_jax.models.gemma3_cache import (Gemma3Cache, Gemma3State, Windows, chunked_causal_attention,
                                            window_attention)
from fathom_jax.models.gemma3_config import Gemma3Config
from fathom_jax.models.gemma3_layers import DecoderLayer, RMSNorm, global_inv_freq, local_inv_freq
from fathom_jax.models.llama import check_fits, join_attention, split_attention
from fathom_jax.models.prefill import prefill_attention


def _stack(config: Gemma3Config, n: int, dtype, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(r):
        return DecoderLayer(config, dtype=dtype, rngs=r)

    return make(rngs)


class Gemma3ForCausalLM(nnx.Module):
    """Decoder-only LM with tied embeddings (transformers' ``Gemma3ForCausalLM``, text only)."""

    def __init__(self, config: Gemma3Config, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(config.vocab, config.hidden, dtype=dtype, param_dtype=dtype, rngs=rngs)
        p1 = config.sliding_window_pattern - 1
        if p1:
            self.local_layers = _stack(config, config.n_blocks * p1, dtype, rngs)
        self.global_layers = _stack(config, config.n_blocks, dtype, rngs)
        if config.n_tail:
            self.tail_layers = _stack(config, config.n_tail, dtype, rngs)
        self.norm = RMSNorm(config.hidden, config.rms_norm_eps, dtype=dtype)

    # -- the decoder interface the generation drivers use (generation.py) ------------------
    # The decode state is the local layers' window rings and the global layers' attention cache (Gemma3State).
    ragged = False  # the rings have one length for the batch
    layerwise_prompt = False  # a prompt runs through every layer in one program

    def cache_shape(self, batch: int, capacity: int) -> CacheShape:
        """The global layers' cache shape (``layers`` = the number of global layers)."""
        cfg = self.config
        return CacheShape(layers=len(cfg.global_layers), batch=batch, kv_heads=cfg.n_kv_heads, capacity=capacity,
                          head_dim=cfg.head_dim, dtype=self.dtype)

    def init_state(self, attention: CacheAttention, batch: int, capacity: int) -> Gemma3State:
        return Gemma3State(Windows.init(self.config, batch, self.dtype),
                           attention.init_cache(self.cache_shape(batch, capacity)))

    @staticmethod
    def split_state(state: Gemma3State):
        return state.windows, state.cache

    @staticmethod
    def join_state(windows, cache) -> Gemma3State:
        return Gemma3State(windows, cache)

    def forward_prompt(self, attention: CacheAttention, prompt, lengths, state: Gemma3State):
        """The whole (equal-length) prompt in one layer loop: local layers through their windows, global layers causal
        over the prompt, their rows handed to ``attention.write_prompt``. Returns (f32 logits at the last token
        [B, V], state)."""
        t = prompt.shape[1]

        def local_attend(i, q, k, v, s):
            o, windows = s.windows.attend(i, q, k, v)
            return o, dataclasses.replace(s, windows=windows), None

        def global_attend(g, q, k, v, s):
            return prefill_attention(q, k, v), dataclasses.replace(
                s, cache=attention.write_prompt(s.cache, g, k, v, lengths)), None

        x, state, _, _ = self.run_layers(self.embed(prompt), jnp.arange(t, dtype=jnp.int32), local_attend,
                                         global_attend, state)
        # Computed, not the constant t: a program's constant output comes back uncommitted, and the next decode
        # step would compile once more for it.
        windows = dataclasses.replace(state.windows, length=state.windows.length + t)
        return self.logits(self.norm(x[:, -1])), dataclasses.replace(state, windows=windows)

    def forward_token(self, attention: CacheAttention, tokens, state: Gemma3State):
        """One decode step: ``(f32 logits [B, V], state)``. The global layers call ``attention.attend(cache, g, q,
        key, value)`` inside the layer loop (the cache read-only there) and ``attention.commit`` runs once after it."""
        windows, cache = state.windows, state.cache
        start = windows.length

        def local_attend(i, q, k, v, w):
            o, w = w.attend(i, q, k, v)
            return o, w, None

        def global_attend(g, q, k, v, w):
            o, update = attention.attend(cache, g, q[:, :, :, 0], k[:, :, 0], v[:, :, 0])
            return o[:, :, :, None], w, update

        x, windows, _, updates = self.run_layers(self.embed(tokens[:, None]), start + jnp.arange(1, dtype=jnp.int32),
                                                 local_attend, global_attend, windows)
        state = Gemma3State(dataclasses.replace(windows, length=start + 1), attention.commit(cache, updates))
        return self.logits(self.norm(x[:, 0])), state

    def capture_qkv(self, tokens: Int[Array, "T"], *, layers: str = "global") -> dict[str, Float[Array, "..."]]:
        """:func:`capture_qkv` of this model (its global layers by default)."""
        return capture_qkv(self, tokens, layers=layers)

    # -- core ------------------------------------------------------------------------------

    def embed(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T E"]:
        # sqrt(hidden) is rounded to the model dtype first, as transformers does (bf16: sqrt(640) -> 25.25).
        return self.embed_tokens(tokens) * jnp.asarray(np.float32(math.sqrt(self.config.hidden))).astype(self.dtype)

    def run_layers(self, x, positions, local_attend, global_attend, carry):
        """All layers in model order, ``x`` and ``carry`` (e.g. the cache) threaded through.

        ``local_attend(i, q, k, v, carry)`` and ``global_attend(g, q, k, v, carry)`` return ``(o, carry, ys)``
        with q [B,Hkv,G,T,D] (post-RoPE, times ``config.query_scale``), k/v [B,Hkv,T,D] and o [B,Hkv,G,T,D];
        ``i`` / ``g`` are traced int32 ordinals among the local / global layers (model layer
        ``config.local_layers[i]`` / ``config.global_layers[g]``). Returns ``(x, carry, local ys stacked
        [n_local, ...], global ys stacked [n_global, ...])``.

        The stacked parameters are closed over and indexed by ordinal, not scanned as ``xs``: a scan over
        blocks would slice (on XLA:CPU, copy) each block's local weights before the inner scan slices them
        again.
        """
        cfg = self.config
        p1, nb = cfg.sliding_window_pattern - 1, cfg.n_blocks
        local_freq, global_freq = local_inv_freq(cfg), global_inv_freq(cfg)

        def stacked(stack):  # index -> that layer of the stack, its parameters sliced from the closed-over stack
            graphdef, state = nnx.split(stack)
            return lambda index: nnx.merge(
                graphdef, jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, False), state))

        def local_body(layer_at, first):
            def body(c, j):  # j: index into the stack; first + j: the local ordinal
                x, carry = c
                i = first + j
                x, (carry, ys) = layer_at(j)(
                    cfg, x, positions, local_freq, lambda q, k, v: _pack(local_attend(i, q, k, v, carry)))
                return (x, carry), ys
            return body

        global_at = stacked(self.global_layers)
        # local_layers holds the blocks' local layers back to back: block g's are [g * p1, (g + 1) * p1).
        block_local = local_body(stacked(self.local_layers), 0) if p1 else None

        def block_body(c, g):
            ys_local = None
            if p1:
                c, ys_local = jax.lax.scan(block_local, c, g * p1 + jnp.arange(p1, dtype=jnp.int32))
            x, carry = c
            x, (carry, ys) = global_at(g)(
                cfg, x, positions, global_freq, lambda q, k, v: _pack(global_attend(g, q, k, v, carry)))
            return (x, carry), (ys_local, ys)

        (x, carry), (ys_local, ys_global) = jax.lax.scan(block_body, (x, carry), jnp.arange(nb, dtype=jnp.int32))
        ys_local = jax.tree.map(lambda a: a.reshape(nb * p1, *a.shape[2:]), ys_local) if p1 else None
        if cfg.n_tail:
            tail = local_body(stacked(self.tail_layers), nb * p1)
            (x, carry), ys_tail = jax.lax.scan(tail, (x, carry), jnp.arange(cfg.n_tail, dtype=jnp.int32))
            ys_local = ys_tail if ys_local is None else jax.tree.map(
                lambda a, b: jnp.concatenate([a, b]), ys_local, ys_tail)
        return x, carry, ys_local, ys_global

    def _forward(self, tokens: Int[Array, "B T"], cache: Gemma3Cache, attend, capture: str | None = None):
        """All layers on tokens at positions cache.length + [0, T). ``attend(q, k_layer, v_layer, start, g)``
        is the global layers' attention over their cache, which already holds the new rows at start + [0, T).
        Returns (final hidden, cache, captured (q, k, v) of the ``capture`` kind of layer or None)."""
        start = cache.length
        positions = start + jnp.arange(tokens.shape[1], dtype=jnp.int32)

        def local_attend(i, q, k, v, c):
            o, rk, rv = window_attention(q, k, v, c.local_k[i], c.local_v[i], start)
            c = dataclasses.replace(c, local_k=c.local_k.at[i].set(rk), local_v=c.local_v.at[i].set(rv))
            return o, c, ((q, k, v) if capture == "local" else None)

        def global_attend(g, q, k, v, c):
            at = (g, 0, 0, start, 0)
            k_all = jax.lax.dynamic_update_slice(c.k, k[None].astype(c.k.dtype), at)
            v_all = jax.lax.dynamic_update_slice(c.v, v[None].astype(c.v.dtype), at)
            o = attend(q, k_all[g], v_all[g], start, g)
            return o, dataclasses.replace(c, k=k_all, v=v_all), ((q, k, v) if capture == "global" else None)

        x, cache, ys_local, ys_global = self.run_layers(self.embed(tokens), positions, local_attend, global_attend,
                                                        cache)
        cache = dataclasses.replace(cache, length=start + tokens.shape[1])
        return self.norm(x), cache, {"local": ys_local, "global": ys_global}.get(capture)

    def logits(self, h: Float[Array, "... E"]) -> Float[Array, "... V"]:
        # Not Embed.attend (h @ E.T): XLA:CPU materialises the [vocab, hidden] transpose on every call.
        out = jnp.einsum("...e,ve->...v", h, self.embed_tokens.embedding[...]).astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        return out if cap is None else cap * jnp.tanh(out / cap)

    # -- public ----------------------------------------------------------------------------

    def prefill(self, tokens: Int[Array, "B T"], cache: Gemma3Cache, *, last_only: bool = False
                ) -> tuple[Float[Array, "B T V"], Gemma3Cache]:
        """Dense causal forward of ``tokens`` at positions cache.length + [0, T): f32 logits [B, T, V] (or
        [B, V] at the last token if ``last_only``) and the cache with length += T. Chunked prefill (a
        non-empty cache) works: local layers see the ring's last window, global layers everything cached."""
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim != 2:
            raise ValueError(f"prefill takes tokens [batch, T], got shape {tokens.shape}")
        _check_cache(self, cache, tokens.shape[0])
        check_fits(tokens.shape[1], cache)
        graphdef, state = nnx.split(self)
        return _prefill(graphdef, state, tokens, cache, last_only)

    def decode_step(self, token: Int[Array, "B"], cache: Gemma3Cache, *, attention_fn: AttentionFn = dense_attention
                    ) -> tuple[Float[Array, "B V"], Gemma3Cache]:
        """One token per sequence at position cache.length. Local layers attend over their window; the global
        layers through ``attention_fn`` (an :class:`~fathom_jax.models.AttentionFn`: q [B,Hkv,G,D], this
        global layer's cache k/v [B,Hkv,C,D] holding the new row, length = position + 1, ``layer`` = the
        global ordinal g, model layer ``config.global_layers[g]``). Returns f32 logits [B, V] and the cache.

        There is no ``position`` argument (the Llama decoder's rewind): the ring has forgotten what a rewound
        window would need."""
        if isinstance(attention_fn, CacheAttention):
            raise TypeError("decode_step takes a dense-cache AttentionFn; attention with its own cache (e.g. a "
                            "SparseAttention) decodes through fathom_jax.models.generate")
        token = jnp.asarray(token, jnp.int32)
        if token.ndim != 1:
            raise ValueError(f"decode_step takes one token per sequence [batch], got shape {token.shape}")
        _check_cache(self, cache, token.shape[0])
        check_fits(1, cache)
        graphdef, state = nnx.split(self)
        attn_static, attn_leaves = split_attention(attention_fn)
        return _decode_step(graphdef, state, token, cache, attn_static, attn_leaves)


def _pack(result):
    o, carry, ys = result
    return o, (carry, ys)


def _check_cache(model: Gemma3ForCausalLM, cache, batch: int) -> None:
    cfg = model.config
    if not isinstance(cache, Gemma3Cache):
        raise TypeError(f"Gemma 3 takes a Gemma3Cache (Gemma3Cache.init(config, batch, capacity)), got "
                        f"{type(cache).__name__}")
    want = (len(cfg.local_layers), cache.k.shape[1], cfg.n_kv_heads, cfg.sliding_window, cfg.head_dim)
    if cache.local_k.shape != want or cache.k.shape[0] != len(cfg.global_layers) or cache.k.shape[1] != batch:
        raise ValueError(f"cache of shapes local {cache.local_k.shape}, global {cache.k.shape} does not fit this "
                         f"model and a batch of {batch} (local {want}, {len(cfg.global_layers)} global layers)")


@functools.partial(jax.jit, static_argnames=("graphdef", "last_only"))
def _prefill(graphdef, state, tokens, cache, last_only):
    model = nnx.merge(graphdef, state)
    h, cache, _ = model._forward(tokens, cache, dense_prefill_attend)
    return model.logits(h[:, -1] if last_only else h), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "attn_static"))
def _decode_step(graphdef, state, token, cache, attn_static, attn_leaves):
    model = nnx.merge(graphdef, state)
    attention_fn = join_attention(attn_static, attn_leaves)

    def attend(q, k, v, start, g):
        return attention_fn(q[:, :, :, 0], k, v, start + 1, g)[:, :, :, None]

    h, cache, _ = model._forward(token[:, None], cache, attend)
    return model.logits(h[:, 0]), cache


def dense_prefill_attend(q, k, v, start, g):
    del g
    return chunked_causal_attention(q, k, v, start)


# ----------------------------------------------------------------------------------------------
# q/k/v capture


@functools.partial(jax.jit, static_argnames=("graphdef", "kind"))
def _capture(graphdef, state, tokens, kind):
    model = nnx.merge(graphdef, state)
    _, _, (q, k, v) = model._forward(tokens, Gemma3Cache.init(model.config, 1, tokens.shape[1], model.dtype),
                                     dense_prefill_attend, capture=kind)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    # q: [L,1,Hkv,G,T,D] -> [L,H,T,D]; k, v: [L,1,Hkv,T,D] -> [L,Hkv,T,D]
    return {"q": f32(q[:, 0].reshape(q.shape[0], -1, *q.shape[-2:])), "k": f32(k[:, 0]), "v": f32(v[:, 0])}


def capture_qkv(model: Gemma3ForCausalLM, tokens: Int[Array, "T"], *, layers: str = "global"
                ) -> dict[str, Float[Array, "..."]]:  # (also Gemma3ForCausalLM.capture_qkv)
    """Post-RoPE q [L,H,T,D], k [L,Hkv,T,D], v [L,Hkv,T,D] (f32) of one sequence's dense prefill, for the global
    layers (L = len(config.global_layers), in model order) or, with ``layers="local"``, the sliding-window ones.

    q is as the attention hooks see it: times ``config.query_scale``, so that (q . k) / sqrt(D) is the logit.
    Query head h belongs to KV head h // G, so q.reshape(L, Hkv, G, T, D) lines up with k.
    """
    if layers not in ("global", "local"):
        raise ValueError(f"layers must be 'global' or 'local', got {layers!r}")
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 1 or tokens.shape[0] == 0:
        raise ValueError(f"capture_qkv takes one non-empty sequence [T], got shape {tokens.shape}")
    graphdef, state = nnx.split(model)
    return _capture(graphdef, state, tokens[None], layers)
