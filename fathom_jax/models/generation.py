"""Greedy generation with any cache attention (dense, sparse, in HBM or offloaded), and q/k/v capture.

    ids = generate(model, prompt, 64)                                         # dense
    ids = generate(model, prompt, 64, attention_fn=decode.from_spec("fathom:48", k=128))
    ids = generate(model, prompts, 64, lengths=lengths, attention_fn=decode.from_spec(
        "fathom:48", k=512, placement="pinned_host"))                        # offloaded, ragged batch

One step function, :func:`greedy_step`, and its drivers (as gemma's sampler): where the attention's cache can ride
in loop carries (``attention.fused``: device memory, one device) a whole generation is one compiled program (prefill
as a layer scan, then a ``fori_loop`` of steps); elsewhere each prefill layer and each step is a program the
attention makes (:meth:`~fathom_jax.models.attention.CacheAttention.program`, which donates the cache and writes
host memory in place), driven from Python. Sequences of different lengths decode together where the attention
allows it (right-padded prompts and their ``lengths``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from fathom_jax.models.attention import CacheAttention, CacheShape, as_cache_attention
from fathom_jax.models.cache import AttentionFn, KVCache, dense_attention
from fathom_jax.models.llama import LlamaForCausalLM, dense_attend
from fathom_jax.models.prefill import PREFILL_MLP_CHUNK, prefill_attention

# On a GPU the layer scan slices each layer's weights out of the stacked [L, ...] arrays; feeding a Triton GEMM, XLA
# copies every slice first. cuBLAS GEMMs under XLA's dynamic-slice fusion read the slice in place
# (results/decode_step_h200.md). Passed to every program that runs decode steps with the model's weights.
WEIGHT_GEMM_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_dynamic_slice_fusion": True}


def decode_compiler_options(extra=None) -> dict | None:
    """XLA options of a program that runs decode steps with the weights: :data:`WEIGHT_GEMM_OPTIONS` on a GPU, then
    ``extra``; None when empty."""
    options = (dict(WEIGHT_GEMM_OPTIONS) if jax.default_backend() == "gpu" else {}) | dict(extra or {})
    return options or None


# ----------------------------------------------------------------------------------------------
# The pieces: one prefill layer, one greedy step


def prefill_layer(model, attention: CacheAttention, h, lengths, cache, layer):
    """One layer of the prompt: the next hidden states and the cache with this layer's keys and values written."""
    cfg = model.config
    graphdef, layer_state = nnx.split(model.layers)
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[layer], layer_state))

    def attend(q, k, v):
        return prefill_attention(q, k, v), (k, v)

    h, (k, v) = block(cfg, h, jnp.arange(h.shape[1], dtype=jnp.int32), attend, mlp_chunk=PREFILL_MLP_CHUNK)
    return h, attention.write_prompt(cache, layer, k, v, lengths)


def last_logits(model, h, lengths):
    """f32 logits [B, V] at each sequence's last prompt token."""
    last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return model.logits(model.norm(last))


def first_token(logits):
    return jnp.argmax(logits, -1).astype(jnp.int32)


def greedy_step(model, attention: CacheAttention, tokens: Int[Array, "B"], cache):
    """One decode step of every sequence at its own position: ``((next tokens [B], logits [B, V]), cache)``."""
    def attend_layer(layer, q, k, v):
        o, update = attention.attend(cache, layer, q[:, :, :, 0], k[:, :, 0], v[:, :, 0])
        return o[:, :, :, None], update

    positions = attention.positions(cache)[:, None]
    x, updates = model.scan_layers(model.embed_tokens(tokens[:, None]), positions, attend_layer,
                                   unroll=attention.layer_unroll)
    cache = attention.commit(cache, updates)
    logits = model.logits(model.norm(x[:, 0]))
    return (first_token(logits), logits), cache


# ----------------------------------------------------------------------------------------------
# Fused drivers: the whole loop in one program


def _cache_shape(model, batch: int, capacity: int) -> CacheShape:
    cfg = model.config
    return CacheShape(layers=cfg.n_layers, batch=batch, kv_heads=cfg.n_kv_heads, capacity=capacity,
                      head_dim=cfg.head_dim, dtype=model.dtype)


def _greedy_loop(model, attention, out, cache, steps: int):
    def body(i, carry):
        out, cache = carry
        (nxt, _), cache = greedy_step(model, attention, out[:, i - 1], cache)
        return out.at[:, i].set(nxt), cache

    return jax.lax.fori_loop(1, steps, body, (out, cache))


