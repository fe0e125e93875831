"""The stacked cache of sparse decoding: every layer's K/V rows and key index, and what a step changes.

:class:`SparseCache` holds bulk arrays (K/V rows and the index parts' bulk leaves) where the placement puts them (HBM
or ``pinned_host``) and small ones (raw tails, lengths, rotations, session statistics) in device memory;
:func:`cache_bytes` sizes it before allocating; :class:`LayerUpdate` is what one decode step changes in one layer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from fathom_jax.calibrate import Calibration
from fathom_jax.decode.row_cache import RowCache, RowFill, empty_row_cache
from fathom_jax.format import round_capacity
from fathom_jax.index import KeyIndex, check_parts
from fathom_jax.models.attention import CacheShape
from fathom_jax.rows.layout import RowLayout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseCache:
    """K/V rows and key index of every layer, stacked ``[L, R, ...]`` (``R = batch x KV heads``).

    ``kv``: ``[L, R, C, W]``, one row per token as ``layout`` stores it (:mod:`fathom_jax.rows.layout`: by
    default ``W = 2 Dh`` in the model dtype, each token's key in the first ``Dh`` features and its value in the last;
    or a compressed row format's words), so that fetching a selected token reads one contiguous run (from host
    memory the pages touched cost more than the bytes: see :mod:`pallas_kernels.row_fetch`); ``[1, R, C, W]``: one
    row buffer shared by every layer, a benchmark mode for caches larger than the host. ``index``: a :class:`KeyIndex` whose leaves are
    ``[L, R, ...]`` (no keys part: the oracle reads the keys of ``kv``); ``length``: tokens per sequence ``[B]``;
    ``calibration``: the session's own statistics ``[L, R, ...]`` (set by the prefill; None for corpus statistics,
    which the hook holds). In host memory the kernels write the bulk arrays in place; ``writes`` holds the
    completion tokens of the last writes, so the programs that made them return something that depends on them.
    ``row_cache``: device-memory copies of recently fetched rows (:class:`RowCache`), or None.
    """

    kv: Float[Array, "L R C W"]
    index: KeyIndex
    length: Int[Array, "B"]
    layout: RowLayout = dataclasses.field(metadata=dict(static=True))
    calibration: Calibration | None = None
    writes: Int[Array, "W"] | None = None
    row_cache: RowCache | None = None

    def bulk(self) -> "SparseCache":
        """A tree like this cache of bools: True for the leaves that grow with the context."""
        small = lambda tree: jax.tree.map(lambda _: False, tree)  # noqa: E731
        return SparseCache(kv=True, index=self.index.bulk(), length=False, layout=self.layout,
                           calibration=small(self.calibration),
                           writes=small(self.writes), row_cache=small(self.row_cache))

    @property
    def k(self) -> Float[Array, "L R C Dh"]:
        """The keys as the rows hold them (a copy; dequantized for a compressed format), for inspection; the step
        reads ``kv`` in place."""
        return self.layout.split(self.kv)[0]

    @property
    def v(self) -> Float[Array, "L R C Dh"]:
        """The values as the rows hold them (a copy)."""
        return self.layout.split(self.kv)[1]

    @property
    def head_dim(self) -> int:
        return self.layout.head_dim

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]

    @property
    def n_layers(self) -> int:
        return self.index.length.shape[0]

    @property
    def groups(self) -> int:
        return self.kv.shape[1]

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    @property
    def shared_kv(self) -> bool:
        return self.kv.shape[0] != self.n_layers

    def group_length(self) -> Int[Array, "R"]:
        return jnp.repeat(self.length, self.groups // self.batch)

    def nbytes(self) -> dict[str, int]:
        """Bytes of the bulk arrays by kind (K/V rows, plane stores, landmarks): what lives where the placement puts
        them; ``*_hbm``: bulk arrays kept in device memory whatever the placement (resident planes, their scales)."""
        out = {"kv": self.kv.nbytes}
        for part, data in zip(self.index.parts, self.index.data):
            for x, where in zip(jax.tree.leaves(data), jax.tree.leaves(part.bulk(data))):
                if where:
                    key = part.kind + ("_hbm" if where == "device" else "")
                    out[key] = out.get(key, 0) + x.nbytes
        return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerUpdate:
    """What one decode step changes in one layer (stacked on [L] by the layer scan): the new token's key and value,
    each index part's newest block (:mod:`fathom_jax.index.parts`), the completion tokens of the bulk writes the
    layer already made in place inside the layer scan (None: the commit after the scan makes them), the rows
    the layer stores in its row-cache slots (None: no row cache)."""

    key: Float[Array, "R Dh"]
    value: Float[Array, "R Dh"]
    blocks: dict
    written: Array | None = None
    rows: RowFill | None = None


def cache_bytes(parts, rows: RowLayout, *, n_layers: int, groups: int, capacity: int, shared_kv: bool = False
                ) -> dict[str, int]:
    """Bulk bytes of a :class:`SparseCache` holding the index ``parts`` (a method's ``parts``) and K/V rows laid out as
    ``rows`` before allocating it: the host memory it will need, by kind as :meth:`SparseCache.nbytes` gives them."""
    capacity = round_capacity(capacity)
    out = {"kv": (1 if shared_kv else n_layers) * groups * capacity * rows.row_bytes}
    for part in check_parts(parts, "cache_bytes"):
        for kind, size in part.bulk_bytes(layers=n_layers, capacity=capacity, head_dim=rows.head_dim).items():
            out[kind] = out.get(kind, 0) + groups * size
    return out


def allocate(alloc: Callable[..., Any], parts, shape: CacheShape, *, rows: str | None = None, shared_kv: bool = False,
             row_cache: int = 0, row_cache_mode: str = "direct", session_calibration=None) -> SparseCache:
    """An empty cache of ``shape`` from ``alloc(shape, dtype, bulk=True)`` (zeros where they belong), largest array
    first: XLA's pinned host allocator grows in regions of doubling size, and K/V rows allocated after the planes
    found no region left at 1M tokens. ``rows``: the row format (:class:`~fathom_jax.rows.layout.RowLayout`; None:
    the model dtype). ``row_cache``: slots of a :class:`RowCache` (``row_cache_mode`` its mode).
    ``session_calibration``: a Calibration of one group's shapes, stacked ``[L, R]``
    here for the session's statistics (None for corpus statistics)."""
    small = lambda dims, dtype: alloc(dims, dtype, bulk=False)  # noqa: E731
    layers, groups, capacity, d = shape.layers, shape.groups, round_capacity(shape.capacity), shape.head_dim
    layout = RowLayout.of(rows, d, shape.dtype)
    kv = alloc((1 if shared_kv else layers, groups, capacity, layout.width), layout.storage_dtype)
    length = small((layers, groups), jnp.int32)
    parts = check_parts(parts, "allocate")
    # Each part its own zeros, not the index's length array: a program donates every small leaf, and XLA refuses one
    # buffer donated twice (Gemma 3's prompt program, which threads the whole cache through its layer loop).
    data = tuple(p.empty(alloc, small((layers, groups), jnp.int32), layers=layers, groups=groups, capacity=capacity,
                         head_dim=d) for p in parts)
    writes = 1 + sum(p.writes_per_token for p in parts)
    calibration = None
    if session_calibration is not None:
        calibration = jax.tree.map(lambda a: small((layers, groups) + a.shape, a.dtype), session_calibration)
    slots = None
    if row_cache:
        slots = empty_row_cache(small, n_layers=layers, groups=groups, slots=row_cache, width=layout.width,
                                mode=row_cache_mode,
                                dtype=layout.storage_dtype)
    return SparseCache(kv=kv, index=KeyIndex(length, parts, data), length=small((shape.batch,), jnp.int32),
                       layout=layout, calibration=calibration, writes=small((writes,), jnp.int32), row_cache=slots)


def bulk_allocations(parts, shape: CacheShape, **options) -> list[int]:
    """The bytes of every host array :func:`allocate` makes (``options`` as it takes them), in allocation order (for
    the host-memory check)."""
    sizes: list[int] = []

    def record(dims, dtype, *, bulk=True):
        if bulk is True:
            sizes.append(math.prod(dims) * np.dtype(dtype).itemsize)
        return jax.ShapeDtypeStruct(dims, dtype)

    allocate(record, parts, shape, **options)
    return sizes
