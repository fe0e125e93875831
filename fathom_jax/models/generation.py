"""Greedy generation of any :class:`~fathom_jax.models.decoder.Decoder` with any cache attention (dense, sparse, in
HBM or offloaded).

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
from jaxtyping import Array, Int

from fathom_jax import checks
from fathom_jax.models import guards
from fathom_jax.models.attention import CacheAttention, DenseCache
from fathom_jax.models.decoder import Decoder, LayerwiseDecoder

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
# The step function. A decoder runs a prompt and a token through its layers (``forward_prompt`` / ``forward_token``)
# on a decode state: the attention's cache, with whatever the model keeps of its own between steps.


def first_token(logits):
    return jnp.argmax(logits, -1).astype(jnp.int32)


def greedy_step(model: Decoder, attention: CacheAttention, tokens: Int[Array, "B"], state):
    """One decode step of every sequence at its own position: ``((next tokens [B], logits [B, V]), state)``."""
    logits, state = model.forward_token(attention, tokens, state)
    return (first_token(logits), logits), state


# ----------------------------------------------------------------------------------------------
# Fused drivers: the whole loop in one program


def _greedy_loop(model, attention, out, state, steps: int):
    def body(i, carry):
        out, state = carry
        (nxt, _), state = greedy_step(model, attention, out[:, i - 1], state)
        return out.at[:, i].set(nxt), state

    return jax.lax.fori_loop(1, steps, body, (out, state))


def _start(model, attention, state, lengths):
    own, cache = model.split_state(state)
    return model.join_state(own, attention.start_decode(cache, lengths))


def _generate_fn(graphdef, state, attention, prompt, lengths, max_new_tokens, capacity):
    model = nnx.merge(graphdef, state)
    logits, decode_state = model.forward_prompt(attention, prompt, lengths,
                                                model.init_state(attention, prompt.shape[0], capacity))
    out = jnp.zeros((prompt.shape[0], max_new_tokens), jnp.int32).at[:, 0].set(first_token(logits))
    return _greedy_loop(model, attention, out, _start(model, attention, decode_state, lengths), max_new_tokens)[0]


def _decode_loop_fn(graphdef, state, attention, tokens, cache, steps):
    out = jnp.zeros((tokens.shape[0], steps), jnp.int32).at[:, 0].set(tokens)
    return _greedy_loop(nnx.merge(graphdef, state), attention, out, cache, steps)


def generate_program(options: dict | None = None):
    """The jitted program of a whole generation (prefill, then the greedy loop) for a fused attention; ``options``:
    more XLA options (the attention's; made on first use: the defaults depend on the backend)."""
    return _program(_generate_fn, ("graphdef", "max_new_tokens", "capacity"), (), tuple(sorted((options or {}).items())))


def decode_loop_program(options: dict | None = None):
    """The jitted program of :func:`decode_loop` for a fused attention (the state donated: the loop updates it in
    place instead of copying all of it first); ``options`` as for :func:`generate_program`."""
    return _program(_decode_loop_fn, ("graphdef", "steps"), ("cache",), tuple(sorted((options or {}).items())))


@functools.lru_cache(maxsize=None)
def _program(fn, static_argnames, donate_argnames, options):
    return jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames,
                   compiler_options=decode_compiler_options(dict(options)))


# ----------------------------------------------------------------------------------------------
# Streaming drivers: programs the attention makes over its cache (donated, host memory written in place); what the
# model keeps of its own travels beside it.


def _prompt_layer_fn(graphdef, attention, params, h, lengths, layer, cache):
    return nnx.merge(graphdef, params).prompt_layer(attention, h, lengths, cache, layer)


def _prompt_fn(graphdef, attention, params, prompt, lengths, own, cache):
    model = nnx.merge(graphdef, params)
    logits, state = model.forward_prompt(attention, prompt, lengths, model.join_state(own, cache))
    own, cache = model.split_state(state)
    return (logits, own), cache


