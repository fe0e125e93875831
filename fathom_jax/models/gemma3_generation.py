"""Greedy generation for Gemma 3 with any cache attention on its global layers (as ``generation.py`` drives the
Llama decoder): the local layers keep their window rings in device memory, the global layers' cache is the
attention's own (:class:`~fathom_jax.models.attention.CacheAttention`: the dense cache by default, or sparse
decoding), sized and indexed over the global layers only (``layer`` = the global ordinal).

    ids = generate(model, prompt, 64)                                                    # dense
    ids = generate(model, prompt, 64, attention_fn=decode.from_spec("fathom:48", k=128))  # sparse global layers

The whole generation is one compiled program (prefill, then a ``fori_loop`` of :func:`greedy_step`), which needs an
attention whose cache can ride in loop carries (``attention.fused``); prompts are equal-length (the windows have
one length for the batch).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from fathom_jax.models.attention import CacheAttention, CacheShape, as_cache_attention
from fathom_jax.models.cache import AttentionFn, dense_attention
from fathom_jax.models.gemma3 import Gemma3ForCausalLM
from fathom_jax.models.gemma3_cache import window_attention
from fathom_jax.models.gemma3_config import Gemma3Config
from fathom_jax.models.generation import decode_compiler_options, first_token
from fathom_jax.models.prefill import prefill_attention


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Windows:
    """The local layers' rings (position p at slot p mod window) and the batch's length."""

    k: Float[Array, "local_layers batch kv_heads window head_dim"]
    v: Float[Array, "local_layers batch kv_heads window head_dim"]
    length: Int[Array, ""]

    @classmethod
    def init(cls, config: Gemma3Config, batch: int, dtype) -> "Windows":
        shape = (len(config.local_layers), batch, config.n_kv_heads, config.sliding_window, config.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))

    def attend(self, i, q, k, v) -> tuple[Array, "Windows"]:
        """Local layer ``i``'s window attention of new tokens at positions length + [0, T); their rows written."""
        o, rk, rv = window_attention(q, k, v, self.k[i], self.v[i], self.length)
        return o, dataclasses.replace(self, k=self.k.at[i].set(rk), v=self.v.at[i].set(rv))


def cache_shape(model: Gemma3ForCausalLM, batch: int, capacity: int) -> CacheShape:
    """The global layers' cache shape (``layers`` = the number of global layers)."""
    cfg = model.config
    return CacheShape(layers=len(cfg.global_layers), batch=batch, kv_heads=cfg.n_kv_heads, capacity=capacity,
                      head_dim=cfg.head_dim, dtype=model.dtype)


def prefill_fn(model: Gemma3ForCausalLM, attention: CacheAttention, prompt: Int[Array, "B T"], capacity: int):
    """The whole prompt in one layer loop: local layers through their windows, global layers causal over the
    prompt (:func:`~fathom_jax.models.prefill.prefill_attention`), their rows handed to
    ``attention.write_prompt``. Returns (f32 logits at the last token [B, V], (windows, global cache))."""
    b, t = prompt.shape
    lengths = jnp.full((b,), t, jnp.int32)

    def local_attend(i, q, k, v, state):
        windows, cache = state
        o, windows = windows.attend(i, q, k, v)
        return o, (windows, cache), None

    def global_attend(g, q, k, v, state):
        windows, cache = state
        return prefill_attention(q, k, v), (windows, attention.write_prompt(cache, g, k, v, lengths)), None

    state = (Windows.init(model.config, b, model.dtype), attention.init_cache(cache_shape(model, b, capacity)))
    x, (windows, cache), _, _ = model.run_layers(model.embed(prompt), jnp.arange(t, dtype=jnp.int32), local_attend,
                                                 global_attend, state)
    windows = dataclasses.replace(windows, length=jnp.int32(t))
    return model.logits(model.norm(x[:, -1])), (windows, attention.start_decode(cache, lengths))


