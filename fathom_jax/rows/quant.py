"""Integer codes for K/V row formats: one side's codec, its quantizers and how codes and scales become bytes.

Pure jnp. Every division is settled exactly and every scale is a product by a constant, so the codes come out
the same in one compiled program or another (encoding at once and appending token by token agree bit for bit).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

SCALE_BYTES = 2  # fp16


@dataclasses.dataclass(frozen=True)
class Codec:
    """How one side (K or V) of a row is coded: ``bits`` (16: bf16; 8 or 4: integer codes), scales per token
    (in ``group``-channel groups; 0: the whole row) or per (channel, ``block``-token block), symmetric or
    ``asym``; ``store``: the plane store's codes."""

    bits: int = 16
    group: int = 0
    block: int = 0
    asym: bool = False
    store: bool = False

    @property
    def spec(self) -> str:
        if self.store:
            return "store"
        scope = f"g{self.group}" if self.group else f"c{self.block}" if self.block else ""
        return f"{self.bits}{scope}{'a' if self.asym else ''}"

    @property
    def scale_count(self) -> int:
        """fp16 numbers per scale: 1 (absmax) or 2 (scale and zero); 0 for bf16."""
        return 0 if self.bits == 16 else 2 if self.asym else 1

    def groups(self, d: int) -> int:
        return 0 if self.bits == 16 or self.block else d // self.group if self.group else 1

    def row_bytes(self, d: int) -> int:
        return self.bits * d // 8 + self.groups(d) * self.scale_count * SCALE_BYTES

    def validate(self, d: int, side: str) -> None:
        where = f"row format side {side} ({self.spec})"
        if d < 2 or d % 2:
            raise ValueError(f"{where}: head_dim must be a positive even number, got {d}")
        if self.group and d % self.group:
            raise ValueError(f"{where}: head_dim {d} is not a multiple of the group of {self.group} channels")


BF16 = Codec(16)


# ----------------------------------------------------------------------------------------------
# Quantizers


def round_div(num, scale):
    """``floor(num / scale + 1/2)`` exactly (0 where ``scale`` is 0). XLA may divide as a multiply by the
    reciprocal in one program and not another (see :func:`fathom_jax.store.exact_cell`); ``(c +- 1/2) * scale``
    is exact in f32 (codes of at most 9 bits times an fp16 scale), so one comparison each way settles it."""
    ok = scale > 0
    c = jnp.floor(num / jnp.where(ok, scale, 1.0) + 0.5)
    c = jnp.where(ok & ((c - 0.5) * scale > num), c - 1, c)
    c = jnp.where(ok & ((c + 0.5) * scale <= num), c + 1, c)
    return jnp.where(ok, c, 0.0)


def qmax(c: Codec) -> int:
    return 2 ** c.bits - 1 if c.asym else 2 ** (c.bits - 1) - 1


def fit_scales(c: Codec, x, valid, axis: int):
    """fp16 scale (and zero) over ``axis`` (kept): ``absmax / qmax``, or ``min`` and ``(max - min) / qmax``. The
    scales are products by a constant (exact everywhere), not quotients."""
    inv = np.float32(1.0 / qmax(c))
    if not c.asym:
        return stored(jnp.max(jnp.abs(x), axis=axis, keepdims=True) * inv), None
    lo = jnp.min(jnp.where(valid, x, jnp.inf), axis=axis, keepdims=True)
    hi = jnp.max(jnp.where(valid, x, -jnp.inf), axis=axis, keepdims=True)
    lo, hi = jnp.where(hi >= lo, lo, 0.0), jnp.where(hi >= lo, hi, 0.0)  # no valid token: 0
    zero = stored(lo)
    return stored((hi - zero.astype(jnp.float32)) * inv), zero


def stored(x):
    """``x`` rounded to the fp16 the row stores. The barrier keeps the rounding: a GPU compile that allows excess
    precision folds ``f32 -> f16 -> f32`` away inside a fusion, and the codes would then be fit to a scale the row
    does not hold (one code in a few thousand off by one against another program's encoding)."""
    return jax.lax.optimization_barrier(x.astype(jnp.float16))


def quantize(c: Codec, x, scale, zero):
    """Unsigned codes: ``round(x / s) + 2^(b-1)`` (symmetric) or ``round((x - z) / s)`` (asymmetric)."""
    s = scale.astype(jnp.float32)
    if c.asym:
        return jnp.clip(round_div(x - zero.astype(jnp.float32), s), 0, qmax(c)).astype(jnp.uint8)
    return (jnp.clip(round_div(x, s), -qmax(c), qmax(c)) + 2 ** (c.bits - 1)).astype(jnp.uint8)


def dequantize(c: Codec, codes, scale, zero):
    s = scale.astype(jnp.float32)
    if c.asym:
        return codes.astype(jnp.float32) * s + zero.astype(jnp.float32)
    return (codes.astype(jnp.float32) - 2 ** (c.bits - 1)) * s


def split_scales(block_scales):
    """``[.., S, Dh]`` block scales -> (scale, zero or None), each ``[.., Dh]``."""
    return block_scales[..., 0, :], block_scales[..., 1, :] if block_scales.shape[-2] == 2 else None


def encode_side(c: Codec, x: Float[Array, "*B n Dh"]) -> Array:
    """One side's bytes of every row ``uint8 [*B, n, c.row_bytes(Dh)]`` (per-token scales, or bf16)."""
    if c.bits == 16:
        return to_bytes(x.astype(jnp.bfloat16))
    *batch, n, d = x.shape
    g = c.groups(d)
    xg = x.reshape(*batch, n, g, d // g)
    scale, zero = fit_scales(c, xg, True, axis=-1)
    codes = pack(quantize(c, xg, scale, zero).reshape(*batch, n, d), c.bits)
    scales = scale if zero is None else jnp.concatenate([scale, zero], -1)  # [.., g, S]
    return jnp.concatenate([codes, to_bytes(scales.reshape(*batch, n, -1))], -1)


def decode_side(c: Codec, raw, d: int) -> Float[Array, "*B n Dh"]:
    if c.bits == 16:
        return from_bytes(raw, jnp.bfloat16).astype(jnp.float32)
    g, cb = c.groups(d), c.bits * d // 8
    scales = from_bytes(raw[..., cb:], jnp.float16).reshape(*raw.shape[:-1], g, c.scale_count)
    codes = unpack(raw[..., :cb], c.bits).reshape(*raw.shape[:-1], g, d // g)
    zero = scales[..., 1:2] if c.asym else None
    return dequantize(c, codes, scales[..., 0:1], zero).reshape(*raw.shape[:-1], d)


def pack(codes, bits: int):
    """Codes ``[.., D]`` as bytes: 8-bit as they are, 4-bit two per byte (even channel in the low nibble)."""
    codes = codes.astype(jnp.uint8)
    return codes if bits == 8 else codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(raw, bits: int):
    if bits == 8:
        return raw
    return jnp.stack([raw & 15, raw >> 4], -1).reshape(*raw.shape[:-1], raw.shape[-1] * 2)


def to_bytes(x):
    """``[.., m]`` of a 2-byte dtype -> ``uint8 [.., 2m]`` (each number's bytes in machine order)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(*x.shape[:-1], x.shape[-1] * 2)


def from_bytes(raw, dtype):
    return jax.lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], raw.shape[-1] // 2, 2), dtype)