def _generate_fn(graphdef, state, attention, prompt, lengths, max_new_tokens, capacity):
    model = nnx.merge(graphdef, state)
    cache = attention.init_cache(_cache_shape(model, prompt.shape[0], capacity))

    def layer_body(carry, layer):
        h, cache = carry
        return prefill_layer(model, attention, h, lengths, cache, layer), None

    (h, cache), _ = jax.lax.scan(layer_body, (model.embed_tokens(prompt), cache),
                                 jnp.arange(model.config.n_layers, dtype=jnp.int32))
    cache = attention.start_decode(cache, lengths)
    out = jnp.zeros((prompt.shape[0], max_new_tokens), jnp.int32)
    out = out.at[:, 0].set(first_token(last_logits(model, h, lengths)))
    return _greedy_loop(model, attention, out, cache, max_new_tokens)[0]


def _decode_loop_fn(graphdef, state, attention, tokens, cache, steps):
    out = jnp.zeros((tokens.shape[0], steps), jnp.int32).at[:, 0].set(tokens)
    return _greedy_loop(nnx.merge(graphdef, state), attention, out, cache, steps)


def generate_program(options: dict | None = None):
    """The jitted program of a whole generation (prefill, then the greedy loop) for a fused attention; ``options``:
    more XLA options (the attention's; made on first use: the defaults depend on the backend)."""
    return _program(_generate_fn, ("graphdef", "max_new_tokens", "capacity"), (), tuple(sorted((options or {}).items())))


def decode_loop_program(options: dict | None = None):
    """The jitted program of :func:`decode_loop` for a fused attention (the cache donated: the loop updates it in
    place instead of copying all of it first); ``options`` as for :func:`generate_program`."""
    return _program(_decode_loop_fn, ("graphdef", "steps"), ("cache",), tuple(sorted((options or {}).items())))


@functools.lru_cache(maxsize=None)
def _program(fn, static_argnames, donate_argnames, options):
    return jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames,
                   compiler_options=decode_compiler_options(dict(options)))


def _options(attention) -> dict:
    """The XLA options an attention asks of the programs that run its steps (a bound sparse attention's step
    options; none for the dense cache)."""
    return dict(getattr(attention, "compiler_options", None) or {})


# ----------------------------------------------------------------------------------------------
# Streaming drivers: a program per prefill layer and per step


def _prefill_layer_fn(graphdef, attention, state, h, lengths, layer, cache):
    h, cache = prefill_layer(nnx.merge(graphdef, state), attention, h, lengths, cache, layer)
    return h, cache


def _step_fn(graphdef, attention, state, tokens, cache):
    return greedy_step(nnx.merge(graphdef, state), attention, tokens, cache)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _embed(graphdef, state, prompt):
    return nnx.merge(graphdef, state).embed_tokens(prompt)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _last_logits(graphdef, state, h, lengths):
    return last_logits(nnx.merge(graphdef, state), h, lengths)


def prefill(model, prompt, lengths, attention: CacheAttention, capacity: int):
    """Prefill ``prompt [B, T]`` (right-padded; ``lengths [B]``) into a new cache, one program per layer.

    Returns ``(logits at each last prompt token [B, V], cache, attention)``, the attention bound to the cache's
    shape (pass it to :func:`decode_step` / :func:`decode_loop` with the cache).
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    shape = _cache_shape(model, prompt.shape[0], capacity)
    attention = as_cache_attention(attention).bind(shape)
    cache = attention.init_cache(shape)
    graphdef, state = nnx.split(model)
    run = attention.program(_prefill_layer_fn, cache, static=(graphdef,))
    h = _embed(graphdef, state, prompt)
    for layer in range(model.config.n_layers):
        h, cache = run(state, h, lengths, jnp.int32(layer), cache=cache)
    return _last_logits(graphdef, state, h, lengths), attention.start_decode(cache, lengths), attention


def decode_step_program(model, cache, attention: CacheAttention):
    """The compiled decode step for this model and cache layout: ``run(state, tokens, cache=cache) -> ((next tokens,
    logits), cache)`` (``run.lower(state, tokens, cache=cache)`` lowers it without running anything)."""
    graphdef, _ = nnx.split(model)
    return attention.program(_step_fn, cache, static=(graphdef,), options=decode_compiler_options())


def decode_step(model, tokens, cache, attention: CacheAttention):
    """One compiled decode step: ``(next tokens [B], logits [B, V], cache)``; the cache is donated. ``attention``
    is the one :func:`prefill` returned with the cache."""
    _, state = nnx.split(model)
    run = decode_step_program(model, cache, attention)
    (nxt, logits), cache = run(state, jnp.asarray(tokens, jnp.int32), cache=cache)
    return nxt, logits, cache


def decode_loop(model, tokens: Int[Array, "B"], cache, attention: CacheAttention, steps: int):
    """Greedy decoding from a prefilled cache: ``steps`` tokens per sequence, the first being ``tokens``.

    A fused attention: one compiled program (a ``fori_loop`` of :func:`greedy_step`); otherwise one compiled step per
    token. Returns ``(tokens [B, steps], cache)``; the cache passed in is donated either way.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    tokens = jnp.asarray(tokens, jnp.int32)
    if attention.fused:
        graphdef, state = nnx.split(model)
        return decode_loop_program(_options(attention))(graphdef, state, attention, tokens, cache, steps)
    out = [tokens]
    for _ in range(steps - 1):
        tokens, _, cache = decode_step(model, tokens, cache, attention)
        out.append(tokens)
    return jnp.stack(out, axis=1), cache


