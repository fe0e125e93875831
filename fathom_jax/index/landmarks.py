"""Landmark upkeep: the fp16 mean key of every 8-token block, built at once or appended token by token.

The mean is over the block's valid tokens. Its sum is an explicit left fold, so that building at once
and appending (one block at a time) add in the same order and round the same way: the index after
appends equals the index built from all keys, bit for bit. The raw keys of the partially filled last
block (``tail``) are kept so an append can recompute that block's mean, as the plane store's ``tail``
does for its 64-token block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float16, Int

from fathom_jax.format import LANDMARK_TOKENS


def block_mean(blocks: Float[Array, "... 8 D"], count: Float[Array, "..."]) -> Float16[Array, "... D"]:
    """fp16 mean of ``[..., 8, D]`` blocks (invalid rows zero) over ``count`` valid rows."""
    total = blocks[..., 0, :]
    for i in range(1, LANDMARK_TOKENS):
        total = total + blocks[..., i, :]
    return (total / jnp.maximum(count, 1.0)[..., None]).astype(jnp.float16)


def build(keys: Float[Array, "*B n D"], length: Int[Array, "*B"]) -> Float16[Array, "*B NL D"]:
    """fp16 mean of each 8-token block over its valid tokens, ``[*B, n / 8, D]``."""
    *batch, n, d = keys.shape
    nl = n // LANDMARK_TOKENS
    valid = jnp.arange(n) < length[..., None]
    blocks = jnp.where(valid[..., None], keys, 0.0).reshape(*batch, nl, LANDMARK_TOKENS, d)
    count = jnp.sum(valid.reshape(*batch, nl, LANDMARK_TOKENS), axis=-1).astype(jnp.float32)
    return block_mean(blocks, count)


def truncate(landmarks: Float16[Array, "*B NL D"], tail: Float[Array, "*B 8 D"], length: Int[Array, "*B"]
             ) -> Float16[Array, "*B NL D"]:
    """The landmarks of the first ``length`` tokens, from those of a longer prefix of the same keys.

    ``tail`` holds the raw keys of the 8-token block at ``length`` (zeros from ``length`` on, as
    :func:`fathom_jax.store.block_tail` gives). Equals :func:`build` with ``length``, bit for bit: earlier
    blocks are complete and shared, that block's mean is recomputed, later blocks are emptied.
    """
    count = (length % LANDMARK_TOKENS).astype(jnp.float32)
    block = (length // LANDMARK_TOKENS)[..., None, None]
    index = jnp.arange(landmarks.shape[-2])[:, None]
    mean = block_mean(tail, count)[..., None, :]
    return jnp.where(index < block, landmarks, jnp.where(index == block, mean, jnp.float16(0)))


def append_block(
    tail: Float[Array, "8 D"], length: Int[Array, ""], key: Float[Array, "D"]
) -> tuple[Float16[Array, "D"], Float[Array, "8 D"]]:
    """The landmark of the last block after appending one key at ``length``, and the new raw tail."""
    offset = length % LANDMARK_TOKENS
    tail = jnp.where(offset == 0, 0.0, tail).at[offset].set(key)
    return block_mean(tail, (offset + 1).astype(jnp.float32)), tail


def append_one(landmarks: Float16[Array, "NL D"], tail, length, key):
    """Append one key ``[D]`` to one sequence's landmarks (recompute its 8-token block)."""
    mean, tail = append_block(tail, length, key)
    landmarks = jax.lax.dynamic_update_slice(landmarks, mean[None], (length // LANDMARK_TOKENS, 0))
    return landmarks, tail
