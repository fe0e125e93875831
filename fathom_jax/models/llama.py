"""Flax NNX decoder for the Llama family (Llama 2/3.x, SmolLM2, Qwen2, Qwen3).

Layout choices, and why:
- Layers are built with `nnx.vmap`, so every layer parameter carries a leading [n_layers] axis and
  the forward pass is one `lax.scan` over layers: compile time does not grow with depth, and the
  layer index reaches the attention hook as a traced int (sparse attention indexes per-layer
  calibration tables with it).
- The KV cache is an explicit pytree (`KVCache`) holding *post-RoPE* keys, because Fathom's
  scorers rank keys exactly as attention sees them. It is threaded through the layers as part of
  the scan carry so that XLA updates it in place.
- `prefill` (many tokens, dense causal attention) and `decode_step` (one token, pluggable
  `attention_fn`) are separate entry points; `generate` jit-compiles a greedy loop around them.
- Decode-time attention may carry per-layer state (a sparse index appended every step): the cache's
  optional `aux` pytree has a leading [n_layers] axis and rides in the layer-scan carry next to k/v,
  so each layer reads and writes its own slice in place (see `StatefulAttentionFn`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from fathom_jax.models.config import LlamaConfig

# ---------------------------------------------------------------------------------------------
# KV cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Post-RoPE keys and values of every layer; slots [0, length) are valid for all sequences.

    One shared `length` (not per sequence): batches are equal-length, which keeps every shape and
    mask static-size.

    `aux` is the decode-time state of a stateful attention function (None for plain attention):
    any pytree whose leaves have a leading [n_layers] axis; layer i reads and writes `aux[i]`.
    Set it after prefill with `init_attention_state(cache, attention_fn)`.
    """

    k: Float[Array, "layers batch kv_heads capacity head_dim"]
    v: Float[Array, "layers batch kv_heads capacity head_dim"]
    length: Int[Array, ""]
    aux: Any = None

    @classmethod
    def init(cls, config: LlamaConfig, batch: int, capacity: int, dtype=jnp.float32) -> "KVCache":
        shape = (config.n_layers, batch, config.n_kv_heads, capacity, config.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.k.shape[3]


# ---------------------------------------------------------------------------------------------
# Attention hook


class AttentionFn(Protocol):
    """Decode-time attention for one layer (the hook sparse attention plugs into).

    Args:
      q: [B, Hkv, G, D] post-RoPE queries of the new token; query head h = kv_head * G + g
         (HF's `repeat_kv` order).
      k, v: [B, Hkv, C, D] this layer's cache (C = capacity), already holding the new token's
         key/value at slot length - 1.
      length: int32 scalar, number of valid slots (keys [0, length) may be attended).
      layer: int32 scalar, the layer index (traced: the decoder scans over layers).
    Returns:
      [B, Hkv, G, D] attention output (any float dtype; cast to the model dtype by the caller).

    Either a plain function (a static jit argument: reuse the same object to avoid recompiling;
    arrays it closes over are baked in as constants), or a callable pytree, e.g. a frozen
    dataclass registered with `jax.tree_util.register_dataclass` whose array fields (calibration
    statistics, budgets as arrays) are traced: new values of the same shapes do not recompile.
    Runs inside `lax.scan` over layers, so index per-layer tables with `layer`.
    """

    def __call__(
        self,
        q: Float[Array, "B Hkv G D"],
        k: Float[Array, "B Hkv C D"],
        v: Float[Array, "B Hkv C D"],
        length: Int[Array, ""],
        layer: Int[Array, ""],
    ) -> Float[Array, "B Hkv G D"]: ...


class StatefulAttentionFn(Protocol):
    """Decode-time attention that carries per-layer state through decoding (e.g. a sparse index
    appended with every new key).

    `init_state(cache)` builds the state from a prefilled cache: a pytree whose leaves all have a
    leading [n_layers] axis (it is stored as `cache.aux`). It runs under jit (static shapes, traced
    length). `__call__` gets the `AttentionFn` arguments plus this layer's slice of the state (the
    leading axis removed) and returns (output, new slice), the new slice with the same structure,
    shapes and dtypes. At decode step t the cache slot length - 1 holds the new key/value and the
    state was built from / appended with slots [0, length - 1): the state is kept in step with the
    cache, so decode only at position = cache.length (no rewinding).

    Detected by the presence of an `init_state` method; plain or pytree, as for `AttentionFn`.
    """

    def init_state(self, cache: "KVCache") -> Any: ...

    def __call__(self, q, k, v, length, layer, state) -> tuple[Float[Array, "B Hkv G D"], Any]: ...


def is_stateful(attention_fn) -> bool:
    """Whether `attention_fn` is a `StatefulAttentionFn` (has an `init_state` method)."""
    return callable(getattr(attention_fn, "init_state", None))


def dense_attention(q, k, v, length, layer):
    """Exact softmax attention over cache slots [0, length); the reference `AttentionFn`."""
    del layer
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bhgd,bhcd->bhgc", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    s = jnp.where(jnp.arange(k.shape[2]) < length, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhgc,bhcd->bhgd", p, v.astype(jnp.float32))


