"""Index parts of one fp16 row per block of tokens (8-token landmarks, Quest's page bounds) and the stored keys."""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float16

from fathom_jax import store as store_lib
from fathom_jax.format import LANDMARK_TOKENS, QUEST_PAGE_TOKENS
from fathom_jax.index import landmarks as landmarks_lib
from fathom_jax.index import page_bounds as bounds_lib
from fathom_jax.index.part import IndexPart


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Landmarks:
    """fp16 means of every 8-token block ``[*B, capacity / 8, D]`` and the raw keys (f32) of the partially filled
    last block ``tail [*B, 8, D]`` (zeros elsewhere), from which an append recomputes that block's mean."""

    means: Float16[Array, "*B NL D"]
    tail: Float[Array, "*B 8 D"]

    @property
    def rows(self) -> Float16[Array, "*B NL D"]:
        """One row per block, what a :class:`~fathom_jax.methods.base.BlockRead` scores."""
        return self.means


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
    """fp16 ``[min | max]`` of every channel per ``P``-token page ``bounds [*B, capacity / P, 2 D]`` (Quest) and the
    raw keys (f32) of the partially filled last page ``tail [*B, P, D]`` (zeros elsewhere), from which an append
    recomputes that page's bounds."""

    bounds: Float16[Array, "*B NP 2D"]
    tail: Float[Array, "*B P D"]

    @property
    def rows(self) -> Float16[Array, "*B NP 2D"]:
        """One row per page, what a :class:`~fathom_jax.methods.base.BlockRead` scores."""
        return self.bounds


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LandmarkBlock:
    """The landmarks' newest 8-token block after a decode step adds its token: its fp16 ``mean [R, D]`` and raw
    ``tail [R, 8, D]``."""

    mean: Float16[Array, "R D"]
    tail: Float[Array, "R 8 D"]

    @property
    def row(self) -> Float16[Array, "R D"]:
        return self.mean


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageBlock:
    """Quest's newest page after a decode step adds its token: its fp16 ``bounds [R, 2 D]`` and raw
    ``tail [R, P, D]``."""

    bounds: Float16[Array, "R 2D"]
    tail: Float[Array, "R P D"]

    @property
    def row(self) -> Float16[Array, "R 2D"]:
        return self.bounds


