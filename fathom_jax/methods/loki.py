"""Loki: the first r coordinates of the keys in a calibration PCA basis, read at 4 bits."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from fathom_jax import store as store_lib
from fathom_jax.index.parts import LOKI
from fathom_jax.methods.sparq import _ChannelMethod


@dataclasses.dataclass(frozen=True)
class Loki(_ChannelMethod):
    """The first r coordinates of ``(k - mu) V_loki`` from a separate rotated store; scores
    ``(q V)_{:r} . k_hat_{:r} + q . mu``. Block scales are per channel, so one store of all D
    coordinates gives every r the same codes as a store of r coordinates."""

    name: ClassVar[str] = "loki"
    parts: ClassVar[frozenset[str]] = frozenset({LOKI})
    needs_calibration: ClassVar[bool] = True
    spec_syntax: ClassVar[str] = "loki:R"
    summary: ClassVar[str] = "the first R coordinates of a calibration PCA basis, at 4 bits"

    @property
    def label(self) -> str:
        return f"Loki r={self.r}"

    def read(self, q, index, calib, *, implementation=None):
        rotation = index["loki"].rotation
        qs = store_lib.rotate_queries(q, rotation)
        d = q.shape[-1]
        mask = jnp.broadcast_to(jnp.arange(d) < self.r, q.shape[:-2] + (d,))
        shift = jnp.einsum("...gd,...d->...g", q, rotation.mean)
        return self._read_channels(q, mask, part="loki", queries=qs, shift=shift)
