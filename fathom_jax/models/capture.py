"""q/k/v capture: one sequence's prompt through a decoder's ``forward_prompt`` with an attention that records each
layer's post-RoPE queries, keys and values (:class:`CaptureAttention`), for the studies and calibration.

The capture's attention is exact causal softmax attention in f32 (:func:`causal_attention`), all queries at once or by
chunks of queries (the decoder's ``capture_query_chunk``), and its MLP runs over the whole prompt: the computation the
committed studies were captured with, to the bit (XLA:GPU rounds chunked and whole attention differently).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from fathom_jax.models.attention import CacheShape


def _causal(q, k, v, start):
    """Queries at positions start + [0, T) over keys at slots <= their position."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bhgtd,bhcd->bhgtc", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    q_pos = start + jnp.arange(q.shape[3])
    s = jnp.where(jnp.arange(k.shape[2])[None, :] <= q_pos[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhgtc,bhcd->bhgtd", p, v.astype(jnp.float32))


def causal_attention(q: Float[Array, "B Hkv G T D"], k: Float[Array, "B Hkv T D"], v: Float[Array, "B Hkv T D"],
                     chunk: int | None = None) -> Float[Array, "B Hkv G T D"]:
    """Exact causal attention of a prompt (f32), by chunks of ``chunk`` queries (None: all at once)."""
    t = q.shape[3]
    if chunk is None or t <= chunk:
        return _causal(q, k, v, 0)
    pad = -t % chunk
    qp = jnp.pad(q, ((0, 0),) * 3 + ((0, pad), (0, 0)))

    def one(t0):
        return _causal(jax.lax.dynamic_slice_in_dim(qp, t0, chunk, axis=3), k, v, t0)

    out = jnp.moveaxis(jax.lax.map(one, jnp.arange(0, t + pad, chunk, dtype=jnp.int32)), 0, 3)
    return out.reshape(*out.shape[:3], t + pad, out.shape[-1])[:, :, :, :t]


@dataclasses.dataclass(frozen=True)
class CaptureAttention:
    """The prompt attention of a capture (a :class:`~fathom_jax.models.attention.PromptAttention`): its cache is
    every layer's q ``[L, B, Hkv, G, T, D]`` and k, v ``[L, B, Hkv, T, D]``; ``group_size`` query heads per KV head,
    ``query_chunk`` as :func:`causal_attention`'s ``chunk``."""

    group_size: int
    query_chunk: int | None = None
    mlp_chunk = None

    def init_cache(self, shape: CacheShape) -> dict[str, Array]:
        kv = (shape.layers, shape.batch, shape.kv_heads, shape.capacity, shape.head_dim)
        q = (*kv[:3], self.group_size, *kv[3:])
        return {"q": jnp.zeros(q, shape.dtype), "k": jnp.zeros(kv, shape.dtype), "v": jnp.zeros(kv, shape.dtype)}

    def attend_prompt(self, cache, layer, q, keys, values, lengths):
        def put(name, x):
            at = (layer,) + (0,) * x.ndim
            return jax.lax.dynamic_update_slice(cache[name], x[None].astype(cache[name].dtype), at)

        return causal_attention(q, keys, values, self.query_chunk), {"q": put("q", q), "k": put("k", keys),
                                                                     "v": put("v", values)}


def capture_qkv(model, tokens: Int[Array, "T"], *, attention: CaptureAttention | None = None
                ) -> dict[str, Float[Array, "..."]]:
    """Post-RoPE q [L,H,T,D], k [L,Hkv,T,D], v [L,Hkv,T,D] (f32) of one sequence's prompt, for the layers whose
    attention the decoder hands to its attention object (every layer of a Llama-family model, Gemma 3's global ones,
    in model order).

    q is as attention sees it (Gemma 3's times ``config.query_scale``), so that (q . k) / sqrt(D) is the logit.
    Query head h belongs to KV head h // G, so q.reshape(L, Hkv, G, T, D) lines up with k. ``attention``: the
    capture's (hashable; default ``CaptureAttention(config.group_size, model.capture_query_chunk)``), e.g. one that
    attends otherwise and records the same cache.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 1 or tokens.shape[0] == 0:
        raise ValueError(f"capture_qkv takes one non-empty sequence [T], got shape {tokens.shape}")
    if attention is None:
        attention = CaptureAttention(model.config.group_size, model.capture_query_chunk)
    graphdef, params = nnx.split(model)
    return _capture(graphdef, params, attention, tokens[None])


@functools.partial(jax.jit, static_argnames=("graphdef", "attention"))
def _capture(graphdef, params, attention: CaptureAttention, prompt):
    model = nnx.merge(graphdef, params)
    t = prompt.shape[1]
    _, state = model.forward_prompt(attention, prompt, jnp.full((1,), t, jnp.int32), model.init_state(attention, 1, t))
    got = model.split_state(state)[1]
    q = got["q"][:, 0]  # [L, Hkv, G, T, D] -> [L, H, T, D]
    return {"q": q.reshape(q.shape[0], -1, *q.shape[-2:]).astype(jnp.float32),
            "k": got["k"][:, 0].astype(jnp.float32), "v": got["v"][:, 0].astype(jnp.float32)}