def _causal_attention(q, k, v, start):
    """Prefill attention: q [B,Hkv,G,T,D] at positions start..start+T-1 over cache k/v [B,Hkv,C,D]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bhgtd,bhcd->bhgtc", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    q_pos = start + jnp.arange(q.shape[3])
    s = jnp.where(jnp.arange(k.shape[2])[None, :] <= q_pos[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhgtc,bhcd->bhgtd", p, v.astype(jnp.float32))


# ---------------------------------------------------------------------------------------------
# RoPE


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


def apply_rope(x: Float[Array, "B T H D"], positions: Int[Array, "T"], inv_freq) -> Float[Array, "B T H D"]:
    """Rotate-half RoPE (HF convention: pairs are (i, i + D/2), not interleaved)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


# ---------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        # Normalise in f32 whatever the model dtype (as HF does), then scale in the input dtype.
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


def _linear(i, o, bias, dtype, rngs):
    return nnx.Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden, cfg.head_dim
        self.q_proj = _linear(h, cfg.n_heads * d, cfg.attention_bias, dtype, rngs)
        self.k_proj = _linear(h, cfg.n_kv_heads * d, cfg.attention_bias, dtype, rngs)
        self.v_proj = _linear(h, cfg.n_kv_heads * d, cfg.attention_bias, dtype, rngs)
        self.o_proj = _linear(cfg.n_heads * d, h, cfg.o_proj_bias, dtype, rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)

    def qkv(self, cfg: LlamaConfig, x: Float[Array, "B T E"], positions: Int[Array, "T"]):
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


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg.hidden, cfg.intermediate, False, dtype, rngs)
        self.up_proj = _linear(cfg.hidden, cfg.intermediate, False, dtype, rngs)
        self.down_proj = _linear(cfg.intermediate, cfg.hidden, False, dtype, rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)


# attend(q [B,Hkv,G,T,D], k_layer, v_layer, start, layer) -> [B,Hkv,G,T,D]
_Attend = Callable[..., jax.Array]


