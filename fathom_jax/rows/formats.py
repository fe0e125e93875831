"""K/V row formats: how one token's key and value rows sit in host memory, compressed or not.

    from fathom_jax.rows import formats as row_formats
    f = row_formats.parse("k8v8")               # 8-bit K and V, one fp16 absmax scale per token each
    rows = f.encode(keys, values)               # keys, values [..., n, Dh] -> Rows
    rows = f.append(rows, new_keys, new_values) # the same bits as encoding every token at once
    k, v = f.decode(rows)                       # f32 [..., capacity, Dh]; rows past the length are 0
    f.bytes_per_token(128)                      # host bytes per token, layer and KV head, index included

A row fetch reads each selected token's row as one contiguous run of bytes, so every per-token scale sits
in the row: ``[K codes | K scales | V codes | V scales]`` (``uint8 [..., n, row_bytes]``). ``bf16`` keeps
today's layout, ``bf16 [..., n, 2 Dh]`` with key and value side by side. Scales per (channel, block of
tokens), KIVI's choice for keys, are a separate small array, ``fp16 [..., NB, S, Dh]`` (``S`` = 1 absmax, or
2: scale and zero), that the fetch gathers per block. The block holding the newest token is requantized at
every append from its raw keys (``tail``), as the plane store does, so appending token by token and encoding
all at once give the same bits.

Spec: ``bf16`` or ``k<K>v<V>``, each side one of

* ``16``: bf16;
* ``8``, ``4``: symmetric absmax, one fp16 scale per token (``g<N>``: per group of N channels), codes
  ``round(x / s)`` in ``[-(2^(b-1) - 1), 2^(b-1) - 1]``; suffix ``a``: asymmetric min/max (fp16 scale and zero,
  codes in ``[0, 2^b - 1]``);
* ``8c64``, ``4c64a``, ``4c16a`` (K only): per (channel, N-token block), symmetric or asymmetric;
* ``store`` (K only): the key index's own 4-bit codes and fp16 block scales (:mod:`fathom_jax.store`) read at
  4 planes. Its codes are in the rows here, but a cache would read them from the index's planes: they are
  counted once, as the index.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Float16, Int

from fathom_jax import format as fmt
from fathom_jax import store as plane_store
from fathom_jax.checks import fail_if, is_traced
from fathom_jax.rows import quant as rq
from fathom_jax.rows.quant import BF16, SCALE_BYTES, Codec

# Inputs of quantized sides must be finite fp16 numbers: min, absmax and (max - min) / qmax then fit an fp16 scale.
MAX_ABS = fmt.FP16_MAX


@dataclasses.dataclass(frozen=True)
class RowFormat:
    """A K/V row format (frozen, hashable: a static ``jit`` argument). See the module docstring."""

    key: Codec = BF16
    value: Codec = BF16

    def __post_init__(self):
        for side, c in (("key", self.key), ("value", self.value)):
            ok = (c.bits == 16 and c == BF16) or (c.store and c == Codec(4, block=fmt.BLOCK_TOKENS, store=True)) or (
                c.bits in (4, 8) and not c.store and not (c.group and c.block) and c.group >= 0 and c.block >= 0)
            if not ok:
                raise ValueError(f"row format {side}: unsupported codec {c}")
            if c.block and fmt.BLOCK_TOKENS % c.block:
                raise ValueError(f"row format {side}: the block of {c.block} tokens must divide {fmt.BLOCK_TOKENS}")
        if self.value.block:
            raise ValueError("row format value: per-(channel, block) scales are for keys only; values are per token")

    @property
    def spec(self) -> str:
        return "bf16" if self.is_bf16 else f"k{self.key.spec}v{self.value.spec}"

    @property
    def is_bf16(self) -> bool:
        return self.key == BF16 and self.value == BF16

    @property
    def block(self) -> int:
        """Tokens per K block scale (0: no block scales)."""
        return self.key.block

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one token's row: the contiguous run a row fetch reads."""
        return self.key.row_bytes(head_dim) + self.value.row_bytes(head_dim)

    def block_scale_bytes(self, head_dim: int) -> float:
        """Bytes per token of the per-(channel, block) K scales."""
        return head_dim * self.key.scale_count * SCALE_BYTES / self.block if self.block else 0.0

    def bytes_per_token(self, head_dim: int, *, index: bool = True) -> float:
        """Host bytes per token, layer and KV head: rows, block scales and (``index``) the key index's 4-bit
        planes and fp16 block scales, ``4 Dh / 8 + 2 Dh / 64`` (580 in all for bf16 rows at Dh = 128)."""
        own = self.row_bytes(head_dim) + self.block_scale_bytes(head_dim)
        if self.key.store:  # its K codes and block scales are the index's planes and scales
            own -= self.key.row_bytes(head_dim) + self.block_scale_bytes(head_dim)
        idx = (fmt.N_PLANES * head_dim / 8 + fmt.SCALE_BITS / 8 * head_dim / fmt.BLOCK_TOKENS) if index else 0.0
        return own + idx

    def validate(self, head_dim: int) -> None:
        self.key.validate(head_dim, "key")
        self.value.validate(head_dim, "value")

    # ------------------------------------------------------------------------------------------
    def encode(self, keys: Float[Array, "*B n Dh"], values: Float[Array, "*B n Dh"], *, capacity: int | None = None,
               length: Int[Array, "*B"] | int | None = None, check: bool = True) -> "Rows":
        """Rows of ``capacity`` tokens (default ``n``, rounded up to 64) holding the first ``length`` (default
        ``n``) of ``keys``/``values``; rows past the length are zero and take no part in any scale. A value out
        of the format's range or a bad length is an error (at run time under ``jit``) unless ``check=False``."""
        keys, values = jnp.asarray(keys), jnp.asarray(values)
        if keys.ndim < 2 or keys.shape != values.shape:
            raise ValueError(f"encode: keys and values must both be [..., n, Dh], got {keys.shape} and {values.shape}")
        for name, x in (("keys", keys), ("values", values)):
            if not jnp.issubdtype(x.dtype, jnp.floating):
                raise TypeError(f"encode: {name} must be floating point, got {x.dtype}")
        *batch, n, d = keys.shape
        self.validate(d)
        capacity = fmt.round_capacity(n if capacity is None else capacity)
        if capacity < n:
            raise ValueError(f"encode: capacity={capacity} is smaller than the {n} tokens given")
        if check:
            self._check_inputs("encode", keys, values)
        if length is None:
            length = jnp.full(batch, n, jnp.int32)
        else:
            length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), batch)
            if check:
                fail_if((length < 0) | (length > n), lambda got: f"encode: length must lie in [0, {n}], got {got}",
                        length)
        pad = lambda x: jnp.zeros((*batch, capacity, d), jnp.float32).at[..., :n, :].set(x.astype(jnp.float32))
        keys, values = pad(keys), pad(values)
        valid = (jnp.arange(capacity) < length[..., None])[..., None]
        if self.is_bf16:
            data = jnp.where(valid, jnp.concatenate([keys, values], -1), 0.0).astype(jnp.bfloat16)
            return Rows(data, *self._no_blocks(batch, d), length)
        if self.block:
            b = self.block
            kbytes, scales = self._encode_blocks(keys.reshape(*batch, capacity // b, b, d),
                                                 valid.reshape(*batch, capacity // b, b, 1))
            kbytes = kbytes.reshape(*batch, capacity, -1)
            tail = plane_store.block_tail(keys, length, b)
        else:
            kbytes, (scales, tail) = rq.encode_side(self.key, keys), self._no_blocks(batch, d)
        data = jnp.where(valid, jnp.concatenate([kbytes, rq.encode_side(self.value, values)], -1), 0)
        return Rows(data, scales, tail, length)

    def append(self, rows: "Rows", keys: Float[Array, "*B m Dh"], values: Float[Array, "*B m Dh"], *,
               check: bool = True) -> "Rows":
        """``rows`` with ``m`` more tokens appended to every sequence (requantizing each open K block).
        Past capacity, or a value beyond the format's range, is an error (at run time under ``jit``)."""
        keys, values = jnp.asarray(keys), jnp.asarray(values)
        batch, d = rows.length.shape, rows.tail.shape[-1]
        if keys.shape != values.shape or keys.ndim != len(batch) + 2 or keys.shape[:-2] != batch or keys.shape[-1] != d:
            raise ValueError(f"append: keys and values must be [*batch, m, Dh] with batch {batch} and Dh = {d}, "
                             f"got {keys.shape} and {values.shape}")
        if check:
            plane_store.check_capacity(rows.length, keys.shape[-2], rows.capacity)
            self._check_inputs("append", keys, values)
        flat = lambda x: x.reshape(int(np.prod(batch)), *x.shape[len(batch):])  # explicit: some leaves are empty
        state = tuple(flat(x) for x in (rows.data, rows.block_scales, rows.tail, rows.length.reshape(batch + (1,))))
        kf, vf = flat(keys.astype(jnp.float32)), flat(values.astype(jnp.float32))
        state = jax.lax.fori_loop(0, keys.shape[-2], lambda i, s: jax.vmap(self._append_one)(*s, kf[:, i], vf[:, i]),
                                  state)
        return Rows(*(x.reshape(*batch, *x.shape[1:]) for x in state[:3]), state[3].reshape(batch))

    def decode(self, rows: "Rows") -> tuple[Float[Array, "*B n Dh"], Float[Array, "*B n Dh"]]:
        """Keys and values (f32) of every row; rows at or past the length are 0."""
        scales = jnp.repeat(rows.block_scales, self.block, axis=-3) if self.block else None
        keys, values = self.decode_rows(rows.data, scales)
        valid = (jnp.arange(rows.capacity) < rows.length[..., None])[..., None]
        return jnp.where(valid, keys, 0.0), jnp.where(valid, values, 0.0)

    def decode_rows(self, data: Array, block_scales: Float16[Array, "*B m S Dh"] | None = None
                    ) -> tuple[Float[Array, "*B m Dh"], Float[Array, "*B m Dh"]]:
        """Keys and values (f32) of fetched rows ``data [..., m, row]`` and, with K block scales, each row's
        block's scales (what :meth:`gather` returns)."""
        d = data.shape[-1] // 2 if self.is_bf16 else self._head_dim(data.shape[-1])
        if self.is_bf16:
            return data[..., :d].astype(jnp.float32), data[..., d:].astype(jnp.float32)
        if self.block and block_scales is None:
            raise ValueError(f"decode_rows: format {self.spec} needs each row's K block scales")
        split = self.key.row_bytes(d)
        if self.key.store:
            codes = rq.unpack(data[..., :split], 4).astype(jnp.int32)
            keys = plane_store.dequantize_codes(codes, block_scales[..., 0, :].astype(jnp.float32), 4)
        elif self.block:
            keys = rq.dequantize(self.key, rq.unpack(data[..., :split], self.key.bits), *rq.split_scales(block_scales))
        else:
            keys = rq.decode_side(self.key, data[..., :split], d)
        return keys, rq.decode_side(self.value, data[..., split:], d)

    @property
    def per_token(self) -> bool:
        """Every scale sits in its token's row (no per-block K scales): rows can be written one token at a time
        into any buffer, as a decode cache does."""
        return not self.block

    @functools.partial(jax.jit, static_argnums=0)  # one program per format and shape, called eagerly or not
    def encode_rows(self, keys: Float[Array, "*B n Dh"], values: Float[Array, "*B n Dh"]) -> Array:
        """The rows of ``keys``/``values`` as :meth:`encode` lays them out (``bf16 [..., n, 2 Dh]``, else ``uint8
        [..., n, row_bytes]``), with no capacity, length or range check: for a format whose scales are per token
        (:attr:`per_token`), each row depends on its own token alone."""
        if not self.per_token:
            raise ValueError(f"encode_rows: format {self.spec} keeps K scales per block of tokens; use encode")
        keys, values = jnp.asarray(keys, jnp.float32), jnp.asarray(values, jnp.float32)
        if self.is_bf16:
            return jnp.concatenate([keys, values], -1).astype(jnp.bfloat16)
        return jnp.concatenate([rq.encode_side(self.key, keys), rq.encode_side(self.value, values)], -1)

    def check_values(self, where: str, keys, values) -> None:
        """An error (at run time under ``jit``) where a quantized side gets values outside the fp16 range its
        scales can hold."""
        self._check_inputs(where, keys, values)

    def gather(self, rows: "Rows", tokens: Int[Array, "*B m"]) -> tuple[Array, Float16[Array, "*B m S Dh"] | None]:
        """What a row fetch reads for ``tokens``: their rows and (K block scales) their blocks' scales."""
        data = jnp.take_along_axis(rows.data, tokens[..., None], axis=-2)
        if not self.block:
            return data, None
        blocks = (tokens // self.block)[..., None, None]
        return data, jnp.take_along_axis(rows.block_scales, blocks, axis=-3)

    # ------------------------------------------------------------------------------------------
    def _head_dim(self, row: int) -> int:
        """The head_dim whose rows are ``row`` bytes long: row bytes are ``per_channel * Dh + fixed``."""
        a = int(np.lcm.reduce([2, self.key.group or 1, self.value.group or 1]))  # a Dh every group divides
        fixed = 2 * self.row_bytes(a) - self.row_bytes(2 * a)
        per_channel = (self.row_bytes(2 * a) - self.row_bytes(a)) / a
        d = round((row - fixed) / per_channel)
        if d < 2 or self.row_bytes(d) != row:
            raise ValueError(f"decode_rows: rows of {row} bytes do not match row format {self.spec} at any head_dim")
        return d

    def _no_blocks(self, batch, d):
        return jnp.zeros((*batch, 0, max(self.key.scale_count, 1), d), jnp.float16), jnp.zeros((*batch, 0, d))

    def _encode_blocks(self, keys, valid):
        """K codes (bytes, ``[*B, NB, block, Dh * bits / 8]``) and scales ``[*B, NB, S, Dh]`` of whole blocks."""
        if self.key.store:
            codes, scale = plane_store.quantize_blocks(keys, valid[..., 0])
            return rq.pack(jnp.where(valid, codes, 0), 4), scale[..., None, :]
        scale, zero = rq.fit_scales(self.key, jnp.where(valid, keys, 0.0), valid, axis=-2)
        codes = jnp.where(valid, rq.quantize(self.key, keys, scale, zero), 0)
        stacked = scale if zero is None else jnp.concatenate([scale, zero], -2)
        return rq.pack(codes, self.key.bits), stacked

    def _append_one(self, data, block_scales, tail, length, key, value):
        """One sequence: the token's row written at ``length`` (and, with K blocks, its block requantized)."""
        length = length[0]
        if self.is_bf16:
            row = jnp.concatenate([key, value]).astype(jnp.bfloat16)
            return jax.lax.dynamic_update_slice(data, row[None], (length, 0)), block_scales, tail, length[None] + 1
        vrow = rq.encode_side(self.value, value[None])
        if not self.block:
            row = jnp.concatenate([rq.encode_side(self.key, key[None]), vrow], -1)
            return jax.lax.dynamic_update_slice(data, row, (length, 0)), block_scales, tail, length[None] + 1
        b = self.block
        offset = length % b
        tail = jnp.where(offset == 0, 0.0, tail).at[offset].set(key)
        kbytes, scales = self._encode_blocks(tail, (jnp.arange(b) < offset + 1)[:, None])
        data = jax.lax.dynamic_update_slice(data, kbytes, (length - offset, 0))
        data = jax.lax.dynamic_update_slice(data, vrow, (length, kbytes.shape[-1]))
        block_scales = jax.lax.dynamic_update_slice(block_scales, scales[None], (length // b, 0, 0))
        return data, block_scales, tail, length[None] + 1

    def _check_inputs(self, where: str, keys, values) -> None:
        for name, x, c in (("keys", keys, self.key), ("values", values, self.value)):
            if c.bits != 16 and x.size:
                _check_range(f"{where}: {name}", x, self.spec)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    """Encoded K/V rows of a batch of sequences: ``data [*B, capacity, row]`` (``bf16 [.., 2 Dh]`` for the bf16
    format, ``uint8 [.., row_bytes]`` otherwise), K ``block_scales`` fp16 ``[*B, NB, S, Dh]`` (NB = 0 without
    them), ``tail`` f32 ``[*B, block, Dh]``: the raw keys of the open K block (block = 0 without), ``length``."""

    data: Array
    block_scales: Float16[Array, "*B NB S Dh"]
    tail: Float[Array, "*B T Dh"]
    length: Int[Array, "*B"]

    @property
    def capacity(self) -> int:
        return self.data.shape[-2]


def _check_range(name: str, x, spec: str) -> None:
    """Finite and within ``MAX_ABS``: eagerly, or at run time under jit (see :func:`fathom_jax.checks.fail_if`)."""
    xp = jnp if is_traced(x) else np
    arr = x if is_traced(x) else np.asarray(x, np.float32)
    finite = xp.isfinite(arr)
    bad, top = xp.sum(~finite), xp.max(xp.where(finite, xp.abs(arr), 0.0))

    def message(bad, top):
        if int(bad):
            return f"{name} contains {int(bad)} NaN or inf value(s); row format {spec} needs finite values"
        return f"{name} has |x| up to {float(top):.3g}, beyond the {MAX_ABS:g} that row format {spec}'s fp16 scales hold"

    fail_if((bad > 0) | (top > MAX_ABS), message, bad, top)


# ----------------------------------------------------------------------------------------------
# Registry

_SIDE = re.compile(r"(16|store|[48](?:g[1-9]\d*|c[1-9]\d*)?a?)")
_SPEC = re.compile(rf"k{_SIDE.pattern}v{_SIDE.pattern}")
SPEC_SYNTAX = "bf16 | k<K>v<V> with K, V in 16 | 8[a] | 4[a] | 8g<N>[a] | 4g<N>[a] | 8c<N>[a] | 4c<N>[a] | store (K)"

# The formats the row study measures: today's rows, 8-bit K and V under each scale, the 4-bit points of the issue.
STUDY_FORMATS = (
    "bf16", "k8v16", "k16v8", "k8v8", "k8av8a", "k8g32v8g32", "k8g32av8g32a", "k8c64v8", "k8c64av8",
    "k8v4g32a", "k8c64v4g32a", "k16v4g32a", "k4c64av16", "k4c16av16", "k4c16av8", "k4c64av4g32a", "k4c16av4g32a",
    "kstorev16",
)


def _codec(text: str) -> Codec:
    if text == "16":
        return BF16
    if text == "store":
        return Codec(4, block=fmt.BLOCK_TOKENS, store=True)
    m = re.fullmatch(r"([48])(?:g(\d+)|c(\d+))?(a?)", text)
    return Codec(int(m[1]), group=int(m[2] or 0), block=int(m[3] or 0), asym=bool(m[4]))


def parse(spec: "str | RowFormat") -> RowFormat:
    """A row format from its spec (see the module docstring): ``bf16``, ``k8v8``, ``k4c64av4g32a``, ..."""
    if isinstance(spec, RowFormat):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"row format spec must be a string ({SPEC_SYNTAX}), got {spec!r}")
    text = spec.strip().lower()
    if text == "bf16":
        return RowFormat()
    m = _SPEC.fullmatch(text)
    if m is None:
        raise ValueError(f"unknown row format {spec!r}; expected {SPEC_SYNTAX}")
    if m[2] == "store":
        raise ValueError(f"row format {spec!r}: the store's codes can only be the keys")
    return RowFormat(_codec(m[1]), _codec(m[2]))
