"""Prefill attention over a whole prompt: cuDNN's fused flash attention on the GPU, XLA over chunks of queries elsewhere.

Both are exact causal GQA attention with linear memory in the prompt length; the decoder's prefill
(``generation.py``) runs one layer at a time with them and hands each layer's keys and values to its attention's
cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PREFILL_MLP_CHUNK = 4096  # tokens per MLP chunk in prefill
PREFILL_QUERY_CHUNK = 1024  # queries per chunk of the XLA prefill attention


def chunked_causal_attention(query, key, value, chunk: int = PREFILL_QUERY_CHUNK):
    """Causal GQA attention ``[B, T, N, D]`` x ``[B, T, K, D]``, one chunk of queries at a time (f32 softmax):
    memory ``B N chunk T`` instead of ``B N T T``."""
    b, t, n, d = query.shape
    kh = key.shape[2]
    pad = -t % chunk
    q = jnp.pad(query, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, (t + pad) // chunk, chunk, kh, n // kh, d)
    keys, values = key.astype(jnp.float32), value.astype(jnp.float32)
    scale = 1.0 / np.sqrt(d)

    def one(args):
        qc, start = args  # [B, chunk, K, G, D]
        logits = jnp.einsum("bckgd,btkd->bkgct", qc.astype(jnp.float32), keys) * scale
        causal = jnp.arange(t)[None, :] <= (start + jnp.arange(chunk))[:, None]
        weights = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
        return jnp.einsum("bkgct,btkd->bckgd", weights, values)

    starts = jnp.arange(0, t + pad, chunk, dtype=jnp.int32)
    out = jax.lax.map(one, (jnp.moveaxis(q, 1, 0), starts))  # [chunks, B, chunk, K, G, D]
    return jnp.moveaxis(out, 0, 1).reshape(b, t + pad, n, d)[:, :t].astype(query.dtype)


def prefill_attention(q, k, v):
    """Causal attention over the whole prompt: q [B,Hkv,G,T,D], k/v [B,Hkv,T,D] -> [B,Hkv,G,T,D].

    cuDNN's fused flash attention on the GPU for bf16/f16 (linear memory in T); elsewhere, or where cuDNN
    refuses the shapes, XLA over chunks of queries.
    """
    b, hkv, g, t, d = q.shape
    query = q.reshape(b, hkv * g, t, d).transpose(0, 2, 1, 3)  # [B, T, N, D], head n = kv * G + g
    key, value = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    o = None
    if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        try:
            o = jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation="cudnn")
        except Exception:  # noqa: BLE001 - unsupported shapes or cuDNN version: the chunked path is exact too
            o = None
    if o is None:
        o = chunked_causal_attention(query, key, value)
    return o.transpose(0, 2, 1, 3).reshape(b, hkv, g, t, d)
