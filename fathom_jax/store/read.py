"""Reads of a key store: the codes and values of every token at per-channel read depths.

A read at depth ``t_j`` gives channel ``j`` its ``t_j``-bit quantizer (:mod:`fathom_jax.store.quantizer`); depths
must lie in 0..4. Concrete depths outside that range raise :class:`~fathom_jax.checks.CheckError`. Traced
depths (a planner's, on the decode path) are checked only in checkify mode (:mod:`fathom_jax.checks`); by
default a channel read at an out-of-range depth comes out NaN in :func:`dequantize` and its relatives,
rather than as a plausible wrong value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from fathom_jax.format import BLOCK_TOKENS, N_PLANES
from fathom_jax.store.layout import PlaneStore, UnpackedStore
from fathom_jax.store.quantizer import check_depth, check_depth_shape, dequantize_codes, unpack_planes, unpack_planes_channels


def _depths(name: str, store: PlaneStore | UnpackedStore, depth) -> Int[Array, "*B D"]:
    """``depth`` checked (dtype, shape, range: see the module docstring) and broadcast to ``[*B, D]``."""
    check_depth(name, depth)
    check_depth_shape(name, depth, store.batch_shape, store.head_dim)
    return jnp.broadcast_to(jnp.asarray(depth, jnp.int32), (*store.batch_shape, store.head_dim))


def _nan_where_out_of_range(values, depth, axis: int):
    """The documented default for traced out-of-range depths: those channels read NaN."""
    bad = jnp.expand_dims((depth < 0) | (depth > N_PLANES), axis)
    return jnp.where(bad, jnp.nan, values)


def read_codes(store: PlaneStore | UnpackedStore, depth: Int[Array, "*B D"] | int = N_PLANES) -> Int[Array, "*B n D"]:
    """Truncated codes ``c >> (4 - t_j)`` of every stored token (capacity rows; rows >= length are 0).

    Codes have no NaN: a traced depth outside 0..4 reads meaningless codes unless checkify mode checks it."""
    depth = _depths("read_codes", store, depth)
    if isinstance(store, UnpackedStore):
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

    ``depth`` (integers, broadcasting to ``[*B, D]``) must lie in [0, 4]: a CheckError when concrete. Traced
    depths come from a planner on the decode path, where a host check per step would cost a sync: a channel
    read at an out-of-range depth comes out NaN rather than as a plausible wrong value, and
    :func:`fathom_jax.checks.checked` raises the CheckError instead.
    """
    return _dequantize(store, _depths("dequantize", store, depth))


@jax.jit
def _dequantize(store: PlaneStore | UnpackedStore, depth):
    # One program per store shape: eager callers (tests, notebooks) compiled each op on its own.
    if isinstance(store, UnpackedStore):  # block by block: the block scales broadcast over their 64 rows
        scales = jnp.swapaxes(store.scales, -1, -2).astype(jnp.float32)[..., None, :]  # [*B, NB, 1, D]
        values = dequantize_codes(_read_blocks(store, depth), scales, depth[..., None, None, :])
        values = jnp.where(_valid_blocks(store), values, 0.0).reshape(*store.batch_shape, store.capacity, -1)
    else:
        values = dequantize_codes(unpack_planes(store.planes, depth), token_scales(store), depth[..., None, :])
        valid = jnp.arange(store.capacity) < store.length[..., None]
        values = jnp.where(valid[..., None], values, 0.0)
    return _nan_where_out_of_range(values, depth, -2)


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
    all that differs between the cuts of one window (:func:`fathom_jax.store.truncate`) besides the rows they drop."""
    depth = _depths("dequantize_block", store, depth)
    block = store.length // BLOCK_TOKENS
    # length = capacity: there is no such block and every row is past the length (any scale will do).
    at = jnp.minimum(block, store.num_blocks - 1)[..., None, None]
    scale = jnp.take_along_axis(store.scales, at, axis=-1)[..., 0].astype(jnp.float32)  # [*B, D]
    valid = (block[..., None] * BLOCK_TOKENS + jnp.arange(BLOCK_TOKENS) < store.length[..., None])[..., None]
    codes = jnp.where(valid, store.block_codes.astype(jnp.int32) >> (N_PLANES - depth[..., None, :]), 0)
    values = jnp.where(valid, dequantize_codes(codes, scale[..., None, :], depth[..., None, :]), 0.0)
    return _nan_where_out_of_range(values, depth, -2)


def dequantize_channels(store: PlaneStore, depth: Int[Array, "*B D"] | int = N_PLANES) -> Float[Array, "*B D n"]:
    """:func:`dequantize` in the planes' channel-major order ``[*B, D, capacity]`` (the same values): what a
    scan that contracts over channels reads without transposing the codes of every token first."""
    depth = _depths("dequantize_channels", store, depth)
    codes = unpack_planes_channels(store.planes, depth)
    scales = jnp.repeat(store.scales.astype(jnp.float32), BLOCK_TOKENS, axis=-1)
    values = dequantize_codes(codes, scales, depth[..., None])
    valid = jnp.arange(store.capacity) < store.length[..., None]
    return _nan_where_out_of_range(jnp.where(valid[..., None, :], values, 0.0), depth, -1)