class LlamaForCausalLM(nnx.Module):
    """Decoder-only LM. Parameters of `layers` are stacked on a leading [n_layers] axis."""

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
            self.lm_head = _linear(config.hidden, config.vocab, False, dtype, rngs)

    # -- core ------------------------------------------------------------------------------

    def _forward(
        self, tokens: Int[Array, "B T"], cache: KVCache, attend: _Attend, capture: bool, stateful: bool = False
    ):
        """Runs all layers on tokens at positions cache.length + [0, T); returns final hidden,
        the updated cache, and (if capture) per-layer post-RoPE q/k/v.

        With `stateful`, `attend(q, k, v, start, layer, aux_layer)` returns (out, new aux_layer) and
        layer i's slice of `cache.aux` is read and written back in the scan carry; otherwise `aux`
        passes through untouched."""
        cfg = self.config
        b, t = tokens.shape
        start = cache.length
        positions = start + jnp.arange(t, dtype=jnp.int32)
        x = self.embed_tokens(tokens)
        graphdef, layer_state = nnx.split(self.layers)

        def body(carry, xs):
            x, k_all, v_all, aux = carry
            state, idx = xs
            layer = nnx.merge(graphdef, state)
            q, k, v = layer.self_attn.qkv(cfg, layer.input_layernorm(x), positions)
            # Write this chunk's post-RoPE keys/values into the cache, then attend over the cache.
            at = (idx, 0, 0, start, 0)
            k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), at)
            v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), at)
            if stateful:
                aux_layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, idx, 0, keepdims=False), aux)
                o, new_layer = attend(q, k_all[idx], v_all[idx], start, idx, aux_layer)
                _check_same_structure(aux_layer, new_layer)
                aux = jax.tree.map(lambda a, u: jax.lax.dynamic_update_index_in_dim(a, u, idx, 0), aux, new_layer)
            else:
                o = attend(q, k_all[idx], v_all[idx], start, idx)
            o = o.astype(x.dtype)  # [B,Hkv,G,T,D]
            o = o.transpose(0, 3, 1, 2, 4).reshape(b, t, cfg.n_heads * cfg.head_dim)
            x = x + layer.self_attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            ys = (q, k, v) if capture else None
            return (x, k_all, v_all, aux), ys

        (x, k_all, v_all, aux), ys = jax.lax.scan(
            body, (x, cache.k, cache.v, cache.aux), (layer_state, jnp.arange(cfg.n_layers, dtype=jnp.int32))
        )
        return self.norm(x), KVCache(k_all, v_all, start + t, aux), ys

    def logits(self, h: Float[Array, "... E"]) -> Float[Array, "... V"]:
        out = self.embed_tokens.attend(h) if self.config.tie_word_embeddings else self.lm_head(h)
        return out.astype(jnp.float32)

    # -- public ----------------------------------------------------------------------------

    def prefill(
        self, tokens: Int[Array, "B T"], cache: KVCache, *, last_only: bool = False
    ) -> tuple[Float[Array, "B T V"], KVCache]:
        """Dense causal forward of `tokens` at positions cache.length + [0, T).

        Returns f32 logits [B, T, V] (or [B, V] for the last token if `last_only`, which saves
        T*V floats on long prompts) and the cache with length += T. Starting from a non-empty
        cache (chunked prefill) works: the chunk attends to everything already cached.
        """
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim != 2:
            raise ValueError(f"prefill takes tokens [batch, T], got shape {tokens.shape}")
        if cache.aux is not None:
            raise ValueError(
                "prefill is dense and does not update attention state: prefill first, then "
                "init_attention_state(cache, attention_fn)"
            )
        _check_fits(tokens.shape[1], cache)
        graphdef, state = nnx.split(self)
        return _prefill(graphdef, state, tokens, cache, last_only)

    def decode_step(
        self,
        token: Int[Array, "B"],
        cache: KVCache,
        position: Int[Array, ""] | int | None = None,
        *,
        attention_fn: AttentionFn = dense_attention,
    ) -> tuple[Float[Array, "B V"], KVCache]:
        """One token per sequence at `position` (default cache.length), attention via `attention_fn`.

        The new key/value is written to slot `position` and `attention_fn` sees length
        position + 1. Returns f32 logits [B, V] and the cache with length = position + 1.
        `position` must be < capacity (under jit it cannot be checked; XLA would clamp the write).

        A `StatefulAttentionFn` needs `cache.aux` (from `init_attention_state`) and decodes at
        position = cache.length only (its state cannot rewind); the returned cache carries the
        updated state.
        """
        if is_stateful(attention_fn):
            if cache.aux is None:
                raise ValueError(
                    "decode_step: a stateful attention_fn needs its state in the cache: "
                    "cache = init_attention_state(cache, attention_fn) after prefill"
                )
            if position is not None and _concrete_int(position) != _concrete_int(cache.length):
                raise ValueError(
                    f"decode_step: a stateful attention_fn decodes at position = cache.length "
                    f"({_concrete_int(cache.length)}) only, got position {_concrete_int(position)}"
                )
        if position is not None:
            cache = dataclasses.replace(cache, length=jnp.asarray(position, jnp.int32))
        _check_fits(1, cache)

        graphdef, state = nnx.split(self)
        attn_static, attn_leaves = _split_attention(attention_fn)
        return _decode_step(graphdef, state, jnp.asarray(token, jnp.int32), cache, attn_static, attn_leaves)


