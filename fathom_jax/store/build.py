"""Building a store from keys, appending decode tokens to it, cutting it to a shorter length.

A serving cache also appends decode tokens: the last block's scale changes as it fills, so ``append``
requantizes that block from the raw keys kept in ``tail``. Building from all keys at once and
appending them one by one give the same store, bit for bit.

Keys must be finite and within fp16 range, and appends must stay within capacity: a
:class:`~fathom_jax.checks.CheckError` eagerly, and under ``jit`` at run time (:mod:`fathom_jax.checks`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Float16, Int, UInt32

from fathom_jax import format as fmt
from fathom_jax.checks import fail_if, is_traced
from fathom_jax.format import BLOCK_TOKENS, FP16_MAX, round_capacity
from fathom_jax.store.layout import KeyRotation, PlaneStore, UnpackedStore, rotate_keys
from fathom_jax.store.quantizer import block_tail, pack_block, pack_planes, quantize_blocks, unpack_planes


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
# Building, appending and truncating


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

    return _build(keys, length, rotation, capacity=capacity)


@functools.partial(jax.jit, static_argnames="capacity")
def _build(keys, length, rotation, *, capacity: int) -> PlaneStore:
    """The store of checked keys, one program per shape (eager callers would otherwise compile every op)."""
    *batch, n, d = keys.shape
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

