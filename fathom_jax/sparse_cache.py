"""The stacked cache of sparse decoding: every layer's K/V rows and key index, and what a step changes.

:class:`SparseCache` holds bulk arrays (K/V rows, bit planes, block scales, landmarks) where the placement
puts them (HBM or ``pinned_host``) and small ones (raw tails, lengths, rotations) in device memory;
:func:`cache_bytes` sizes it before allocating; :class:`LayerUpdate` is what one decode step changes in one
layer, written back after the layer scan by :meth:`fathom_jax.decode.SparseAttention.commit`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from fathom_jax.format import BLOCK_TOKENS, LANDMARK_TOKENS, N_PLANES, plane_words, round_capacity
from fathom_jax.index import KeyIndex
from fathom_jax.methods.base import ScanMethod


def join_kv(keys: Float[Array, "*B Dh"], values: Float[Array, "*B Dh"], dtype) -> Float[Array, "*B 2Dh"]:
    """Rows of the cache's layout: each token's key in the first ``Dh`` features, its value in the last."""
    return jnp.concatenate([keys.astype(dtype), values.astype(dtype)], axis=-1)


def split_kv(rows: Float[Array, "*B 2Dh"]) -> tuple[Float[Array, "*B Dh"], Float[Array, "*B Dh"]]:
    """Keys and values of rows in the cache's layout (the inverse of :func:`join_kv`)."""
    dh = rows.shape[-1] // 2
    return rows[..., :dh], rows[..., dh:]


def key_columns(rows) -> tuple[int, int]:
    """``(start, width)`` of the keys in rows of the cache's layout (what the oracle stages)."""
    return 0, rows.shape[-1] // 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseCache:
    """K/V rows and key index of every layer, stacked ``[L, R, ...]`` (``R = batch x KV heads``).

    ``kv``: ``[L, R, C, 2 Dh]`` in the model dtype, each token's key in the first ``Dh`` features and its
    value in the last, so that fetching a selected token reads one contiguous run (from host memory the
    pages touched cost more than the bytes: see :mod:`pallas_kernels.row_fetch`); ``[1, R, C, 2 Dh]``:
    one row buffer shared by every layer, a benchmark mode for caches larger than the host. ``index``: a
    :class:`KeyIndex` whose leaves are ``[L, R, ...]`` (no ``keys`` part: the oracle reads the keys of
    ``kv``); ``length``: tokens per sequence ``[B]``. In host memory the kernels write the bulk arrays in
    place; ``writes`` holds the tokens of the last writes, so the programs that made them return something
    that depends on them.
    """

    kv: Float[Array, "L R C 2Dh"]
    index: KeyIndex
    length: Int[Array, "B"]
    writes: Int[Array, "W"] | None = None  # completion tokens of in-place writes into host memory (see below)

    @property
    def k(self) -> Float[Array, "L R C Dh"]:
        """The keys (a copy: ``kv[..., :Dh]``), for inspection; the step reads ``kv`` in place."""
        return split_kv(self.kv)[0]

    @property
    def v(self) -> Float[Array, "L R C Dh"]:
        """The values (a copy: ``kv[..., Dh:]``)."""
        return split_kv(self.kv)[1]

    @property
    def head_dim(self) -> int:
        return self.kv.shape[-1] // 2

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
        """Bytes of the bulk arrays (K/V rows, planes + scales, landmarks): what lives in host memory."""
        out = {"kv": self.kv.nbytes, "planes": 0, "landmarks": 0}
        for store in self.index.stores:
            out["planes"] += store.planes.nbytes + store.scales.nbytes
        if self.index.landmarks is not None:
            out["landmarks"] = self.index.landmarks.nbytes
        return out


def cache_bytes(method: ScanMethod, *, n_layers: int, groups: int, capacity: int, head_dim: int,
                kv_itemsize: int, shared_kv: bool = False) -> dict[str, int]:
    """Bulk bytes of a :class:`SparseCache` before allocating it (the host memory it will need)."""
    capacity = round_capacity(capacity)
    kv_layers = 1 if shared_kv else n_layers
    out = {"kv": 2 * kv_layers * groups * capacity * head_dim * kv_itemsize, "planes": 0, "landmarks": 0}
    stores = len({"raw", "klt", "loki"} & method.parts)
    per_store = groups * head_dim * (N_PLANES * plane_words(capacity) * 4 + capacity // BLOCK_TOKENS * 2)
    out["planes"] = n_layers * stores * per_store
    if "landmarks" in method.parts:
        out["landmarks"] = n_layers * groups * capacity // LANDMARK_TOKENS * head_dim * 2
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerUpdate:
    """What one decode step changes in one layer (stacked on [L] by the layer scan)."""

    key: Float[Array, "R Dh"]
    value: Float[Array, "R Dh"]
    blocks: dict  # part -> (plane words [R, D, 4, 2], scales [R, D], raw tail [R, 64, D])
    landmark: tuple | None = None  # (fp16 mean [R, D], raw tail [R, 8, D])
    # completion tokens i32 [writes] of the bulk writes the layer already made in the layer scan
    # (``Placement.writes_in_scan``); None: the commit after the scan makes them
    written: Array | None = None
