"""Flax NNX decoder for the Llama family (Llama 2/3.x, SmolLM2, Qwen2, Qwen3): a
:class:`~fathom_jax.models.decoder.LayerwiseDecoder`.

Layout choices, and why:
- Layers are built with `nnx.vmap`, so every layer parameter carries a leading [n_layers] axis and
  the forward pass is one `lax.scan` over layers (:meth:`LlamaForCausalLM.run_layers`; a decode step one per run of
  layers of one attention kind, where the attention names kinds): compile time does not grow with depth, and the
  layer index reaches the attention as a traced int.
- Attention is an attention object with a cache of its own (`attention.py`): the dense cache, sparse decoding
  in HBM or host memory, or q/k/v capture. Its cache, holding *post-RoPE* keys, is the whole decode state, and
  rides in the scan carry so that XLA updates it in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from fathom_jax.models.attention import CacheAttention, CacheShape, PromptAttention, layer_runs, scan_runs
from fathom_jax.models.config import LlamaConfig
from fathom_jax.models.layers import DecoderLayer, RMSNorm, linear


class LlamaForCausalLM(nnx.Module):
    """Decoder-only LM. Parameters of `layers` are stacked on a leading [n_layers] axis."""

    ragged = True  # sequences of different lengths decode together where the attention allows it
    capture_query_chunk = None  # q/k/v capture attends with all queries at once

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
            self.lm_head = linear(config.hidden, config.vocab, False, dtype, rngs)

    # -- the decoder protocol (decoder.py); the decode state is the attention's cache itself ------------

    def cache_shape(self, batch: int, capacity: int) -> CacheShape:
        cfg = self.config
        return CacheShape(layers=cfg.n_layers, batch=batch, kv_heads=cfg.n_kv_heads, capacity=capacity,
                          head_dim=cfg.head_dim, dtype=self.dtype, query_heads=cfg.group_size)

    def init_state(self, attention: PromptAttention, batch: int, capacity: int):
        return attention.init_cache(self.cache_shape(batch, capacity))

    @staticmethod
    def split_state(state):
        return None, state

    @staticmethod
    def join_state(own, cache):
        return cache

    def forward_prompt(self, attention: PromptAttention, prompt, lengths, state):
        def attend(layer, q, k, v, cache, kind):
            o, cache = attention.attend_prompt(cache, layer, q, k, v, lengths)
            return o, (cache, None)

        positions = jnp.arange(prompt.shape[1], dtype=jnp.int32)
        x, cache, _ = self.run_layers(self.embed(prompt), positions, attend, state, mlp_chunk=attention.mlp_chunk)
        return self.last_logits(x, lengths), cache

    def forward_token(self, attention: CacheAttention, tokens, state):
        def attend(layer, q, k, v, carry, kind):
            o, update, carry = attention.attend(state, layer, q[:, :, :, 0], k[:, :, 0], v[:, :, 0], carry, kind=kind)
            return o[:, :, :, None], (carry, update)

        positions = attention.positions(state)[:, None]
        x, _, updates = self.run_layers(self.embed(tokens[:, None]), positions, attend,
                                        attention.decode_carry(state), unroll=attention.layer_unroll,
                                        runs=layer_runs(attention.layer_kinds, self.config.n_layers))
        return self.logits(self.norm(x[:, 0])), attention.commit(state, updates)

    def embed(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T E"]:
        return self.embed_tokens(tokens)

    def prompt_layer(self, attention: PromptAttention, h, lengths, cache, layer):
        graphdef, layer_state = nnx.split(self.layers)
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], layer_state))

        def attend(q, k, v):
            return attention.attend_prompt(cache, layer, q, k, v, lengths)

        return block(self.config, h, jnp.arange(h.shape[1], dtype=jnp.int32), attend, mlp_chunk=attention.mlp_chunk)

    def last_logits(self, h, lengths):
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return self.logits(self.norm(last))

    # -- core ----------------------------------------------------------------------------------------------

    def run_layers(self, x, positions, attend, carry, *, unroll: int = 1, mlp_chunk: int | None = None,
                   runs: tuple | None = None):
        """``lax.scan`` of the decoder layers (``unroll`` layers per loop iteration), ``x`` and ``carry`` (e.g. the
        cache) threaded through.

        ``attend(layer, q, k, v, carry, kind) -> (o, (carry, ys))`` with q [B,Hkv,G,T,D], k/v [B,Hkv,T,D] (post-RoPE),
        ``layer`` a traced int32 and ``kind`` its run's (static); returns ``(x, carry, ys stacked on [n_layers])``.
        ``runs``: ``(start, stop, kind)`` of consecutive layers (:func:`~fathom_jax.models.attention.layer_runs`),
        one scan each (None: one of every layer). ``mlp_chunk``: tokens per chunk of the MLP (None: all at once).

        One run scans the stacked parameters as ``xs``: XLA on a GPU reads each layer's weights in place (closed over
        and indexed instead, the compiled per-layer step copied two weight slices a layer). Several runs close over
        them and index them by layer: a run's scan over a static slice of them would copy the whole run every step.
        """
        cfg = self.config
        graphdef, layer_state = nnx.split(self.layers)

        def layer_step(c, idx, state, kind):
            x, carry = c
            x, (carry, ys) = nnx.merge(graphdef, state)(
                cfg, x, positions, lambda q, k, v: attend(idx, q, k, v, carry, kind), mlp_chunk=mlp_chunk)
            return (x, carry), ys

        runs = runs or layer_runs(None, cfg.n_layers)
        if len(runs) == 1:
            (_, _, kind), = runs
            (x, carry), ys = jax.lax.scan(lambda c, s: layer_step(c, s[1], s[0], kind), (x, carry),
                                          (layer_state, jnp.arange(cfg.n_layers, dtype=jnp.int32)), unroll=unroll)
            return x, carry, ys

        def body_of(kind):
            return lambda c, idx: layer_step(
                c, idx, jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, idx, 0, False), layer_state), kind)

        (x, carry), ys = scan_runs(body_of, (x, carry), runs, unroll=unroll)
        return x, carry, ys

    def logits(self, h: Float[Array, "... E"]) -> Float[Array, "... V"]:
        out = self.embed_tokens.attend(h) if self.config.tie_word_embeddings else self.lm_head(h)
        return out.astype(jnp.float32)

