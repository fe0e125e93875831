"""Uniform-depth reads: every channel at the same number of planes (the 2-bit thumbnail, the full 4-bit scan)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from fathom_jax import format as fmt
from fathom_jax.format import N_PLANES
from fathom_jax.index.parts import RAW
from fathom_jax.methods.base import PlaneRead, ScanMethod, parse_int, uniform_depths


@dataclasses.dataclass(frozen=True)
class Thumbnail(ScanMethod):
    """Every channel at ``depth`` planes (default 2: the 2-bit thumbnail)."""

    depth: int = 2

    name: ClassVar[str] = "thumbnail"
    parts: ClassVar[frozenset[str]] = frozenset({RAW})
    spec_syntax: ClassVar[str] = "thumbnail[:DEPTH]"
    summary: ClassVar[str] = "every channel at DEPTH planes (default 2)"

    def __post_init__(self):
        if not isinstance(self.depth, int) or isinstance(self.depth, bool) or not 1 <= self.depth <= N_PLANES:
            raise ValueError(f"Thumbnail: depth must be an int in [1, {N_PLANES}], got {self.depth!r}")

    @property
    def label(self) -> str:
        return f"{self.depth}-bit thumbnail"

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.depth}"

    @classmethod
    def from_spec_args(cls, args, spec):
        if len(args) > 1:
            raise ValueError(f"bad method spec {spec!r}: expected {cls.spec_syntax}")
        return cls(parse_int(args[0], "depth", spec)) if args else cls()

    def fixed_bits_per_token(self, head_dim: int) -> float:
        return fmt.channel_bits_per_token(head_dim, self.depth)

    def read(self, q, index, calib, *, implementation=None):
        depths = uniform_depths(q.shape[:-2] + q.shape[-1:], self.depth)
        return PlaneRead(q, depths, fmt.bits_per_token(depths), part="raw", max_active=q.shape[-1])


@dataclasses.dataclass(frozen=True)
class Full4(Thumbnail):
    """All channels at 4 planes: the full 4-bit scan."""

    depth: int = dataclasses.field(default=N_PLANES, init=False)

    name: ClassVar[str] = "full4"
    spec_syntax: ClassVar[str] = "full4"
    summary: ClassVar[str] = "every channel at 4 bits"

    @property
    def label(self) -> str:
        return "full 4-bit scan"

    @property
    def spec(self) -> str:
        return self.name

    @classmethod
    def from_spec_args(cls, args, spec):
        return super(Thumbnail, cls).from_spec_args(args, spec)
