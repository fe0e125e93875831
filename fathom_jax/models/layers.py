"""The Llama-family layers: RMSNorm, rotary embeddings, attention projections, SwiGLU MLP.

Qwen2 and Qwen3 are Llama with flags (q/k/v bias, per-head q/k RMSNorm), read from the config.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from fathom_jax.models.config import LlamaConfig


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Per-pair inverse frequencies [D/2] (float32), with Llama-3 / linear scaling applied."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    sc = config.rope_scaling
    if sc is None:
        return inv.astype(np.float32)
    if sc.rope_type == "linear":
        return (inv / sc.factor).astype(np.float32)
    # "llama3": long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old = sc.original_max_position_embeddings
    low_wavelen, high_wavelen = old / sc.low_freq_factor, old / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    blended = (1 - smooth) * scaled / sc.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x: Float[Array, "B T H D"], positions: Int[Array, "*B T"], inv_freq) -> Float[Array, "B T H D"]:
    """Rotate-half RoPE (HF convention: pairs are (i, i + D/2), not interleaved).

    ``positions`` is ``[T]`` (shared by the batch) or ``[B, T]`` (one position per sequence and token).
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [*B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [*B, T, 1, D]
    if emb.ndim == 3:
        emb = emb[None]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, normalised in f32 whatever the model dtype (as HF does).

    Llama's scales the normalised input, cast back first, by ``w``; ``zero_centred`` (Gemma's) stores ``w`` centred
    on zero and scales by ``1 + w`` in f32, before the cast back.
    """

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, zero_centred: bool = False):
        self.weight = nnx.Param((jnp.zeros if zero_centred else jnp.ones)((dim,), dtype))
        self.eps = eps
        self.zero_centred = zero_centred

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.zero_centred:
            return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * y.astype(x.dtype)


def linear(i, o, bias, dtype, rngs):
    return nnx.Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden, cfg.head_dim
        self.q_proj = linear(h, cfg.n_heads * d, cfg.attention_bias, dtype, rngs)
        self.k_proj = linear(h, cfg.n_kv_heads * d, cfg.attention_bias, dtype, rngs)
        self.v_proj = linear(h, cfg.n_kv_heads * d, cfg.attention_bias, dtype, rngs)
        self.o_proj = linear(cfg.n_heads * d, h, cfg.o_proj_bias, dtype, rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)

    def qkv(self, cfg: LlamaConfig, x: Float[Array, "B T E"], positions: Int[Array, "*B T"]):
        """Post-RoPE q [B,Hkv,G,T,D], k and v [B,Hkv,T,D]."""
        b, t, _ = x.shape
        d, hkv = cfg.head_dim, cfg.n_kv_heads
        q = self.q_proj(x).reshape(b, t, cfg.n_heads, d)
        k = self.k_proj(x).reshape(b, t, hkv, d)
        v = self.v_proj(x).reshape(b, t, hkv, d)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inv_freq(cfg)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        q = q.reshape(b, t, hkv, cfg.group_size, d).transpose(0, 2, 3, 1, 4)
        return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def project_out(self, cfg: LlamaConfig, o: Float[Array, "B Hkv G T D"], dtype) -> Float[Array, "B T E"]:
        b, _, _, t, _ = o.shape
        o = o.astype(dtype).transpose(0, 3, 1, 2, 4).reshape(b, t, cfg.n_heads * cfg.head_dim)
        return self.o_proj(o)


class MLP(nnx.Module):
    """The gated MLP: ``down(activation(gate(x)) * up(x))``; SwiGLU with the default activation."""

    def __init__(self, cfg, *, dtype, rngs: nnx.Rngs, activation=jax.nn.silu):
        self.gate_proj = linear(cfg.hidden, cfg.intermediate, False, dtype, rngs)
        self.up_proj = linear(cfg.hidden, cfg.intermediate, False, dtype, rngs)
        self.down_proj = linear(cfg.intermediate, cfg.hidden, False, dtype, rngs)
        self.activation = activation

    def __call__(self, x):
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, cfg: LlamaConfig, x, positions, attend, *, mlp_chunk: int | None = None):
        """One pre-norm block: ``attend(q, k, v) -> (o [B,Hkv,G,T,D], aux)``; returns (x, aux).

        ``mlp_chunk`` runs the MLP over chunks of that many tokens (long prefills: bounds the
        ``[T, intermediate]`` activations).
        """
        q, k, v = self.self_attn.qkv(cfg, self.input_layernorm(x), positions)
        o, aux = attend(q, k, v)
        x = x + self.self_attn.project_out(cfg, o, x.dtype)
        return x + chunked(lambda y: self.mlp(self.post_attention_layernorm(y)), x, mlp_chunk), aux


def chunked(fn, x: Float[Array, "B T E"], chunk: int | None):
    """``fn(x)`` for a token-wise ``fn``, computed over chunks of ``chunk`` tokens (all at once if None)."""
    t = x.shape[1]
    if chunk is None or chunk >= t:
        return fn(x)
    pad = -t % chunk
    xs = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(x.shape[0], (t + pad) // chunk, chunk, x.shape[-1])
    ys = jax.lax.map(fn, xs.swapaxes(0, 1))  # [n_chunks, B, chunk, E']
    return ys.swapaxes(0, 1).reshape(x.shape[0], t + pad, -1)[:, :t]
