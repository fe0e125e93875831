"""SparQ: the r channels of largest |q|, read at 4 bits (grouped-query rule and the per-head union)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from fathom_jax import format as fmt
from fathom_jax.format import N_PLANES
from fathom_jax.index.parts import RAW
from fathom_jax.methods.base import PlaneRead, ScanMethod, int_param, parse_int, top_r_mask


@dataclasses.dataclass(frozen=True)
class _ChannelMethod(ScanMethod):
    """A fixed number ``r`` of channels read at 4 bits."""

    r: int

    parts: ClassVar[frozenset[str]] = frozenset({RAW})
    _param: ClassVar[str] = "r"

    def __post_init__(self):
        int_param(self.r, self._param, type(self).__name__, minimum=1)

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.r}"

    @classmethod
    def from_spec_args(cls, args, spec):
        if len(args) != 1:
            raise ValueError(f"bad method spec {spec!r}: expected {cls.spec_syntax}")
        return cls(parse_int(args[0], cls._param, spec))

    def validate(self, head_dim: int) -> None:
        if self.r > head_dim:
            raise ValueError(f"{self.label}: {self._param} must be <= D = {head_dim}, got {self.r}")

    def fixed_bits_per_token(self, head_dim: int) -> float | None:
        return fmt.channel_bits_per_token(self.r)

    def max_active(self, head_dim: int) -> int:
        return min(self.r, head_dim)

    def _read_channels(self, q, mask, part="raw", queries=None, shift=None):
        depths = jnp.where(mask, N_PLANES, 0).astype(jnp.int32)
        queries = q if queries is None else queries
        return PlaneRead(queries, depths, fmt.bits_per_token(depths), shift, part=part,
                         max_active=self.max_active(q.shape[-1]))


@dataclasses.dataclass(frozen=True)
class SparQ(_ChannelMethod):
    """Grouped-query rule: ``sum_h |q_j|`` over the group, top-r channels per KV head (ties by lower
    channel index, as ``lax.top_k`` and Appendix A), read at 4 bits by every head."""

    name: ClassVar[str] = "sparq"
    spec_syntax: ClassVar[str] = "sparq:R"
    summary: ClassVar[str] = "the R channels of largest group |q|, at 4 bits"

    @property
    def label(self) -> str:
        return f"SparQ r={self.r}"

    def read(self, q, index, calib, *, implementation=None):
        return self._read_channels(q, top_r_mask(jnp.sum(jnp.abs(q), axis=-2), self.r))


@dataclasses.dataclass(frozen=True)
class SparQUnion(_ChannelMethod):
    """Each head picks its own top-r of ``|q_j|`` and scores with its own r channels; the union of the
    picks is what is read and what the bits count (as in the authors' ablation)."""

    name: ClassVar[str] = "sparq_union"
    spec_syntax: ClassVar[str] = "sparq_union:R"
    summary: ClassVar[str] = "SparQ with per-head picks, reading their union"

    @property
    def label(self) -> str:
        return f"SparQ r={self.r} per-head union"

    def fixed_bits_per_token(self, head_dim):
        return None  # the union's size depends on the heads' overlap

    def max_active(self, head_dim):
        return head_dim

    def read(self, q, index, calib, *, implementation=None):
        head_mask = top_r_mask(jnp.abs(q), self.r)  # [*B, G, D]
        return self._read_channels(q, jnp.any(head_mask, axis=-2), queries=jnp.where(head_mask, q, 0.0))
