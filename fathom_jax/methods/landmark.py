"""The block landmark (ShadowKV-style): the fp16 mean key of every 8-token block."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from fathom_jax import format as fmt
from fathom_jax.format import LANDMARK_TOKENS
from fathom_jax.index.parts import LANDMARKS
from fathom_jax.methods.base import BlockRead, ScanMethod


@dataclasses.dataclass(frozen=True)
class Landmark(ScanMethod):
    """Every token gets its block's score ``q . landmark``; ``16 D / 8`` bits per token. The mean is over
    the block's valid tokens (the authors zero-pad a partial last block and divide by 8); ties inside a
    block are left to the selection (lower positions first, as the authors' tiny within-block ramp)."""

    name: ClassVar[str] = "landmark"
    parts: ClassVar[frozenset[str]] = frozenset({LANDMARKS})
    spec_syntax: ClassVar[str] = "landmark"
    summary: ClassVar[str] = "fp16 mean key of every 8-token block"

    @property
    def label(self) -> str:
        return "block landmark"

    def fixed_bits_per_token(self, head_dim: int) -> float:
        return fmt.landmark_bits_per_token(head_dim)

    def read(self, q, index, calib, *, implementation=None):
        bits = jnp.full(q.shape[:-2], self.fixed_bits_per_token(q.shape[-1]), jnp.float32)
        return BlockRead(q, bits, part=LANDMARKS.name, block=LANDMARK_TOKENS)
