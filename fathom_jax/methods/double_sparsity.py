"""Double Sparsity: the first c channels of an offline calibration order, read at 4 bits."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from fathom_jax.methods.sparq import _ChannelMethod


@dataclasses.dataclass(frozen=True)
class DoubleSparsity(_ChannelMethod):
    """Channels ``calib.ds_order[:c]`` (``mean|q| x mean|k|`` on calibration data), 4 bits."""

    name: ClassVar[str] = "double_sparsity"
    needs_calibration: ClassVar[bool] = True
    spec_syntax: ClassVar[str] = "double_sparsity:C"
    summary: ClassVar[str] = "the C channels of the offline calibration order, at 4 bits"
    _param: ClassVar[str] = "c"

    @property
    def c(self) -> int:
        return self.r

    @property
    def label(self) -> str:
        return f"Double Sparsity c={self.r}"

    def read(self, q, index, calib, *, implementation=None):
        d = q.shape[-1]
        mask = jnp.any(jax.nn.one_hot(calib.ds_order[..., : self.r], d, dtype=jnp.bool_), axis=-2)
        return self._read_channels(q, mask)