class BlockRows(IndexPart):
    """An index of one fp16 row per block of ``tokens`` tokens (what a :class:`~fathom_jax.methods.base.BlockRead`
    scores) and the raw keys of the partially filled last block, from which an append recomputes that block's row.
    Subclasses say what a row is: the hooks below, each one call into the module that builds the rows."""

    writes_per_token: ClassVar[int] = 1

    @property
    @abc.abstractmethod
    def tokens(self) -> int:
        """Tokens per block (per row)."""

    @abc.abstractmethod
    def width(self, head_dim: int) -> int:
        """fp16 values per row."""

    @abc.abstractmethod
    def _build_rows(self, padded, length): ...

    @abc.abstractmethod
    def _truncate(self, rows, tail, length): ...

    @abc.abstractmethod
    def _append_one(self, rows, tail, length, key): ...

    @abc.abstractmethod
    def _append_block(self, tail, length, key): ...

    @abc.abstractmethod
    def _data(self, rows, tail): ...

    @abc.abstractmethod
    def _block(self, row, tail): ...

    def build(self, keys, calib, *, capacity, length):
        padded = _padded(keys, capacity).astype(jnp.float32)
        if length is None:
            length = jnp.full(keys.shape[:-2], keys.shape[-2], jnp.int32)
        return self._data(self._build_rows(padded, length), store_lib.block_tail(padded, length, self.tokens))

    def append(self, data, keys, length):
        batch = length.shape
        flat = lambda x: x.reshape(-1, *x.shape[len(batch):])  # noqa: E731
        step = jax.vmap(self._append_one)
        start, new = flat(length), flat(keys.astype(jnp.float32))
        rows, tail = jax.lax.fori_loop(0, keys.shape[-2], lambda i, c: step(c[0], c[1], start + i, new[:, i]),
                                       (flat(data.rows), flat(data.tail)))
        return self._data(rows.reshape(data.rows.shape), tail.reshape(data.tail.shape))

    def prefix(self, data, keys, length):
        tail = store_lib.block_tail(keys.astype(jnp.float32), length, self.tokens)
        return self._data(self._truncate(data.rows, tail, length), tail)

    def bulk(self, data):
        return self._data(True, False)

    def capacity_of(self, data):
        return data.rows.shape[-2] * self.tokens

    def head_dim_of(self, data):
        return data.tail.shape[-1]

    def nbytes(self, *, capacity, head_dim):
        return capacity // self.tokens * self.width(head_dim) * 2

    def empty(self, alloc, length, *, layers, groups, capacity, head_dim):
        return self._data(alloc((layers, groups, capacity // self.tokens, self.width(head_dim)), jnp.float16),
                          alloc((layers, groups, self.tokens, head_dim), jnp.float32, bulk=False))

    def write_layer(self, write, stacked, built, layer, length, *, importance=None):
        zero = jnp.zeros(built.rows.shape[:1], jnp.int32)
        rows, tokens = write(stacked.rows, built.rows[None], zero, 2, layer)
        return self._data(rows, stacked.tail.at[layer].set(built.tail)), tokens

    def add_token(self, stacked, layer, position, key):
        row, tail = jax.vmap(self._append_block)(stacked.tail[layer], position, key)
        return self._data(stacked.rows, tail), self._block(row, tail)

    def write_token(self, write, stacked, block, position, layer, due):
        rows, tokens = write(stacked.rows, block.row[:, :, None, :], position // self.tokens, 2, layer)
        return self._data(rows, stacked.tail), tokens

    def commit(self, stacked, block, length):
        return self._data(stacked.rows, block.tail)


@dataclasses.dataclass(frozen=True)
class LandmarkMeans(BlockRows):
    """The fp16 mean key of every 8-token block (:class:`Landmarks`)."""

    name: str = "landmarks"
    tokens: ClassVar[int] = LANDMARK_TOKENS

    def width(self, head_dim):
        return head_dim

    def _build_rows(self, padded, length):
        return landmarks_lib.build(padded, length)

    def _truncate(self, rows, tail, length):
        return landmarks_lib.truncate(rows, tail, length)

    def _append_one(self, rows, tail, length, key):
        return landmarks_lib.append_one(rows, tail, length, key)

    def _append_block(self, tail, length, key):
        return landmarks_lib.append_block(tail, length, key)

    def _data(self, rows, tail):
        return Landmarks(means=rows, tail=tail)

    def _block(self, row, tail):
        return LandmarkBlock(mean=row, tail=tail)


@dataclasses.dataclass(frozen=True)
class PageBounds(BlockRows):
    """Quest's fp16 per-channel min and max key of every ``page``-token page (:class:`Pages`), named
    ``quest<page>``: parts of different page sizes are different parts."""

    page: int = QUEST_PAGE_TOKENS

    def __post_init__(self):
        bounds_lib.check_page(self.page, "PageBounds")

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"quest{self.page}"

    @property
    def tokens(self) -> int:
        return self.page

    def width(self, head_dim):
        return 2 * head_dim

    def _build_rows(self, padded, length):
        return bounds_lib.build(padded, length, self.page)

    def _truncate(self, rows, tail, length):
        return bounds_lib.truncate(rows, tail, length)

    def _append_one(self, rows, tail, length, key):
        return bounds_lib.append_one(rows, tail, length, key)

    def _append_block(self, tail, length, key):
        return bounds_lib.append_page(tail, length, key)

    def _data(self, rows, tail):
        return Pages(bounds=rows, tail=tail)

    def _block(self, row, tail):
        return PageBlock(bounds=row, tail=tail)


@dataclasses.dataclass(frozen=True)
class StoredKeys(IndexPart):
    """The keys as given, padded to the capacity (the exact oracle reads them; a decode cache reads its K/V rows)."""

    name: str = "keys"

    def build(self, keys, calib, *, capacity, length):
        return _padded(keys, capacity)

    def append(self, data, keys, length):
        batch = length.shape
        flat = lambda x: x.reshape(-1, *x.shape[len(batch):])  # noqa: E731
        put = jax.vmap(lambda rows, new, at: jax.lax.dynamic_update_slice(rows, new, (at, 0)))
        return put(flat(data), flat(keys.astype(data.dtype)), flat(length)).reshape(data.shape)

    def prefix(self, data, keys, length):
        return data

    def bulk(self, data):
        return True

    def capacity_of(self, data):
        return data.shape[-2]

    def head_dim_of(self, data):
        return data.shape[-1]

    def nbytes(self, *, capacity, head_dim):
        return capacity * head_dim * 2


def _padded(keys, capacity: int):
    *batch, n, d = keys.shape
    return jnp.zeros((*batch, capacity, d), keys.dtype).at[..., :n, :].set(keys)
