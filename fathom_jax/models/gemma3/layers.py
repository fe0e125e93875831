"""Gemma 3's layers, as transformers' ``modeling_gemma3`` defines them: zero-centred RMSNorm (scale 1 + w),
attention with q/k RMSNorm before RoPE, a gated MLP with tanh-approximated GELU, and a block with norms
before and after both attention and MLP. RMSNorm, RoPE, the MLP and token chunking are the Llama family's
(``layers.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from fathom_jax.models import layers
from fathom_jax.models.config import RopeScaling
from fathom_jax.models.gemma3.config import Gemma3Config
from fathom_jax.models.layers import MLP, RMSNorm, apply_rope, chunked, linear


def rope_inv_freq(theta: float, head_dim: int, scaling: RopeScaling | None = None) -> np.ndarray:
    """Per-pair inverse frequencies [D/2] (float32), as transformers computes them ("linear" divides by factor)."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    if scaling is not None:
        inv = inv / scaling.factor
    return inv.astype(np.float32)


def local_inv_freq(cfg: Gemma3Config) -> np.ndarray:
    return rope_inv_freq(cfg.rope_local_theta, cfg.head_dim)


def global_inv_freq(cfg: Gemma3Config) -> np.ndarray:
    return rope_inv_freq(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling)


class Attention(layers.Attention):
    def __init__(self, cfg: Gemma3Config, *, dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden, cfg.head_dim
        self.q_proj = linear(h, cfg.n_heads * d, False, dtype, rngs)
        self.k_proj = linear(h, cfg.n_kv_heads * d, False, dtype, rngs)
        self.v_proj = linear(h, cfg.n_kv_heads * d, False, dtype, rngs)
        self.o_proj = linear(cfg.n_heads * d, h, False, dtype, rngs)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, zero_centred=True)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, zero_centred=True)

    def qkv(self, cfg: Gemma3Config, x: Float[Array, "B T E"], positions: Int[Array, "*B T"], inv_freq):
        """Post-RoPE q [B,Hkv,G,T,D] (times ``cfg.query_scale``), k and v [B,Hkv,T,D]."""
        b, t, _ = x.shape
        d, hkv = cfg.head_dim, cfg.n_kv_heads
        q = self.q_norm(self.q_proj(x).reshape(b, t, cfg.n_heads, d))
        k = self.k_norm(self.k_proj(x).reshape(b, t, hkv, d))
        v = self.v_proj(x).reshape(b, t, hkv, d)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        if cfg.query_scale != 1.0:  # the hooks scale logits by 1/sqrt(D); Gemma by query_pre_attn_scalar ** -0.5
            q = q * jnp.asarray(cfg.query_scale, q.dtype)
        q = q.reshape(b, t, hkv, cfg.group_size, d).transpose(0, 2, 3, 1, 4)
        return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def gelu_tanh(x):
    """transformers' "gelu_pytorch_tanh": GELU's tanh approximation."""
    return jax.nn.gelu(x, approximate=True)


class DecoderLayer(nnx.Module):
    """One Gemma 3 block; local and global layers have the same weights, and differ in RoPE base and attention."""

    def __init__(self, cfg: Gemma3Config, *, dtype, rngs: nnx.Rngs):
        norm = functools.partial(RMSNorm, cfg.hidden, cfg.rms_norm_eps, dtype=dtype, zero_centred=True)
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs, activation=gelu_tanh)
        self.post_feedforward_layernorm = norm()

    def __call__(self, cfg: Gemma3Config, x, positions, inv_freq, attend, *, mlp_chunk: int | None = None):
        """``attend(q, k, v) -> (o [B,Hkv,G,T,D], aux)``; returns (x, aux). ``mlp_chunk``: as in ``layers.py``."""
        q, k, v = self.self_attn.qkv(cfg, self.input_layernorm(x), positions, inv_freq)
        o, aux = attend(q, k, v)
        x = x + self.post_attention_layernorm(self.self_attn.project_out(cfg, o, x.dtype))

        def mlp(y):
            return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(y)))

        return x + chunked(mlp, x, mlp_chunk), aux
