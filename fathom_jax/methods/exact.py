"""The exact top-k oracle and dense attention: both read the bf16 keys themselves."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from fathom_jax import format as fmt
from fathom_jax.index.parts import KEYS
from fathom_jax.methods.base import KeyRead, ScanMethod


@dataclasses.dataclass(frozen=True)
class Exact(ScanMethod):
    """Exact scores ``q . k``: the top-k oracle every scan is measured against (16 D bits per token)."""

    name: ClassVar[str] = "exact"
    parts: ClassVar[frozenset[str]] = frozenset({KEYS})
    spec_syntax: ClassVar[str] = "exact"
    summary: ClassVar[str] = "exact scores from the keys (the top-k oracle)"

    @property
    def label(self) -> str:
        return "exact top-k oracle"

    def fixed_bits_per_token(self, head_dim: int) -> float:
        return fmt.key_bits_per_token(head_dim)

    def read(self, q, index, calib, *, implementation=None):
        bits = jnp.full(q.shape[:-2], self.fixed_bits_per_token(q.shape[-1]), jnp.float32)
        return KeyRead(q, bits, dense=self.selects_all)


@dataclasses.dataclass(frozen=True)
class Dense(Exact):
    """Attention over every cached token (no selection); its scan reads the keys like the oracle's."""

    name: ClassVar[str] = "dense"
    spec_syntax: ClassVar[str] = "dense"
    summary: ClassVar[str] = "attention over every token (no selection)"
    selects_all: ClassVar[bool] = True

    @property
    def label(self) -> str:
        return "dense"