# The public methods run through these jitted pure functions, so eager calls are fast too (the
# module is split into a static graphdef and a state pytree, and rebuilt inside the trace).
@functools.partial(jax.jit, static_argnames=("graphdef", "last_only"))
def _prefill(graphdef, state, tokens, cache, last_only):
    model = nnx.merge(graphdef, state)
    h, cache, _ = model._forward(tokens, cache, _dense_attend, capture=False)
    return model.logits(h[:, -1] if last_only else h), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "attn_static"))
def _decode_step(graphdef, state, token, cache, attn_static, attn_leaves):
    model = nnx.merge(graphdef, state)
    attention_fn = _join_attention(attn_static, attn_leaves)
    stateful = is_stateful(attention_fn)

    def attend(q, k, v, start, layer, *aux):
        if stateful:
            o, new = attention_fn(q[:, :, :, 0], k, v, start + 1, layer, *aux)
            return o[:, :, :, None], new
        return attention_fn(q[:, :, :, 0], k, v, start + 1, layer)[:, :, :, None]

    h, cache, _ = model._forward(token[:, None], cache, attend, capture=False, stateful=stateful)
    return model.logits(h[:, 0]), cache


@functools.partial(jax.jit, static_argnames=("attn_static",))
def _init_state(cache, attn_static, attn_leaves):
    return _join_attention(attn_static, attn_leaves).init_state(cache)


def init_attention_state(cache: KVCache, attention_fn: StatefulAttentionFn) -> KVCache:
    """The cache with `aux = attention_fn.init_state(cache)` (jitted; call it after prefill)."""
    if not is_stateful(attention_fn):
        raise TypeError(f"init_attention_state: {attention_fn!r} has no init_state method (it is stateless)")
    aux = _init_state(dataclasses.replace(cache, aux=None), *_split_attention(attention_fn))
    return dataclasses.replace(cache, aux=aux)


def _check_same_structure(old, new) -> None:
    """A stateful attention_fn must return its state slice with unchanged structure/shapes/dtypes."""
    spec = lambda t: [(jnp.shape(a), jnp.result_type(a)) for a in jax.tree.leaves(t)]  # noqa: E731
    if jax.tree.structure(old) != jax.tree.structure(new) or spec(old) != spec(new):
        raise TypeError(
            "stateful attention_fn returned a state slice whose structure, shapes or dtypes differ from "
            f"the one it was given:\n  got      {spec(new)}\n  expected {spec(old)}"
        )


def _concrete_int(x):
    try:
        return int(x)
    except (jax.errors.ConcretizationTypeError, TypeError):
        return x


def _split_attention(fn) -> tuple:
    """(static part, traced leaves) of an attention_fn.

    A plain callable (no pytree leaves but itself) is a static jit argument: hashed, baked into
    the program. A callable *pytree* (e.g. a frozen dataclass registered with
    `jax.tree_util.register_dataclass` that holds calibration arrays) passes its array leaves as
    traced arguments, so new arrays of the same shapes reuse the compiled program.
    """
    leaves, treedef = jax.tree.flatten(fn)
    if len(leaves) == 1 and leaves[0] is fn:
        return fn, ()
    return treedef, tuple(leaves)


