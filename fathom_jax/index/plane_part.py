"""The plane-store part: 4-bit codes as bit planes, of the keys or of a calibration rotation of them."""

from __future__ import annotations

import dataclasses
from typing import Callable

from fathom_jax import format as fmt
from fathom_jax import store as store_lib
from fathom_jax.calibrate import Calibration
from fathom_jax.format import BLOCK_TOKENS, N_PLANES
from fathom_jax.index.part import IndexPart
from fathom_jax.index.plane_stacking import OneTier, TwoTiers, packed_tails, stacking
from fathom_jax.store import KeyRotation


@dataclasses.dataclass(frozen=True)
class Planes(IndexPart):
    """4-bit codes stored as bit planes: of the keys (``rotation=None``) or of ``(k - mean) @ basis`` for the
    rotation a calibration gives (``rotation(calib)``: Fathom KLT's, Loki's). In a decode cache whose placement keeps
    resident planes in device memory (:meth:`placed`), the planes are stacked in one tier or two
    (:mod:`fathom_jax.index.plane_stacking`)."""

    name: str
    rotation: Callable[[Calibration], KeyRotation] | None = None
    resident: tuple[int, ...] = ()  # a decode cache's planes [0, p_l) of layer l in device memory (placed)
    warm: int = 0  # and its warm channel planes per layer and group (placed)

    @property
    def writes_per_token(self) -> int:  # type: ignore[override]
        return self.stacking.writes_per_token

    @property
    def kind(self) -> str:
        return "planes"

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.rotation is not None

    def build(self, keys, calib, *, capacity, length):
        rotation = None if self.rotation is None else self.rotation(calib)
        return store_lib.build_store(keys, capacity=capacity, length=length, rotation=rotation)

    def append(self, data, keys, length):
        return store_lib.append(data, keys, check=False)

    def prefix(self, data, keys, length):
        return store_lib.truncate(data, keys, length)

    def unpack(self, data):
        return store_lib.unpack_store(data)

    def bulk(self, data):
        return self.stacking.bulk(data)

    def nbytes(self, *, capacity, head_dim):
        return head_dim * (N_PLANES * fmt.plane_words(capacity) * 4 + capacity // BLOCK_TOKENS * 2)

    # -- a stacked decode cache: where its planes sit is the stacking's (one tier or two) ------------------
    def placed(self, resident: tuple[int, ...], warm: int = 0) -> "Planes":
        if warm and self.rotation is not None:
            raise ValueError(f"warm_planes={warm}: warm planes are chosen by the raw keys' importance; the plane store "
                             f"{self.name!r} holds rotated keys (use them with Fathom's raw planes)")
        return dataclasses.replace(self, resident=tuple(resident), warm=warm)

    @property
    def stacking(self) -> OneTier | TwoTiers:
        return stacking(self.resident, self.warm)

    def bulk_bytes(self, *, layers, capacity, head_dim):
        return self.stacking.bulk_bytes(self, layers=layers, capacity=capacity, head_dim=head_dim)

    def empty(self, alloc, length, *, layers, groups, capacity, head_dim):
        return self.stacking.empty(alloc, length, rotated=self.rotation is not None, layers=layers, groups=groups,
                                   capacity=capacity, head_dim=head_dim)

    def write_layer(self, write, stacked, built, layer, length, *, importance=None):
        return self.stacking.write_layer(write, stacked, built, layer, length, importance)

    def add_token(self, stacked, layer, position, key):
        return self.stacking.add_token(stacked, layer, position, key)

    def write_token(self, write, stacked, block, position, layer, due):
        return self.stacking.write_blocks(write, stacked, block.words, block.scale, position // BLOCK_TOKENS, due,
                                          layer)

    def commit(self, stacked, block, length):
        return dataclasses.replace(stacked, tail=block.tail, length=length)

    def flush(self, write, stacked, length):
        """Every layer's partial newest block packed from its raw tail and written."""
        words, scale, block, due = packed_tails(stacked, length)
        return self.stacking.write_blocks(write, stacked, words, scale, block, due, 0)