def greedy_step(model: Gemma3ForCausalLM, attention: CacheAttention, tokens: Int[Array, "B"], state):
    """One decode step: ``((next tokens [B], logits [B, V]), state)``. The global layers call
    ``attention.attend(cache, g, q, key, value)`` inside the layer loop (the cache read-only there) and
    ``attention.commit`` once after it, as the Llama decoder's step does."""
    windows, cache = state
    start = windows.length

    def local_attend(i, q, k, v, w):
        o, w = w.attend(i, q, k, v)
        return o, w, None

    def global_attend(g, q, k, v, w):
        o, update = attention.attend(cache, g, q[:, :, :, 0], k[:, :, 0], v[:, :, 0])
        return o[:, :, :, None], w, update

    x, windows, _, updates = model.run_layers(model.embed(tokens[:, None]), start + jnp.arange(1, dtype=jnp.int32),
                                              local_attend, global_attend, windows)
    state = (dataclasses.replace(windows, length=start + 1), attention.commit(cache, updates))
    logits = model.logits(model.norm(x[:, 0]))
    return (first_token(logits), logits), state


def _generate_fn(graphdef, state, attention, prompt, max_new_tokens, capacity):
    model = nnx.merge(graphdef, state)
    logits, carry = prefill_fn(model, attention, prompt, capacity)
    out = jnp.zeros((prompt.shape[0], max_new_tokens), jnp.int32).at[:, 0].set(first_token(logits))

    def body(i, c):
        out, carry = c
        (nxt, _), carry = greedy_step(model, attention, out[:, i - 1], carry)
        return out.at[:, i].set(nxt), carry

    return jax.lax.fori_loop(1, max_new_tokens, body, (out, carry))[0]


@functools.lru_cache(maxsize=None)
def generate_program(options: tuple = ()):
    """The jitted whole generation; ``options``: sorted (key, value) XLA options beyond the decode defaults."""
    return jax.jit(_generate_fn, static_argnames=("graphdef", "max_new_tokens", "capacity"),
                   compiler_options=decode_compiler_options(dict(options)))


def generate(model: Gemma3ForCausalLM, prompt_ids: Int[Array, "B T"] | Int[Array, "T"], max_new_tokens: int, *,
             capacity: int | None = None, attention_fn: CacheAttention | AttentionFn = dense_attention,
             lengths: Int[Array, "B"] | None = None) -> Int[Array, "B N"]:
    """Greedy decoding of ``max_new_tokens`` tokens (no EOS stop), equal-length prompts (``lengths``, if given,
    must all be T). ``attention_fn``: the global layers' attention, a dense-cache :class:`AttentionFn` or any
    fused :class:`CacheAttention`. ``capacity`` (the global layers' cache) defaults to the prompt + new tokens
    (and at least what the attention needs). Returns [B, N] (or [N] for a 1-D prompt) new token ids."""
    prompt = jnp.asarray(prompt_ids, jnp.int32)
    squeeze = prompt.ndim == 1
    prompt = prompt[None] if squeeze else prompt
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be a non-empty [T] or [B, T] array of token ids, got shape {prompt.shape}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    b, t = prompt.shape
    if lengths is not None and np.any(np.asarray(lengths) != t):
        raise ValueError(f"Gemma 3 decodes equal-length prompts (its window rings have one length); got lengths "
                         f"{np.asarray(lengths).tolist()} for prompts of {t} tokens")
    attention = as_cache_attention(attention_fn)
    if capacity is None:
        capacity = max(t + max_new_tokens, attention.min_capacity)
    if t + max_new_tokens > capacity:
        raise ValueError(f"prompt of {t} tokens + {max_new_tokens} new tokens exceeds cache capacity {capacity}")
    attention = attention.bind(cache_shape(model, b, capacity))
    if not attention.fused:
        raise ValueError("Gemma 3 generates in one program, with the global layers' cache in device memory on one "
                         "device; an attention whose cache lives in host memory or on a mesh is not wired in yet")
    graphdef, state = nnx.split(model)
    options = tuple(sorted(dict(getattr(attention, "compiler_options", None) or {}).items()))
    out = generate_program(options)(graphdef, state, attention, prompt, max_new_tokens, capacity)
    return out[0] if squeeze else out