def _join_attention(static, leaves):
    return jax.tree.unflatten(static, leaves) if isinstance(static, jax.tree_util.PyTreeDef) else static


def _dense_attend(q, k, v, start, layer):
    del layer
    return _causal_attention(q, k, v, start)


def _check_fits(n_new: int, cache: KVCache) -> None:
    if n_new > cache.capacity:
        raise ValueError(f"{n_new} tokens do not fit in a KV cache of capacity {cache.capacity}")
    try:  # concrete length (outside jit): check the end too
        end = int(cache.length) + n_new
    except (jax.errors.ConcretizationTypeError, TypeError):
        return
    if end > cache.capacity:
        raise ValueError(
            f"cache length {int(cache.length)} + {n_new} new tokens exceeds capacity {cache.capacity}"
        )


# ---------------------------------------------------------------------------------------------
# Jitted entry points over (graphdef, state): pure functions, the module is rebuilt inside.


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "capacity", "attn_static"))
def _generate(graphdef, state, prompt, max_new_tokens: int, capacity: int, attn_static, attn_leaves):
    model = nnx.merge(graphdef, state)
    attention_fn = _join_attention(attn_static, attn_leaves)
    b = prompt.shape[0]
    cache = KVCache.init(model.config, b, capacity, model.dtype)
    logits, cache = model.prefill(prompt, cache, last_only=True)
    if is_stateful(attention_fn):  # build the state (e.g. a sparse index) from the prefill cache
        cache = dataclasses.replace(cache, aux=attention_fn.init_state(cache))
    out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(jnp.argmax(logits, -1).astype(jnp.int32))

    def body(i, carry):
        out, cache = carry
        logits, cache = model.decode_step(out[:, i - 1], cache, attention_fn=attention_fn)
        return out.at[:, i].set(jnp.argmax(logits, -1).astype(jnp.int32)), cache

    out, _ = jax.lax.fori_loop(1, max_new_tokens, body, (out, cache))
    return out


def generate(
    model: LlamaForCausalLM,
    prompt_ids: Int[Array, "B T"] | Int[Array, "T"],
    max_new_tokens: int,
    *,
    capacity: int | None = None,
    attention_fn: AttentionFn = dense_attention,
) -> Int[Array, "B N"]:
    """Greedy decoding of `max_new_tokens` tokens (no EOS stop: fixed length, static shapes).

    One compiled program per (prompt shape, max_new_tokens, capacity, attention_fn). A plain
    `attention_fn` is a static jit argument (keep the same function object to reuse the program);
    a callable pytree passes its arrays as traced arguments (see `AttentionFn`). A
    `StatefulAttentionFn` builds its state from the prefill cache inside the same program and
    carries it through the loop. Returns [B, N] (or [N] for a 1-D prompt) new token ids.
    """
    prompt = jnp.asarray(prompt_ids, jnp.int32)
    squeeze = prompt.ndim == 1
    prompt = prompt[None] if squeeze else prompt
    capacity = capacity or prompt.shape[1] + max_new_tokens
    if prompt.shape[1] + max_new_tokens > capacity:
        raise ValueError(
            f"prompt of {prompt.shape[1]} tokens + {max_new_tokens} new tokens exceeds cache capacity {capacity}"
        )
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    graphdef, state = nnx.split(model)
    out = _generate(graphdef, state, prompt, max_new_tokens, capacity, *_split_attention(attention_fn))
    return out[0] if squeeze else out


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _capture(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    cache = KVCache.init(model.config, 1, tokens.shape[1], model.dtype)
    _, _, (q, k, v) = model._forward(tokens, cache, _dense_attend, capture=True)
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
