"""Flax NNX decoder for Gemma 3 (text), a :class:`~fathom_jax.models.decoder.Decoder`: ``sliding_window_pattern - 1``
sliding-window ("local") layers, then one global layer, repeated; a few local layers may follow the last global one
(the "tail").

Layout choices, and why:
- Parameters are stacked per kind, in the order the loop reads them: ``local_layers`` [n_blocks * (P - 1)],
  ``global_layers`` [n_blocks], ``tail_layers`` [n_tail] (only if n_tail > 0). The forward pass is one
  ``lax.scan`` over the pattern's repeats whose body scans the block's P - 1 local layers (their stacked
  parameters seen as [n_blocks, P - 1], a free reshape) and then runs its global layer; the tail is a second
  scan. Compile time does not grow with depth, and no layer's weights are gathered or copied per step.
- Each kind has its own attention callback (:meth:`Gemma3ForCausalLM.run_layers`): local layers attend over their
  window ring buffers (:class:`~fathom_jax.models.gemma3.windows.Windows`, which the model keeps of its own), global
  layers through an attention object with a cache of its own (``attention.py``: dense, sparse, or q/k/v capture),
  which receives the *global* layer ordinal. Both ride in the scans' carry, so that XLA updates them in place.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from fathom_jax.models.attention import CacheAttention, CacheShape, PromptAttention, layer_runs, scan_runs
from fathom_jax.models.gemma3.config import Gemma3Config
from fathom_jax.models.gemma3.layers import (
    DecoderLayer,
    global_inv_freq,
    local_inv_freq,
)
from fathom_jax.models.gemma3.windows import Gemma3State, Windows
from fathom_jax.models.layers import RMSNorm
from fathom_jax.models.prompt_attention import PREFILL_QUERY_CHUNK


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
        self.norm = RMSNorm(config.hidden, config.rms_norm_eps, dtype=dtype, zero_centred=True)

    # -- the decoder protocol (decoder.py) --------------------------------------------------------------
    # The decode state is the local layers' window rings and the global layers' attention cache (Gemma3State).
    ragged = True  # every sequence at its own position: the rings keep one length per sequence
    capture_query_chunk = PREFILL_QUERY_CHUNK  # q/k/v capture attends by chunks of queries (linear memory in T)

    def cache_shape(self, batch: int, capacity: int) -> CacheShape:
        """The global layers' cache shape (``layers`` = the number of global layers)."""
        cfg = self.config
        return CacheShape(layers=len(cfg.global_layers), batch=batch, kv_heads=cfg.n_kv_heads, capacity=capacity,
                          head_dim=cfg.head_dim, dtype=self.dtype, query_heads=cfg.group_size,
                          layer_ids=tuple(cfg.global_layers), model_layers=cfg.n_layers)

    def init_state(self, attention: PromptAttention, batch: int, capacity: int) -> Gemma3State:
        return Gemma3State(Windows.init(self.config, batch, self.dtype),
                           attention.init_cache(self.cache_shape(batch, capacity)))

    @staticmethod
    def split_state(state: Gemma3State):
        return state.windows, state.cache

    @staticmethod
    def join_state(windows, cache) -> Gemma3State:
        return Gemma3State(windows, cache)

    def forward_prompt(self, attention: PromptAttention, prompt, lengths, state: Gemma3State):
        """The right-padded prompt (``lengths [B]``) in one layer loop: local layers through their windows (padding
        never written), global layers through ``attention.attend_prompt``. Returns (f32 logits at each last prompt
        token [B, V], state)."""
        t = prompt.shape[1]

        def local_attend(i, q, k, v, s):
            o, windows = s.windows.attend(i, q, k, v, lengths)
            return o, (dataclasses.replace(s, windows=windows), None)

        def global_attend(g, q, k, v, s, kind):
            o, cache = attention.attend_prompt(s.cache, g, q, k, v, lengths)
            return o, (dataclasses.replace(s, cache=cache), None)

        x, state, _, _ = self.run_layers(self.embed(prompt), jnp.arange(t, dtype=jnp.int32), local_attend,
                                         global_attend, state, mlp_chunk=attention.mlp_chunk)
        windows = dataclasses.replace(state.windows, length=state.windows.length + lengths)
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return self.logits(self.norm(last)), dataclasses.replace(state, windows=windows)

    def forward_token(self, attention: CacheAttention, tokens, state: Gemma3State):
        """One decode step: ``(f32 logits [B, V], state)``. The global layers call ``attention.attend(cache, g, q,
        key, value, carry)`` inside the layer loop (the cache read-only there; the attention's carry rides beside the
        windows through the local layers) and ``attention.commit`` runs once after it."""
        windows, cache = state.windows, state.cache
        start = windows.length

        def local_attend(i, q, k, v, carry):
            w, shared = carry
            o, w = w.attend(i, q, k, v)
            return o, ((w, shared), None)

        def global_attend(g, q, k, v, carry, kind):
            w, shared = carry
            o, update, shared = attention.attend(cache, g, q[:, :, :, 0], k[:, :, 0], v[:, :, 0], shared, kind=kind)
            return o[:, :, :, None], ((w, shared), update)

        x, (windows, _), _, updates = self.run_layers(
            self.embed(tokens[:, None]), start[:, None], local_attend, global_attend,
            (windows, attention.decode_carry(cache)), runs=layer_runs(attention.layer_kinds, self.config.n_blocks))
        state = Gemma3State(dataclasses.replace(windows, length=start + 1), attention.commit(cache, updates))
        return self.logits(self.norm(x[:, 0])), state

    # -- core ------------------------------------------------------------------------------

    def embed(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T E"]:
        # sqrt(hidden) is rounded to the model dtype first, as transformers does (bf16: sqrt(640) -> 25.25).
        return self.embed_tokens(tokens) * jnp.asarray(np.float32(math.sqrt(self.config.hidden))).astype(self.dtype)

    def run_layers(self, x, positions, local_attend, global_attend, carry, *, mlp_chunk: int | None = None,
                   runs: tuple | None = None):
        """All layers in model order, ``x`` and ``carry`` (e.g. the cache) threaded through; ``mlp_chunk``: tokens
        per chunk of the MLP (None: all at once).

        ``local_attend(i, q, k, v, carry)`` and ``global_attend(g, q, k, v, carry, kind)`` return ``(o, (carry, ys))``
        with q [B,Hkv,G,T,D] (post-RoPE, times ``config.query_scale``), k/v [B,Hkv,T,D] and o [B,Hkv,G,T,D];
        ``i`` / ``g`` are traced int32 ordinals among the local / global layers (model layer
        ``config.local_layers[i]`` / ``config.global_layers[g]``). Returns ``(x, carry, local ys stacked
        [n_local, ...], global ys stacked [n_global, ...])``. ``runs``: ``(start, stop, kind)`` of consecutive
        blocks by their global layer's attention kind (:func:`~fathom_jax.models.attention.layer_runs`), one scan
        each, the kind handed to ``global_attend`` (None: one scan of every block).

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
                    cfg, x, positions, local_freq, lambda q, k, v: local_attend(i, q, k, v, carry), mlp_chunk=mlp_chunk)
                return (x, carry), ys
            return body

        global_at = stacked(self.global_layers)
        # local_layers holds the blocks' local layers back to back: block g's are [g * p1, (g + 1) * p1).
        block_local = local_body(stacked(self.local_layers), 0) if p1 else None

        def block_body_of(kind):
            def block_body(c, g):
                ys_local = None
                if p1:
                    c, ys_local = jax.lax.scan(block_local, c, g * p1 + jnp.arange(p1, dtype=jnp.int32))
                x, carry = c
                x, (carry, ys) = global_at(g)(cfg, x, positions, global_freq,
                                              lambda q, k, v: global_attend(g, q, k, v, carry, kind), mlp_chunk=mlp_chunk)
                return (x, carry), (ys_local, ys)
            return block_body

        # one scan per run of blocks whose global layers are of one attention kind (one run: every block)
        (x, carry), (ys_local, ys_global) = scan_runs(block_body_of, (x, carry), runs or layer_runs(None, nb))
        ys_local = jax.tree.map(lambda a: a.reshape(nb * p1, *a.shape[2:]), ys_local) if p1 else None
        if cfg.n_tail:
            tail = local_body(stacked(self.tail_layers), nb * p1)
            (x, carry), ys_tail = jax.lax.scan(tail, (x, carry), jnp.arange(cfg.n_tail, dtype=jnp.int32))
            ys_local = ys_tail if ys_local is None else jax.tree.map(
                lambda a, b: jnp.concatenate([a, b]), ys_local, ys_tail)
        return x, carry, ys_local, ys_global

    def logits(self, h: Float[Array, "... E"]) -> Float[Array, "... V"]:
        # Not Embed.attend (h @ E.T): XLA:CPU materialises the [vocab, hidden] transpose on every call.
        out = jnp.einsum("...e,ve->...v", h, self.embed_tokens.embedding[...]).astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        return out if cap is None else cap * jnp.tanh(out / cap)