def _step_fn(graphdef, attention, params, tokens, own, cache):
    model = nnx.merge(graphdef, params)
    (nxt, logits), state = greedy_step(model, attention, tokens, model.join_state(own, cache))
    own, cache = model.split_state(state)
    return (nxt, logits, own), cache


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _embed(graphdef, params, prompt):
    return nnx.merge(graphdef, params).embed(prompt)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _last_logits(graphdef, params, h, lengths):
    return nnx.merge(graphdef, params).last_logits(h, lengths)


def prefill(model: Decoder, prompt, lengths, attention: CacheAttention, capacity: int):
    """Prefill ``prompt [B, T]`` (right-padded; ``lengths [B]``) into a new decode state: one program per layer where
    the model can (a :class:`~fathom_jax.models.decoder.LayerwiseDecoder`), else one for the prompt.

    Returns ``(logits at each last prompt token [B, V], state, attention)``, the attention bound to its cache's shape
    (pass both to :func:`decode_step` / :func:`decode_loop`). Dense decoding: ``attention=DenseCache()``.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    attention = _cache_attention(attention, "prefill").bind(model.cache_shape(prompt.shape[0], capacity))
    own, cache = model.split_state(model.init_state(attention, prompt.shape[0], capacity))
    graphdef, params = nnx.split(model)
    if isinstance(model, LayerwiseDecoder):
        run = attention.program(_prompt_layer_fn, cache, static=(graphdef,))
        h = _embed(graphdef, params, prompt)
        for layer in range(model.config.n_layers):
            h, cache = run(params, h, lengths, jnp.int32(layer), cache=cache)
        logits = _last_logits(graphdef, params, h, lengths)
    else:
        (logits, own), cache = attention.program(_prompt_fn, cache, static=(graphdef,))(
            params, prompt, lengths, own, cache=cache)
    return logits, model.join_state(own, attention.start_decode(cache, lengths)), attention


def decode_step_program(model: Decoder, cache, attention: CacheAttention):
    """The compiled decode step for this model and cache layout: ``run(params, tokens, own, cache=cache) -> ((next
    tokens, logits, own), cache)`` (``run.lower(...)`` lowers it without running anything)."""
    graphdef, _ = nnx.split(model)
    return attention.program(_step_fn, cache, static=(graphdef,), options=decode_compiler_options())


def decode_step(model: Decoder, tokens, state, attention: CacheAttention):
    """One compiled decode step: ``(next tokens [B], logits [B, V], state)``; the state is donated. ``attention``
    is the one :func:`prefill` returned with the state."""
    _, params = nnx.split(model)
    own, cache = model.split_state(state)
    (nxt, logits, own), cache = decode_step_program(model, cache, attention)(
        params, jnp.asarray(tokens, jnp.int32), own, cache=cache)
    return nxt, logits, model.join_state(own, cache)


def decode_loop(model: Decoder, tokens: Int[Array, "B"], state, attention: CacheAttention, steps: int):
    """Greedy decoding from a prefilled state: ``steps`` tokens per sequence, the first being ``tokens``.

    A fused attention: one compiled program (a ``fori_loop`` of :func:`greedy_step`); otherwise one compiled step per
    token. Returns ``(tokens [B, steps], state)``; the state passed in is donated either way.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    tokens = jnp.asarray(tokens, jnp.int32)
    if attention.fused:
        graphdef, params = nnx.split(model)
        return decode_loop_program(attention.compiler_options)(graphdef, params, attention, tokens, state, steps)
    out = [tokens]
    for _ in range(steps - 1):
        tokens, _, state = decode_step(model, tokens, state, attention)
        out.append(tokens)
    return jnp.stack(out, axis=1), state