def generate(
    model: LlamaForCausalLM,
    prompt_ids: Int[Array, "B T"] | Int[Array, "T"],
    max_new_tokens: int,
    *,
    capacity: int | None = None,
    attention_fn: CacheAttention | AttentionFn = dense_attention,
    lengths: Int[Array, "B"] | None = None,
) -> Int[Array, "B N"]:
    """Greedy decoding of `max_new_tokens` tokens (no EOS stop: fixed length, static shapes).

    ``attention_fn``: attention with a cache of its own (a :class:`~fathom_jax.models.attention.CacheAttention`,
    e.g. :class:`fathom_jax.decode.SparseAttention`, which decodes with its own stacked cache in HBM or in host
    memory and takes ``lengths``: right-padded prompts of different lengths), or a dense-cache hook (an
    :class:`AttentionFn`, default :func:`dense_attention`: a plain function is a static jit argument, a callable
    pytree passes its arrays as traced arguments). ``capacity`` defaults to the longest prompt + ``max_new_tokens``
    (and at least what the attention needs, e.g. a sparse hook's k). Returns [B, N] (or [N] for a 1-D prompt) new
    token ids.
    """
    prompt = jnp.asarray(prompt_ids, jnp.int32)
    squeeze = prompt.ndim == 1
    prompt = prompt[None] if squeeze else prompt
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be a non-empty [T] or [B, T] array of token ids, got shape {prompt.shape}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    attention = as_cache_attention(attention_fn)
    b, t = prompt.shape
    lengths = np.full((b,), t) if lengths is None else np.asarray(lengths)
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [batch] = [{b}], got shape {lengths.shape}")
    if np.any(lengths < 1) or np.any(lengths > t):
        raise ValueError(f"lengths must lie in [1, {t}] (the padded prompt length), got {lengths.tolist()}")
    if not attention.ragged and int(lengths.min()) != t:
        raise ValueError("dense-cache decoding takes equal-length prompts; for a ragged batch use a "
                         "SparseAttention (e.g. decode.from_spec('dense', k=...))")
    longest = int(lengths.max())
    if capacity is None:  # a sparse hook selects k rows per head: the cache holds at least k (padding slots are masked)
        capacity = max(longest + max_new_tokens, attention.min_capacity)
    if longest + max_new_tokens > capacity:
        raise ValueError(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds cache capacity {capacity}")
    lengths = jnp.asarray(lengths, jnp.int32)
    attention = attention.bind(_cache_shape(model, b, capacity))
    if attention.fused:
        graphdef, state = nnx.split(model)
        out = generate_program(_options(attention))(graphdef, state, attention, prompt, lengths, max_new_tokens,
                                                    capacity)
    else:
        logits, cache, attention = prefill(model, prompt, lengths, attention, capacity)
        out, _ = decode_loop(model, first_token(logits), cache, attention, max_new_tokens)
    return out[0] if squeeze else out


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _capture(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    cache = KVCache.init(model.config, 1, tokens.shape[1], model.dtype)
    _, _, (q, k, v) = model._forward(tokens, cache, dense_attend, capture=True)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    # q: [L,1,Hkv,G,T,D] -> [L,H,T,D]; k, v: [L,1,Hkv,T,D] -> [L,Hkv,T,D]
    q = q[:, 0].reshape(q.shape[0], -1, q.shape[-2], q.shape[-1])
    return {"q": f32(q), "k": f32(k[:, 0]), "v": f32(v[:, 0])}


def capture_qkv(model: LlamaForCausalLM, tokens: Int[Array, "T"]) -> dict[str, Float[Array, "..."]]:
    """Post-RoPE q [L,H,T,D], k [L,Hkv,T,D], v [L,Hkv,T,D] (f32) of one sequence's dense prefill.

    Query head h belongs to KV head h // G, so q.reshape(L, Hkv, G, T, D) lines up with k.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 1:
        raise ValueError(f"capture_qkv takes one sequence [T], got shape {tokens.shape}")
    graphdef, state = nnx.split(model)
    return _capture(graphdef, state, tokens[None])
