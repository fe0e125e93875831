"""The bit-plane key store: 4-bit block-scaled key codes, stored channel-major as bit planes.

Semantics (fixed by the design; every test of exactness leans on them):

* Tokens are grouped in blocks of ``BLOCK_TOKENS = 64`` (``fathom_jax.format``). For block ``b`` and channel ``j`` the scale is
  ``a = max |k|`` over the block's valid tokens, stored as float16. The quantizer cell is ``s = a / 8``
  and the code is ``c = clip(floor(k / s), -8, 7) + 8`` in ``[0, 16)``; codes are computed from the
  *fp16-rounded* scale so that dequantization with the stored scale is self-consistent.
* Bit ``p`` (0 = most significant) of the codes is plane ``p``. Reading the first ``t`` planes gives
  ``c_t = c >> (4 - t)`` and the value ``(c_t + 1/2 - 2^(t-1)) * a / 2^(t-1)``: exactly the t-bit
  mid-rise quantizer of ``[-a, a)`` under the same scale. ``t = 0`` reads nothing (value 0).

Memory layout, per sequence and KV head (leading batch axes ``*B`` in front of everything)::

    planes  uint32  [*B, D, 4, W]   W = capacity / 32; token i of a plane is bit (i % 32) of word i // 32
    scales  float16 [*B, D, NB]     NB = capacity / 64
    tail    float32 [*B, 64, D]     raw keys of the last, partially filled block (for requantization)
    length  int32   [*B]            valid tokens

Channel-major means that the first ``t`` planes of channel ``j`` are one contiguous run of
``t * capacity / 8`` bytes (``planes[..., j, :t, :]``), and its scales are a second run of
``capacity / 32`` bytes. At 32k tokens a plane is 4 KiB, at 1M tokens 128 KiB, so a per-query read is
a short list of long contiguous runs: one per active channel (plus one for its scales). Across
sequences and heads the runs of ``(b, h, j)`` start at word ``((b * H + h) * D + j) * 4 * W``.

A serving cache also appends decode tokens: the last block's scale changes as it fills, so ``append``
requantizes that block from the raw keys kept in ``tail``. Building from all keys at once and
appending them one by one give the same store, bit for bit.

The KLT variant stores planes of ``(k - mu) V`` (see :class:`KeyRotation`); a store built with a
rotation remembers it, and queries are rotated with :func:`rotate_queries` before scoring.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Float16, Int, UInt32

from fathom_jax import format as fmt
from fathom_jax.checks import fail_if, is_traced
from fathom_jax.format import BLOCK_TOKENS, FP16_MAX, N_PLANES, WORD_BITS, round_capacity  # noqa: F401


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyRotation:
    """A fixed orthogonal change of key basis: ``k -> (k - mean) @ basis``.

    ``basis`` columns are ordered by decreasing calibration score variance (see ``calibrate.py``);
    ``mean`` is subtracted from keys only: ``q . mean`` is the same for every key, so rankings and
    softmax weights are unchanged.
    """

    mean: Float[Array, "*B D"]
    basis: Float[Array, "*B D D"]


def rotate_keys(keys: Float[Array, "*B n D"], rotation: KeyRotation | None) -> Float[Array, "*B n D"]:
    """``(k - mean) @ basis``, computed the same way for every token.

    A matmul (or a ``sum`` reduction) may add in a different order for different token counts, and the
    store must come out the same whether its keys arrive at once or one by one, so the product is an
    explicit left fold over the input channels: ``acc += (k - mean)_j * basis[j, :]`` for j = 0..D-1,
    the same sequence of rounded operations for every token whatever the batch of tokens.
    """
    if rotation is None:
        return keys
    centered = keys - rotation.mean[..., None, :]
    basis = rotation.basis

    def body(j, acc):
        col = jax.lax.dynamic_index_in_dim(centered, j, axis=-1, keepdims=True)  # [*B, n, 1]
        row = jax.lax.dynamic_index_in_dim(basis, j, axis=-2, keepdims=True)  # [*B, 1, D]
        return acc + col * row

    return jax.lax.fori_loop(0, centered.shape[-1], body, jnp.zeros(centered.shape, jnp.result_type(centered, basis)))


def rotate_queries(q: Float[Array, "*B G D"], rotation: KeyRotation | None) -> Float[Array, "*B G D"]:
    if rotation is None:
        return q
    return jnp.einsum("...gd,...de->...ge", q, rotation.basis)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlaneStore:
    """Bit-plane key store for a batch of sequences (see the module docstring for the layout)."""

    planes: UInt32[Array, "*B D 4 W"]
    scales: Float16[Array, "*B D NB"]
    tail: Float[Array, "*B 64 D"]
    length: Int[Array, "*B"]
    rotation: KeyRotation | None = None

    @property
    def capacity(self) -> int:
        return self.planes.shape[-1] * WORD_BITS

    @property
    def head_dim(self) -> int:
        return self.planes.shape[-3]

    @property
    def num_blocks(self) -> int:
        return self.scales.shape[-1]

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self.planes.shape[:-3]

    def plane_run_bytes(self) -> int:
        """Bytes of one plane of one channel: the unit of a contiguous read."""
        return fmt.plane_run_bytes(self.capacity)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnpackedStore:
    """A plane store with its 4-bit codes unpacked token-major (``uint8 [*B, capacity, D]``; rows at or
    past ``length`` are ignored), the block holding token ``length`` kept apart (``block_codes``).

    A reader that scans one window many times (the fidelity sweep: one read per decode position) keeps
    this instead of extracting the same bits from the planes at every read. Reads from it
    (:func:`read_codes`, :func:`dequantize`, the ``"xla"`` scan) give the packed store's values bit for
    bit; the Pallas kernels read only packed planes. Make one with :func:`unpack_store`.

    ``block_codes`` ``[*B, 64, D]`` are the codes of block ``length // 64`` and take the place of that
    block's rows of ``codes``: :func:`truncate` requantizes that block only and leaves ``codes`` as it is,
    so the cuts of one window to many lengths (vmapped) share one copy of its codes.
    """

    codes: Int[Array, "*B n D"]
    block_codes: Int[Array, "*B 64 D"]
    scales: Float16[Array, "*B D NB"]
    tail: Float[Array, "*B 64 D"]
    length: Int[Array, "*B"]
    rotation: KeyRotation | None = None

    @property
    def capacity(self) -> int:
        return self.codes.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1]

    @property
    def num_blocks(self) -> int:
        return self.scales.shape[-1]

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self.codes.shape[:-2]


def unpack_store(store: PlaneStore) -> UnpackedStore:
    """The store with its codes unpacked (see :class:`UnpackedStore`)."""
    if isinstance(store, UnpackedStore):
        return store
    codes = unpack_planes(store.planes).astype(jnp.uint8)
    rows = (store.length // BLOCK_TOKENS * BLOCK_TOKENS)[..., None] + jnp.arange(BLOCK_TOKENS)
    # Past the last block (length = capacity) no row reads block_codes: any in-range rows will do.
    block_codes = jnp.take_along_axis(codes, jnp.minimum(rows, store.capacity - 1)[..., None], axis=-2)
    return UnpackedStore(codes=codes, block_codes=block_codes, scales=store.scales, tail=store.tail,
                         length=store.length, rotation=store.rotation)


# ----------------------------------------------------------------------------------------------
# Quantization


def exact_cell(keys, width, ratio):
    """``floor(keys / width)`` exactly (0 where ``width`` is 0), from a quotient ``ratio`` that may be one ulp off.

    XLA on a GPU may divide as a multiply by the reciprocal, in one program and not in another, which puts a key
    on a cell boundary (frequent for bf16 keys) one cell low: the index built after a decode step then differed
    from the index built from all keys. ``j * width`` is exact (an fp16 scale / 8 times an integer |j| <= 8), so
    one comparison each way settles the cell."""
    cell = jnp.floor(ratio)
    cell = jnp.where((width > 0) & (cell * width > keys), cell - 1, cell)
    return jnp.where((width > 0) & ((cell + 1) * width <= keys), cell + 1, cell)


def quantize_blocks(
    keys: Float[Array, "*B NB 64 D"], valid: Any = None
) -> tuple[Int[Array, "*B NB 64 D"], Float16[Array, "*B NB D"]]:
    """4-bit codes and fp16 absmax scales of whole blocks. ``valid`` masks tokens out of the scale."""
    keys = keys.astype(jnp.float32)
    # XLA flushes subnormal quotients (and, inside a fusion, inputs) to zero; a strictly negative key
    # still belongs to a negative cell (Eq. 2), so its sign comes from the bits. The barrier keeps XLA
    # from folding the bit test into a float comparison that would see the flushed value (it did: under
    # jit a -1e-42 key got code 8, eagerly 7).
    bits = jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(keys, jnp.uint32))
    negative = (bits >> 31 == 1) & ((bits & 0x7FFFFFFF) != 0)
    if valid is not None:
        keys = jnp.where(valid[..., None], keys, 0.0)
        negative = negative & valid[..., None]
    absmax = jnp.max(jnp.abs(keys), axis=-2)
    scale16 = jnp.minimum(absmax, FP16_MAX).astype(jnp.float16)
    width = scale16.astype(jnp.float32)[..., None, :] / 8.0
    ratio = jnp.where(width > 0, keys / jnp.where(width > 0, width, 1.0), 0.0)
    codes = jnp.clip(exact_cell(keys, width, ratio), -8, 7).astype(jnp.int32) + 8
    codes = jnp.where(negative & (codes >= 8) & (width > 0), 7, codes)
    return codes, scale16


def dequantize_codes(
    code_t: Int[Array, "... D"], scales: Float[Array, "... D"], depth: Int[Array, "*#... D"] | int
) -> Float[Array, "... D"]:
    """Value of a ``depth``-bit code ``c_t = c >> (4 - t)``: ``(c_t + 1/2 - 2^(t-1)) * a / 2^(t-1)``; 0 at t = 0."""
    depth = jnp.asarray(depth, jnp.int32)
    half_range = jnp.left_shift(1, jnp.maximum(depth, 1) - 1).astype(jnp.float32)
    value = (jnp.asarray(code_t).astype(jnp.float32) + 0.5 - half_range) * (scales.astype(jnp.float32) / half_range)
    return jnp.where(depth > 0, value, 0.0)


def _check_depth(name: str, depth) -> None:
    """Depths are planes read per channel, 0..4: checked when concrete (traced depths: see ``dequantize``)."""
    if is_traced(depth):
        return
    d = np.asarray(depth)
    if d.size and (d.min() < 0 or d.max() > N_PLANES):
        raise ValueError(f"{name}: depth must lie in [0, {N_PLANES}] planes per channel, got values in "
                         f"[{d.min()}, {d.max()}]")


# ----------------------------------------------------------------------------------------------
# Packing


def pack_planes(codes: Int[Array, "*B n D"]) -> UInt32[Array, "*B D 4 W"]:
    """Pack token-major 4-bit codes (n a multiple of 32) into channel-major bit planes."""
    *batch, n, d = codes.shape
    if n % WORD_BITS:
        raise ValueError(f"pack_planes: token count must be a multiple of {WORD_BITS}, got {n}")
    codes = jnp.swapaxes(codes.astype(jnp.uint32), -1, -2)  # [*B, D, n]
    shifts = jnp.arange(N_PLANES - 1, -1, -1, dtype=jnp.uint32)  # plane p holds bit 3 - p
    bits = (codes[..., None, :] >> shifts[:, None]) & 1  # [*B, D, 4, n]
    bits = bits.reshape(*batch, d, N_PLANES, n // WORD_BITS, WORD_BITS)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(WORD_BITS, dtype=jnp.uint32))
    return jnp.sum(bits * weights, axis=-1, dtype=jnp.uint32)


def unpack_planes(planes: UInt32[Array, "*B D 4 W"], depth: Int[Array, "*B D"] | int = N_PLANES) -> Int[Array, "*B n D"]:
    """Codes from the first ``depth`` planes (per channel): ``c >> (4 - depth)``, token-major."""
    _check_depth("unpack_planes", depth)
    # Transpose as its own op: fused into the bit extraction, XLA:CPU ran the whole unpack strided (measured slower).
    return jnp.swapaxes(jax.lax.optimization_barrier(unpack_planes_channels(planes, depth)), -1, -2)


def unpack_planes_channels(planes: UInt32[Array, "*B D 4 W"], depth: Int[Array, "*B D"] | int = N_PLANES
                           ) -> Int[Array, "*B D n"]:
    """:func:`unpack_planes` in the planes' own channel-major order ``[*B, D, n]``."""
    *batch, d, _, w = planes.shape
    bit_index = jnp.arange(WORD_BITS, dtype=jnp.uint32)
    bits = ((planes[..., None] >> bit_index) & 1).astype(jnp.int32).reshape(*batch, d, N_PLANES, w * WORD_BITS)
    depth = jnp.broadcast_to(jnp.asarray(depth, jnp.int32), (*batch, d))
    plane = jnp.arange(N_PLANES, dtype=jnp.int32)
    # Plane p contributes bit (depth - 1 - p) of the truncated code, and nothing once p >= depth.
    weight = jnp.where(plane < depth[..., None], jnp.left_shift(1, jnp.maximum(depth[..., None] - 1 - plane, 0)), 0)
    return jnp.sum(bits * weight[..., None], axis=-2)