@checks.reraise()  # a run-time check that fired reads as the CheckError it is
def generate(
    model: Decoder,
    prompt_ids: Int[Array, "B T"] | Int[Array, "T"],
    max_new_tokens: int,
    *,
    capacity: int | None = None,
    attention_fn: CacheAttention = DenseCache(),
    lengths: Int[Array, "B"] | None = None,
    allow_long_context: bool = False,
    memory_check: bool = True,
) -> Int[Array, "B N"]:
    """Greedy decoding of `max_new_tokens` tokens (no EOS stop: fixed length, static shapes), Llama-family or Gemma 3.

    ``attention_fn``: attention with a cache of its own (a :class:`~fathom_jax.models.attention.CacheAttention`):
    the dense cache (:class:`~fathom_jax.models.attention.DenseCache`, the default, with any dense-cache
    :class:`~fathom_jax.models.cache.AttentionFn`), or e.g. :class:`fathom_jax.decode.SparseAttention`, which decodes
    with its own stacked cache in HBM or in host memory and takes ``lengths``: right-padded prompts of different
    lengths. On Gemma 3 it is the global layers' attention (the local layers keep their window rings in device
    memory). ``capacity`` defaults to the longest prompt + ``max_new_tokens`` (and
    at least what the attention needs, e.g. a sparse hook's k). Returns [B, N] (or [N] for a 1-D prompt) new token
    ids.

    Every argument is checked before any work, by the CLI's rules (:func:`fathom_jax.models.guards.check_generate`):
    ``allow_long_context=True`` runs past the model's ``max_position_embeddings``, ``memory_check=False`` skips the
    memory sizing. A failed check, then or at run time, is a :class:`~fathom_jax.checks.CheckError`.
    """
    attention = _cache_attention(attention_fn, "generate")
    guards.check_generate(model, prompt_ids, max_new_tokens, lengths=lengths, capacity=capacity,
                          allow_long_context=allow_long_context, memory_check=memory_check,
                          offloaded=attention.offloaded)
    prompt = jnp.asarray(prompt_ids, jnp.int32)
    squeeze = prompt.ndim == 1
    prompt = prompt[None] if squeeze else prompt
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be a non-empty [T] or [B, T] array of token ids, got shape {prompt.shape}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    b, t = prompt.shape
    lengths = np.full((b,), t) if lengths is None else np.asarray(lengths)
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [batch] = [{b}], got shape {lengths.shape}")
    if np.any(lengths < 1) or np.any(lengths > t):
        raise ValueError(f"lengths must lie in [1, {t}] (the padded prompt length), got {lengths.tolist()}")
    if int(lengths.min()) != t and not model.ragged:
        raise ValueError(f"{type(model).__name__} decodes equal-length prompts (its window rings have one length); "
                         f"got lengths {lengths.tolist()} for prompts of {t} tokens")
    if int(lengths.min()) != t and not attention.ragged:
        raise ValueError("dense-cache decoding takes equal-length prompts; for a ragged batch use a "
                         "SparseAttention (e.g. decode.from_spec('dense', k=...))")
    longest = int(lengths.max())
    if capacity is None:  # a sparse hook selects k rows per head: the cache holds at least k (padding slots are masked)
        capacity = max(longest + max_new_tokens, attention.min_capacity)
    if longest + max_new_tokens > capacity:
        raise ValueError(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds cache capacity {capacity}")
    lengths = jnp.asarray(lengths, jnp.int32)
    attention = attention.bind(model.cache_shape(b, capacity))
    if attention.fused:
        graphdef, params = nnx.split(model)
        out = generate_program(attention.compiler_options)(graphdef, params, attention, prompt, lengths, max_new_tokens,
                                                    capacity)
    else:
        logits, state, attention = prefill(model, prompt, lengths, attention, capacity)
        out, _ = decode_loop(model, first_token(logits), state, attention, max_new_tokens)
    return jax.block_until_ready(out[0] if squeeze else out)  # inside reraise: a run-time check's error



def _cache_attention(attention, where: str) -> CacheAttention:
    if not isinstance(attention, CacheAttention):
        raise TypeError(f"{where} takes attention with a cache of its own (a CacheAttention, e.g. DenseCache() or a "
                        f"SparseAttention); got {type(attention).__name__}: wrap a dense-cache attention function "
                        f"as DenseCache(fn)")
    return attention
