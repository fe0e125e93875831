"""The key-index format in one place: block size, planes, word and scale bits, landmark size, byte counts.

Every module of the library that lays out, reads or counts the index (the store, the planner, the scan methods)
takes these numbers from here; the three the kernels are built for (block, planes, word) are defined beside them
(``pallas_kernels.plane_layout``) and re-exported here.

* Tokens are grouped in blocks of :data:`BLOCK_TOKENS`; every (block, channel) has one fp16 absmax
  scale (:data:`SCALE_BITS` bits) and 4-bit codes (:data:`N_PLANES` bit planes, MSB first).
* A plane of one channel is packed :data:`WORD_BITS` tokens per uint32 word, so a 64-token block is
  :data:`WORDS_PER_BLOCK` words of every plane.
* The landmark baseline keeps the fp16 mean of every :data:`LANDMARK_TOKENS`-token block; Quest the fp16
  per-channel min and max key of every page (:data:`QUEST_PAGE_TOKENS` tokens by default); the exact
  oracle and dense attention read :data:`KEY_BITS`-bit keys.

Byte convention (the paper's; bits per token per KV head per layer): the code bits read, plus
``SCALE_BITS / BLOCK_TOKENS`` = 0.25 bits per token for the fp16 scale of every channel read. At
D = 128: 32 channels x 4 bits = 136, 16 channels = 68, the 2-bit thumbnail 288, the full 4-bit scan 544,
the fp16 8-token landmark 256, Quest's fp16 min and max per 16-token page 256 (512 at 8 tokens), bf16 keys 2048.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels.plane_layout import BLOCK_TOKENS, N_PLANES, WORD_BITS  # noqa: F401 (re-exported)

WORDS_PER_BLOCK = BLOCK_TOKENS // WORD_BITS
SCALE_BITS = 16  # fp16 block scale
LANDMARK_TOKENS = 8  # tokens per landmark (block-mean) key
QUEST_PAGE_TOKENS = 16  # tokens per Quest page (min and max key) by default, as the Quest paper
KEY_BITS = 16  # bf16 keys read by the exact oracle and dense attention
FP16_MAX = float(np.finfo(np.float16).max)
SCALE_BITS_PER_TOKEN = SCALE_BITS / BLOCK_TOKENS  # per channel read


def bits_per_token(depths: Int[Array, "... D"]) -> Float[Array, "..."]:
    """Code bits read plus the fp16 scale of every channel read, per token (the paper's convention)."""
    depths = jnp.asarray(depths)
    active = jnp.sum(depths > 0, axis=-1).astype(jnp.float32)
    return jnp.sum(depths, axis=-1).astype(jnp.float32) + active * SCALE_BITS_PER_TOKEN


def channel_bits_per_token(channels: int, depth: int = N_PLANES) -> float:
    """Bits per token of a fixed read of ``channels`` channels at ``depth`` planes each."""
    return float(depth * channels + channels * SCALE_BITS_PER_TOKEN)


def landmark_bits_per_token(head_dim: int) -> float:
    return float(KEY_BITS * head_dim / LANDMARK_TOKENS)


def quest_bits_per_token(head_dim: int, page: int = QUEST_PAGE_TOKENS) -> float:
    """An fp16 min and max of every channel per ``page`` tokens: ``2 x 16 D / page``."""
    return float(2 * KEY_BITS * head_dim / page)


def key_bits_per_token(head_dim: int) -> float:
    return float(KEY_BITS * head_dim)


def round_capacity(n: int) -> int:
    """Tokens rounded up to whole blocks (at least one block)."""
    return max(BLOCK_TOKENS, -(-int(n) // BLOCK_TOKENS) * BLOCK_TOKENS)


def plane_words(capacity: int) -> int:
    """uint32 words in one plane of one channel."""
    return capacity // WORD_BITS


def plane_run_bytes(capacity: int) -> int:
    """Bytes of one plane of one channel: the unit of a contiguous read (4 KiB at 32k, 128 KiB at 1M)."""
    return capacity // 8


def scale_run_bytes(capacity: int) -> int:
    """Bytes of one channel's fp16 block scales (the second run of a channel read)."""
    return capacity // BLOCK_TOKENS * SCALE_BITS // 8