# ----------------------------------------------------------------------------------------------
# Building, reading and appending


def _bad_keys_message(name: str):
    def message(nonfinite, absmax) -> str:
        if int(nonfinite):
            return f"{name} contains {int(nonfinite)} NaN or inf value(s); the key store needs finite keys"
        return f"{name} has |k| up to {float(absmax):.3g}, beyond the fp16 block scale range {FP16_MAX}"

    return message


def _check_finite(name: str, x) -> None:
    """Keys must be finite and within fp16 range: eagerly, or at run time under jit (no cost when they are)."""
    if x.size == 0:
        return
    if is_traced(x):
        finite = jnp.isfinite(x)
        nonfinite = jnp.sum(~finite)
        absmax = jnp.max(jnp.where(finite, jnp.abs(x), 0.0))
    else:
        arr = np.asarray(x, dtype=np.float32)
        finite = np.isfinite(arr)
        nonfinite = np.size(arr) - np.count_nonzero(finite)
        absmax = np.max(np.where(finite, np.abs(arr), 0.0))
    fail_if((nonfinite > 0) | (absmax > FP16_MAX), _bad_keys_message(name), nonfinite, absmax)


def build_store(
    keys: Float[Array, "*B n D"],
    *,
    capacity: int | None = None,
    length: Int[Array, "*B"] | int | None = None,
    rotation: KeyRotation | None = None,
) -> PlaneStore:
    """Quantize and pack ``keys`` into a store with room for ``capacity`` tokens (rounded up to 64).

    ``length`` (default ``n``) marks how many leading tokens of each sequence are valid; the rest are
    ignored (they take no part in the block scales). ``n`` need not be a multiple of 64: the tail block
    is partial, exactly as if those tokens had been appended one by one.
    """
    keys = jnp.asarray(keys)
    if keys.ndim < 2:
        raise ValueError(f"build_store: keys must be [..., n, D], got shape {keys.shape}")
    if not jnp.issubdtype(keys.dtype, jnp.floating):
        raise TypeError(f"build_store: keys must be floating point, got {keys.dtype}")
    *batch, n, d = keys.shape
    capacity = round_capacity(n if capacity is None else capacity)
    if capacity < n:
        raise ValueError(f"build_store: capacity={capacity} is smaller than the {n} keys given")
    _check_finite("build_store: keys", keys)
    if length is None:
        length = jnp.full(batch, n, jnp.int32)
    else:
        length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), batch)
        fail_if((length < 0) | (length > n), lambda got: f"build_store: length must lie in [0, {n}], got {got}", length)

    keys = rotate_keys(keys.astype(jnp.float32), rotation)
    padded = jnp.zeros((*batch, capacity, d), jnp.float32).at[..., :n, :].set(keys)
    valid = jnp.arange(capacity) < length[..., None]
    nb = capacity // BLOCK_TOKENS
    codes, scales = quantize_blocks(
        padded.reshape(*batch, nb, BLOCK_TOKENS, d), valid.reshape(*batch, nb, BLOCK_TOKENS)
    )
    codes = jnp.where(valid.reshape(*batch, nb, BLOCK_TOKENS)[..., None], codes, 0)
    planes = pack_planes(codes.reshape(*batch, capacity, d))

    # The raw keys of the partially filled last block, so that appends can requantize it.
    tail = block_tail(padded, length, BLOCK_TOKENS)
    return PlaneStore(
        planes=planes, scales=jnp.swapaxes(scales, -1, -2), tail=tail, length=length, rotation=rotation
    )


