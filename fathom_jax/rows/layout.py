"""How a decode cache stores each token's K/V row: in the model dtype, or compressed by a row format.

A row fetch reads each selected token's row as one contiguous run, so a row holds everything its token needs:

* no format (the default): the model dtype, key in the first ``Dh`` features and value in the last, ``[.., 2 Dh]``;
* a :class:`~fathom_jax.rows.formats.RowFormat` whose scales are per token (``k8v8``, ``k4g32av4g32a``, ``bf16``...):
  its bytes (``[K codes | K scales | V codes | V scales]``) padded to whole 32-bit words, ``uint32 [.., W]``. The
  step fetches the words and dequantizes them in the program that attends (XLA fuses the unpacking into the
  attention's reads); the row cache keeps the words as fetched.

Formats with K scales per (channel, block of tokens) (``k4c64a``, ``kstore``) are the row study's measured points:
their block's scales change with every token appended, which a per-token row cannot carry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from fathom_jax.rows import formats as row_formats
from fathom_jax.rows.formats import RowFormat

WORD_BYTES = 4


def row_format(rows: "str | RowFormat | None") -> RowFormat | None:
    """The decode cache's row format for ``rows``: None (or ``"model"``) for rows in the model dtype, else a
    :class:`RowFormat` (a spec such as ``"k8v8"`` is parsed) whose scales are per token."""
    if rows is None or (isinstance(rows, str) and rows.strip().lower() == "model"):
        return None
    fmt = row_formats.parse(rows)
    if not fmt.per_token:
        raise ValueError(f"rows={fmt.spec!r}: K scales per block of tokens change as tokens are appended, which a "
                         "decode cache's per-token rows cannot hold; choose a format with per-token scales (e.g. "
                         "'k8v8', 'k8v4g32a') or 'model'")
    return fmt


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """A cache's row layout (static): ``head_dim``, the model ``dtype`` the rows come from and go back to, and the
    row ``format`` (None: rows in the model dtype as they are)."""

    head_dim: int
    dtype: Any
    format: RowFormat | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "format", row_format(self.format))
        if self.format is not None:
            self.format.validate(self.head_dim)

    @classmethod
    def of(cls, rows: "str | RowFormat | None", head_dim: int, dtype) -> "RowLayout":
        """The layout of ``rows`` (a spec such as ``"k8v8"``, a RowFormat, or None / ``"model"`` for the model
        dtype) at ``head_dim``."""
        return cls(head_dim, dtype, row_format(rows))

    @property
    def spec(self) -> str:
        return "model" if self.format is None else self.format.spec

    @property
    def compressed(self) -> bool:
        return self.format is not None

    @property
    def storage_dtype(self):
        return self.dtype if self.format is None else np.dtype(np.uint32)

    @property
    def width(self) -> int:
        """Elements of one stored row."""
        if self.format is None:
            return 2 * self.head_dim
        return -(-self.format.row_bytes(self.head_dim) // WORD_BYTES)

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row (what a fetch moves per token)."""
        return self.width * self.storage_dtype.itemsize

    def join(self, keys: Float[Array, "*B Dh"], values: Float[Array, "*B Dh"]) -> Array:
        """Stored rows ``[..., width]`` of keys and values."""
        if self.format is None:
            return jnp.concatenate([keys.astype(self.dtype), values.astype(self.dtype)], axis=-1)
        raw = self.format.encode_rows(keys[..., None, :], values[..., None, :])[..., 0, :]
        if raw.dtype != jnp.uint8:  # the bf16 format's rows
            raw = jax.lax.bitcast_convert_type(raw, jnp.uint8).reshape(*raw.shape[:-1], -1)
        pad = self.width * WORD_BYTES - raw.shape[-1]
        raw = jnp.pad(raw, [(0, 0)] * (raw.ndim - 1) + [(0, pad)])
        return jax.lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], self.width, WORD_BYTES), jnp.uint32)

    def split(self, rows: Array) -> tuple[Float[Array, "*B Dh"], Float[Array, "*B Dh"]]:
        """Keys and values of stored rows: the model dtype's features as they are, or (compressed) dequantized to
        f32. Zero rows (padding) give zeros."""
        if self.format is None:
            return rows[..., :self.head_dim], rows[..., self.head_dim:]
        raw = jax.lax.bitcast_convert_type(rows, jnp.uint8).reshape(*rows.shape[:-1], self.width * WORD_BYTES)
        raw = raw[..., :self.format.row_bytes(self.head_dim)]
        if self.format.is_bf16:
            raw = jax.lax.bitcast_convert_type(raw.reshape(*raw.shape[:-1], -1, 2), jnp.bfloat16)
        return self.format.decode_rows(raw)

    def key_columns(self) -> tuple[int, int] | None:
        """The features of a stored row that hold its key alone, or None where keys need the whole row."""
        return (0, self.head_dim) if self.format is None else None
