"""The dense KV cache and the decode attention over it (:class:`AttentionFn`, what a
:class:`~fathom_jax.models.attention.DenseCache` calls).

The cache holds *post-RoPE* keys, because Fathom's scans rank keys exactly as attention sees them. It is
an explicit pytree that the decode step takes and returns, so XLA updates it in place.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Post-RoPE keys and values of every layer; slots [0, length) are valid for all sequences.

    One shared `length` (not per sequence): dense batches are equal-length, which keeps every shape
    and mask static-size (sparse decoding's cache has a length per sequence).
    """

    k: Float[Array, "layers batch kv_heads capacity head_dim"]
    v: Float[Array, "layers batch kv_heads capacity head_dim"]
    length: Int[Array, ""]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]


class AttentionFn(Protocol):
    """Decode-time attention for one layer over a dense :class:`KVCache`.

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
    dataclass registered with `jax.tree_util.register_dataclass` whose array fields are traced: new
    values of the same shapes do not recompile. Runs inside `lax.scan` over layers, so index
    per-layer tables with `layer`. Decoding with it is decoding with `DenseCache(fn)`.
    """

    def __call__(
        self,
        q: Float[Array, "B Hkv G D"],
        k: Float[Array, "B Hkv C D"],
        v: Float[Array, "B Hkv C D"],
        length: Int[Array, ""],
        layer: Int[Array, ""],
    ) -> Float[Array, "B Hkv G D"]: ...


def softmax_attention(q, k, v, length, layer):
    """Exact softmax attention over cache slots [0, length); the reference `AttentionFn`."""
    del layer
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bhgd,bhcd->bhgc", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    s = jnp.where(jnp.arange(k.shape[2]) < length, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhgc,bhcd->bhgd", p, v.astype(jnp.float32))