def read_codes(store: PlaneStore | UnpackedStore, depth: Int[Array, "*B D"] | int = N_PLANES) -> Int[Array, "*B n D"]:
    """Truncated codes ``c >> (4 - t_j)`` of every stored token (capacity rows; rows >= length are 0)."""
    if isinstance(store, UnpackedStore):
        depth = jnp.broadcast_to(jnp.asarray(depth, jnp.int32), (*store.batch_shape, store.head_dim))
        return _read_blocks(store, depth).reshape(*store.batch_shape, store.capacity, store.head_dim)
    return unpack_planes(store.planes, depth)


def _valid_blocks(store: PlaneStore | UnpackedStore) -> jax.Array:
    """``[*B, NB, 64, 1]``: which rows, block by block, hold one of the ``length`` tokens."""
    row = jnp.arange(store.num_blocks)[:, None] * BLOCK_TOKENS + jnp.arange(BLOCK_TOKENS)
    return (row < store.length[..., None, None])[..., None]


def _read_blocks(store: UnpackedStore, depth: Int[Array, "*B D"]) -> Int[Array, "*B NB 64 D"]:
    """:func:`read_codes` of an unpacked store, block-major. Every operand enters as a broadcast, so a read
    fuses into one loop over the codes (token-major, the tiled last block was materialized at every read)."""
    *batch, n, d = store.codes.shape
    nb = store.num_blocks
    in_block = (jnp.arange(nb) == (store.length // BLOCK_TOKENS)[..., None])[..., None, None]
    codes = jnp.where(in_block, store.block_codes[..., None, :, :], store.codes.reshape(*batch, nb, BLOCK_TOKENS, d))
    # 4-bit codes: c >> 4 = 0, so depth 0 reads nothing, as from the planes. Rows past the length may
    # hold a longer window's codes (truncate leaves them): they read as 0, as a built store's do.
    return jnp.where(_valid_blocks(store), codes.astype(jnp.int32) >> (N_PLANES - depth[..., None, None, :]), 0)


def token_scales(store: PlaneStore | UnpackedStore) -> Float[Array, "*B n D"]:
    """Each token's block scale, broadcast to token-major ``[*B, capacity, D]`` (f32)."""
    per_block = jnp.swapaxes(store.scales, -1, -2).astype(jnp.float32)  # [*B, NB, D]
    return jnp.repeat(per_block, BLOCK_TOKENS, axis=-2)


def dequantize(store: PlaneStore | UnpackedStore, depth: Int[Array, "*B D"] | int = N_PLANES) -> Float[Array, "*B n D"]:
    """Keys as read to per-channel depth ``depth`` (in the store's basis), ``[*B, capacity, D]``.

    ``depth`` must lie in [0, 4]: a ValueError when concrete. Traced depths come from a planner on the
    decode path, where a host check per step would cost a sync, so a channel read at an out-of-range
    depth comes out NaN rather than as a plausible wrong value.
    """
    _check_depth("dequantize", depth)
    depth = jnp.broadcast_to(jnp.asarray(depth, jnp.int32), (*store.batch_shape, store.head_dim))
    if isinstance(store, UnpackedStore):  # block by block: the block scales broadcast over their 64 rows
        scales = jnp.swapaxes(store.scales, -1, -2).astype(jnp.float32)[..., None, :]  # [*B, NB, 1, D]
        values = dequantize_codes(_read_blocks(store, depth), scales, depth[..., None, None, :])
        values = jnp.where(_valid_blocks(store), values, 0.0).reshape(*store.batch_shape, store.capacity, -1)
    else:
        values = dequantize_codes(read_codes(store, depth), token_scales(store), depth[..., None, :])
        valid = jnp.arange(store.capacity) < store.length[..., None]
        values = jnp.where(valid[..., None], values, 0.0)
    bad_depth = ((depth < 0) | (depth > N_PLANES))[..., None, :]
    return jnp.where(bad_depth, jnp.nan, values)


def dequantize_levels(store: UnpackedStore) -> Float[Array, "*B n D 4"]:
    """:func:`dequantize` at each uniform depth t = 1..4 (``[..., t - 1]``), the same values, in one pass."""
    depth = jnp.arange(1, N_PLANES + 1, dtype=jnp.int32)
    codes = _read_blocks(store, jnp.full((*store.batch_shape, store.head_dim), N_PLANES, jnp.int32))
    scales = jnp.swapaxes(store.scales, -1, -2).astype(jnp.float32)[..., None, :, None]  # [*B, NB, 1, D, 1]
    values = dequantize_codes(codes[..., None] >> (N_PLANES - depth), scales, depth)
    values = jnp.where(_valid_blocks(store)[..., None], values, 0.0)
    return values.reshape(*store.batch_shape, store.capacity, store.head_dim, N_PLANES)


def dequantize_block(store: UnpackedStore, depth: Int[Array, "*B D"] | int = N_PLANES) -> Float[Array, "*B 64 D"]:
    """:func:`dequantize`'s rows of block ``length // 64``, the partially filled one (rows past the length are 0):
    all that differs between the cuts of one window (:func:`truncate`) besides the rows they drop."""
    _check_depth("dequantize_block", depth)
    depth = jnp.broadcast_to(jnp.asarray(depth, jnp.int32), (*store.batch_shape, store.head_dim))
    block = store.length // BLOCK_TOKENS
    # length = capacity: there is no such block and every row is past the length (any scale will do).
    at = jnp.minimum(block, store.num_blocks - 1)[..., None, None]
    scale = jnp.take_along_axis(store.scales, at, axis=-1)[..., 0].astype(jnp.float32)  # [*B, D]
    valid = (block[..., None] * BLOCK_TOKENS + jnp.arange(BLOCK_TOKENS) < store.length[..., None])[..., None]
    codes = jnp.where(valid, store.block_codes.astype(jnp.int32) >> (N_PLANES - depth[..., None, :]), 0)
    values = jnp.where(valid, dequantize_codes(codes, scale[..., None, :], depth[..., None, :]), 0.0)
    bad_depth = ((depth < 0) | (depth > N_PLANES))[..., None, :]
    return jnp.where(bad_depth, jnp.nan, values)


def dequantize_channels(store: PlaneStore, depth: Int[Array, "*B D"] | int = N_PLANES) -> Float[Array, "*B D n"]:
    """:func:`dequantize` in the planes' channel-major order ``[*B, D, capacity]`` (the same values): what a
    scan that contracts over channels reads without transposing the codes of every token first."""
    _check_depth("dequantize_channels", depth)
    depth = jnp.broadcast_to(jnp.asarray(depth, jnp.int32), (*store.batch_shape, store.head_dim))
    codes = unpack_planes_channels(store.planes, depth)
    scales = jnp.repeat(store.scales.astype(jnp.float32), BLOCK_TOKENS, axis=-1)
    values = dequantize_codes(codes, scales, depth[..., None])
    valid = jnp.arange(store.capacity) < store.length[..., None]
    return jnp.where(valid[..., None, :], values, 0.0)


def append_block(
    tail: Float[Array, "64 D"], length: Int[Array, ""], key: Float[Array, "D"]
) -> tuple[UInt32[Array, "D 4 2"], Float16[Array, "D"], Float[Array, "64 D"]]:
    """The last block after appending one key (already in the store's basis) at position ``length``.

    Returns the block's plane words (the two words of each plane at word ``2 * (length // 64)``), its fp16
    scales and the new raw tail. This is all an append changes, so a decode step can score the newest
    block from these and write them to the store (wherever it lives) afterwards.
    """
    offset = length % BLOCK_TOKENS
    tail = jnp.where(offset == 0, 0.0, tail).at[offset].set(key)
    words, scale = pack_block(tail, offset + 1)
    return words, scale, tail


def pack_block(tail: Float[Array, "64 D"], count: Int[Array, ""]) -> tuple[UInt32[Array, "D 4 2"], Float16[Array, "D"]]:
    """Plane words and fp16 scales of one block whose first ``count`` rows of ``tail`` are valid.

    The same arithmetic as :func:`build_store` applies to that block, so the result is its block, bit for bit.
    """
    valid = jnp.arange(BLOCK_TOKENS) < count
    codes, scale = quantize_blocks(tail, valid)
    codes = jnp.where(valid[:, None], codes, 0)
    return pack_planes(codes), scale


def truncate(store: PlaneStore | UnpackedStore, keys: Float[Array, "*B n D"], length: Int[Array, "*B"]
             ) -> PlaneStore | UnpackedStore:
    """The store of the first ``length`` tokens, from the store of all the ``keys`` it was built from.

    Equals ``build_store(keys, length=length, rotation=store.rotation)`` (same capacity) bit for bit
    (unpacked, if ``store`` is): the complete blocks before ``length`` are shared, only the block holding
    token ``length - 1`` is requantized (from its raw keys, rotated per token as the build does) and
    later blocks are emptied. This makes the fidelity protocol (the store a decode loop holds at every
    position) cost one block per position instead of the whole window. ``length`` must not exceed the
    number of keys.
    """
    keys = jnp.asarray(keys, jnp.float32)
    *batch, n, d = keys.shape
    if tuple(batch) != store.batch_shape or d != store.head_dim or n > store.capacity:
        raise ValueError(f"truncate: keys {keys.shape} do not match the store (batch {store.batch_shape}, "
                         f"D = {store.head_dim}, capacity {store.capacity})")
    length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), store.batch_shape)
    count = length % BLOCK_TOKENS
    valid = jnp.arange(BLOCK_TOKENS) < count[..., None]
    # Rotate the block's rows only: rotate_keys gives every token the same result whatever the batch.
    tail = jnp.where(valid[..., None], rotate_keys(block_tail(keys, length, BLOCK_TOKENS), store.rotation), 0.0)
    codes, scale = quantize_blocks(tail, valid)
    codes = jnp.where(valid[..., None], codes, 0)  # [*B, 64, D]
    block = (length // BLOCK_TOKENS)[..., None, None]  # [*B, 1, 1]: the block holding the last token
    nb = store.num_blocks
    scale_block = jnp.arange(nb)
    scales = jnp.where(scale_block < block, store.scales,
                       jnp.where(scale_block == block, scale[..., None], jnp.float16(0)))
    if isinstance(store, UnpackedStore):  # the complete blocks stay in codes, shared with the longer store
        # Materialized here: fused into a read, XLA requantized the block for every one of the window's blocks.
        block_codes, scales = jax.lax.optimization_barrier((codes.astype(jnp.uint8), scales))
        return UnpackedStore(codes=store.codes, block_codes=block_codes, scales=scales, tail=tail, length=length,
                             rotation=store.rotation)
    words = pack_planes(codes)  # [*B, D, 4, 2]
    word_block = jnp.arange(store.planes.shape[-1]) // fmt.WORDS_PER_BLOCK
    block_words = jnp.tile(words, (1,) * (words.ndim - 1) + (nb,))
    planes = jnp.where(word_block < block[..., None], store.planes,
                       jnp.where(word_block == block[..., None], block_words, jnp.uint32(0)))
    return PlaneStore(planes=planes, scales=scales, tail=tail, length=length, rotation=store.rotation)


def _append_one(planes, scales, tail, length, key):
    """Append one key ``[D]`` to one sequence and requantize its last block."""
    words, scale, tail = append_block(tail, length, key)
    block = length // BLOCK_TOKENS
    planes = jax.lax.dynamic_update_slice(planes, words, (0, 0, block * fmt.WORDS_PER_BLOCK))
    scales = jax.lax.dynamic_update_slice(scales, scale[:, None], (0, block))
    return planes, scales, tail, length + 1


def check_capacity(length: Int[Array, "*B"], m: int, capacity: int) -> None:
    """Raise if appending ``m`` tokens to sequences of ``length`` would pass ``capacity``.

    Eagerly when lengths are concrete; under tracing at run time (:func:`fathom_jax.checks.fail_if`:
    costs nothing unless the overflow happens).
    """
    top = jnp.max(jnp.asarray(length)) if is_traced(length) else int(np.max(np.asarray(length), initial=0))
    fail_if(top + m > capacity, lambda top: (
        f"append: {int(top) + m - capacity} token(s) past capacity (length {int(top)}, capacity {capacity}); "
        "build the store with a larger capacity"), top)


def block_tail(keys: Float[Array, "*B n D"], length: Int[Array, "*B"], block: int) -> Float[Array, "*B block D"]:
    """Raw keys of each sequence's last, partially filled ``block``-token block (zeros past ``length``;
    ``length`` at most ``n``, which need not be a whole number of blocks)."""
    n = keys.shape[-2]
    idx = (length // block * block)[..., None] + jnp.arange(block)
    tail = jnp.take_along_axis(keys, jnp.minimum(idx, n - 1)[..., None], axis=-2)
    return jnp.where((idx < length[..., None])[..., None], tail, 0.0)


def append(store: PlaneStore, keys: Float[Array, "*B m D"], *, check: bool = True) -> PlaneStore:
    """Append ``m`` keys to every sequence of the store (requantizing each partial block).

    Appending past capacity, or a NaN/inf key, is an error: raised at call time when values are
    concrete, and at run time (through a host callback that fires only on error) when traced, unless
    ``check=False`` for loops whose bounds and keys were checked before entering them.
    """
    keys = jnp.asarray(keys)
    expect = (*store.batch_shape, keys.shape[-2] if keys.ndim >= 2 else -1, store.head_dim)
    if keys.ndim != len(store.batch_shape) + 2 or keys.shape[:-2] != store.batch_shape or keys.shape[-1] != store.head_dim:
        raise ValueError(f"append: keys must have shape [*batch, m, D] = {expect}, got {keys.shape}")
    m = keys.shape[-2]
    capacity = store.capacity
    if check:
        check_capacity(store.length, m, capacity)
        _check_finite("append: keys", keys)

    keys = rotate_keys(keys.astype(jnp.float32), store.rotation)
    batch = store.batch_shape
    flat = lambda x: x.reshape(-1, *x.shape[len(batch):])
    planes, scales, tail, length = flat(store.planes), flat(store.scales), flat(store.tail), store.length.reshape(-1)
    step = jax.vmap(_append_one)

    def body(i, carry):
        return step(*carry, flat(keys)[:, i])

    planes, scales, tail, length = jax.lax.fori_loop(0, m, body, (planes, scales, tail, length))
    unflat = lambda x: x.reshape(*batch, *x.shape[1:])
    return PlaneStore(
        planes=unflat(planes), scales=unflat(scales), tail=unflat(tail), length=length.reshape(batch),
        rotation=store.rotation,
    )

