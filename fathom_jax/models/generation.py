"""Greedy generation (dense or sparse, HBM or offloaded) and q/k/v capture.

    ids = generate(model, prompt, 64)                                         # dense
    ids = generate(model, prompt, 64, attention_fn=decode.from_spec("fathom:48", k=128))
    ids = generate(model, prompts, 64, lengths=lengths, attention_fn=decode.from_spec(
        "fathom:48", k=512, placement="pinned_host"))                        # offloaded, ragged batch
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from fathom_jax import checks
from fathom_jax.decode import SparseAttention
from fathom_jax.models import guards, sparse
from fathom_jax.models.cache import AttentionFn, KVCache, dense_attention
from fathom_jax.models.llama import LlamaForCausalLM, dense_attend, join_attention, split_attention


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "capacity", "attn_static"))
def _generate(graphdef, state, prompt, max_new_tokens: int, capacity: int, attn_static, attn_leaves):
    model = nnx.merge(graphdef, state)
    attention_fn = join_attention(attn_static, attn_leaves)
    b = prompt.shape[0]
    cache = KVCache.init(model.config, b, capacity, model.dtype)
    logits, cache = model.prefill(prompt, cache, last_only=True)
    out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(jnp.argmax(logits, -1).astype(jnp.int32))

    def body(i, carry):
        out, cache = carry
        logits, cache = model.decode_step(out[:, i - 1], cache, attention_fn=attention_fn)
        return out.at[:, i].set(jnp.argmax(logits, -1).astype(jnp.int32)), cache

    out, _ = jax.lax.fori_loop(1, max_new_tokens, body, (out, cache))
    return out


@checks.reraise()  # a run-time check that fired reads as the CheckError it is
def generate(
    model: LlamaForCausalLM,
    prompt_ids: Int[Array, "B T"] | Int[Array, "T"],
    max_new_tokens: int,
    *,
    capacity: int | None = None,
    attention_fn: AttentionFn | SparseAttention = dense_attention,
    lengths: Int[Array, "B"] | None = None,
    allow_long_context: bool = False,
    memory_check: bool = True,
) -> Int[Array, "B N"]:
    """Greedy decoding of `max_new_tokens` tokens (no EOS stop: fixed length, static shapes).

    ``attention_fn``: a dense-cache hook (default :func:`dense_attention`; a plain function is a static
    jit argument, a callable pytree passes its arrays as traced arguments), or a
    :class:`~fathom_jax.decode.SparseAttention`, which decodes with its own stacked cache in HBM or in
    host memory (its ``placement``) and takes ``lengths`` (right-padded prompts of different lengths).
    ``capacity`` defaults to the longest prompt + ``max_new_tokens`` (and at least the hook's k).
    Returns [B, N] (or [N] for a 1-D prompt) new token ids.

    Every argument is checked before any work, by the CLI's rules (:func:`fathom_jax.models.guards.check_generate`):
    ``allow_long_context=True`` runs past the model's ``max_position_embeddings``, ``memory_check=False`` skips the
    memory sizing. A failed check, then or at run time, is a :class:`~fathom_jax.checks.CheckError`.
    """
    guards.check_generate(model, prompt_ids, max_new_tokens, lengths=lengths, capacity=capacity,
                          allow_long_context=allow_long_context, memory_check=memory_check,
                          offloaded=getattr(getattr(attention_fn, "placement", None), "memory", None) == "pinned_host")
    prompt = jnp.asarray(prompt_ids, jnp.int32)
    squeeze = prompt.ndim == 1
    prompt = prompt[None] if squeeze else prompt
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be a non-empty [T] or [B, T] array of token ids, got shape {prompt.shape}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if lengths is None:
        lengths = jnp.full((prompt.shape[0],), prompt.shape[1], jnp.int32)
    longest = int(jnp.max(jnp.asarray(lengths)))
    if capacity is None:  # a sparse hook selects k rows per head: the cache holds at least k (padding slots are masked)
        capacity = longest + max_new_tokens
        if isinstance(attention_fn, SparseAttention):
            capacity = max(capacity, attention_fn.k)
    if longest + max_new_tokens > capacity:
        raise ValueError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds cache capacity {capacity}"
        )
    if isinstance(attention_fn, SparseAttention):
        out = sparse.generate(model, prompt, lengths, max_new_tokens, capacity=capacity, attn=attention_fn)
    else:
        if int(jnp.min(jnp.asarray(lengths))) != prompt.shape[1]:
            raise ValueError("dense-cache decoding takes equal-length prompts; for a ragged batch use a "
                             "SparseAttention (e.g. decode.from_spec('dense', k=...))")
        graphdef, state = nnx.split(model)
        out = _generate(graphdef, state, prompt, max_new_tokens, capacity, *split_attention(attention_fn))
    return jax.block_until_ready(out[0] if squeeze else out)  # inside reraise: a run-time check's error


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
