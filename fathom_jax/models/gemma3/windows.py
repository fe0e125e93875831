"""Gemma 3's sliding windows: a ring buffer of one window (post-RoPE keys) for each sliding-window layer, the part of
the decode state the model keeps of its own (the global layers' rows are their attention's cache).

The sliding-window layers keep only their last ``sliding_window`` positions (position p in slot p mod W): at
32k tokens a full-length cache per local layer would hold 64x more rows, none of them ever attended, and only
the global layers' rows are what a sparse decode step indexes. Attention over the ring is order-free (a
softmax over a set of keys), so slots are never reordered when decoding.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from fathom_jax.models.gemma3.config import Gemma3Config
from fathom_jax.models.prompt_attention import PREFILL_QUERY_CHUNK


def window_attention(q: Float[Array, "B Hkv G T D"], k: Float[Array, "B Hkv T D"], v: Float[Array, "B Hkv T D"],
                     ring_k: Float[Array, "B Hkv W D"], ring_v: Float[Array, "B Hkv W D"], start: Int[Array, "*B"],
                     valid: Int[Array, "B"] | None = None, chunk: int = PREFILL_QUERY_CHUNK):
    """Sliding-window attention of T new tokens at positions start[b] + [0, T) of each sequence b: each query sees
    the W positions up to its own (transformers: kv > q - W), from the ring (positions < start) and the new keys.
    ``valid[b]``: sequence b's real new tokens (None: all T); the rest is right padding, never written to the ring
    (what a padding query returns is meaningless).

    Returns (o [B,Hkv,G,T,D] f32, ring_k, ring_v with each sequence's last min(valid, W) new rows written)."""
    b, t = q.shape[0], q.shape[3]
    start = jnp.broadcast_to(start, (b,))  # one position for the batch, or one each
    valid = jnp.full((b,), t, jnp.int32) if valid is None else valid

    def one(q, k, v, ring_k, ring_v, start, valid):  # one sequence (its batch axis kept, of size 1)
        o, rk, rv = _window_attention(*(x[None] for x in (q, k, v, ring_k, ring_v)), start, valid, chunk)
        return o[0], rk[0], rv[0]

    # By sequence: each has its own position (a pool decodes sessions of different lengths together).
    return jax.vmap(one)(q, k, v, ring_k, ring_v, start, valid)


def _window_attention(q, k, v, ring_k, ring_v, start, valid, chunk: int):
    w, t = ring_k.shape[2], q.shape[3]
    order = (start + jnp.arange(w)) % w  # index i of `keys` <-> position start - W + i
    keys = jnp.concatenate([jnp.take(ring_k, order, axis=2), k.astype(ring_k.dtype)], axis=2)
    values = jnp.concatenate([jnp.take(ring_v, order, axis=2), v.astype(ring_v.dtype)], axis=2)
    o = _banded_attention(q, keys, values, start, w, chunk)
    # Ring slot s holds the newest real position p = s (mod W): a new token's row where p >= start, else its own.
    last = start + valid - 1
    position = last - (last - jnp.arange(w)) % w
    fresh = (position >= start)[None, None, :, None]
    row = jnp.clip(position - start, 0, t - 1)
    ring_k = jnp.where(fresh, jnp.take(k, row, axis=2).astype(ring_k.dtype), ring_k)
    ring_v = jnp.where(fresh, jnp.take(v, row, axis=2).astype(ring_v.dtype), ring_v)
    return o, ring_k, ring_v


def _banded_attention(q, keys, values, start, w: int, chunk: int):
    """Query t (position start + t) over keys index j (position start - W + j), j in (t, t + W], position >= 0;
    by chunks of queries, each over the W + chunk keys its band can reach."""
    t = q.shape[3]
    scale = 1.0 / math.sqrt(q.shape[-1])  # as the attention objects: query_scale folded Gemma's scalar into q

    def band(qc, kc, vc, t0, j0):  # queries t0 + [0, Tc) over keys j0 + [0, Kc)
        s = jnp.einsum("bhgtd,bhjd->bhgtj", qc.astype(jnp.float32), kc.astype(jnp.float32)) * scale
        qi = t0 + jnp.arange(qc.shape[3])[:, None]
        kj = j0 + jnp.arange(kc.shape[2])[None, :]
        s = jnp.where((kj > qi) & (kj <= qi + w) & (kj >= w - start), s, -jnp.inf)
        return jnp.einsum("bhgtj,bhjd->bhgtd", jax.nn.softmax(s, axis=-1), vc.astype(jnp.float32))

    if t <= chunk:
        return band(q, keys, values, 0, 0)
    pad = -t % chunk
    qp = jnp.pad(q, ((0, 0),) * 3 + ((0, pad), (0, 0)))
    kp, vp = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (keys, values))

    def one(t0):
        qc = jax.lax.dynamic_slice_in_dim(qp, t0, chunk, axis=3)
        kc, vc = (jax.lax.dynamic_slice_in_dim(a, t0, chunk + w, axis=2) for a in (kp, vp))
        return band(qc, kc, vc, t0, t0)

    out = jax.lax.map(one, jnp.arange(0, t + pad, chunk, dtype=jnp.int32))  # [chunks, B, Hkv, G, chunk, D]
    out = jnp.moveaxis(out, 0, 3)
    return out.reshape(*out.shape[:3], t + pad, out.shape[-1])[:, :, :, :t]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Windows:
    """The local layers' rings (position p at slot p mod window) and each sequence's length: what a Gemma 3 decoder
    keeps of its own between decode steps (the global layers' rows are their attention's cache)."""

    k: Float[Array, "local_layers batch kv_heads window head_dim"]
    v: Float[Array, "local_layers batch kv_heads window head_dim"]
    length: Int[Array, "batch"]

    @classmethod
    def init(cls, config: Gemma3Config, batch: int, dtype) -> "Windows":
        shape = (len(config.local_layers), batch, config.n_kv_heads, config.sliding_window, config.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @staticmethod
    def sequence_axes() -> "Windows":
        """Each leaf's sequence (batch) axis, as a tree like a ``Windows``: what moves one sequence's state (a session
        pool's slots, :meth:`~fathom_jax.models.decoder.Decoder.split_state`)."""
        return Windows(k=1, v=1, length=0)

    def attend(self, i, q, k, v, valid: Int[Array, "B"] | None = None) -> tuple[Array, "Windows"]:
        """Local layer ``i``'s window attention of new tokens at positions length + [0, T) (``valid``: each
        sequence's real ones, as :func:`window_attention`); their rows written."""
        o, rk, rv = window_attention(q, k, v, self.k[i], self.v[i], self.length, valid)
        return o, dataclasses.replace(self, k=self.k.at[i].set(rk), v=self.v.at[i].set(rv))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Gemma3State:
    """A Gemma 3 decode state: the local layers' ``windows`` and the global layers' attention ``cache``."""

    windows: Windows
    cache: object

