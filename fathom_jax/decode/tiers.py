"""Resident planes: a decode cache's plane stores as a memory hierarchy, the top planes of every channel in HBM.

The planner reads the most significant plane most (a read of depth t reads planes 0..t-1), so keeping planes
``[0, p_l)`` of every channel of layer ``l`` in device memory, with the block scales, and only planes ``[p_l, 4)``
in host memory keeps most of the scan off the link (``Placement("pinned_host", resident_planes=p)``).
:class:`TieredPlanes` is the index part of such a cache: it builds, appends and cuts like :class:`Planes` (the same
codes), and holds its stacked data as a :class:`TieredPlaneStore`, each tier plane-major (see
:mod:`pallas_kernels.tier_gather`). Every layer resident (``p = 4``) is the index-in-HBM control: the plain stacked
store, in device memory. How many planes each layer keeps for an HBM budget is
:func:`fathom_jax.placement.residency.resident_for_budget`'s choice.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float16, Int, UInt32

from fathom_jax import format as fmt
from fathom_jax.format import BLOCK_TOKENS, N_PLANES, WORDS_PER_BLOCK
from fathom_jax.index.parts import PlaneBlock, Planes
from fathom_jax.store import KeyRotation, PlaneStore
from pallas_kernels.plane_layout import layer_planes, tier_table


@dataclasses.dataclass(frozen=True)
class TieredPlaneStore:
    """A stacked plane store in two tiers: ``hot`` (planes ``i < p_l`` of layer ``l``, device memory) and ``cold``
    (the rest, host memory), plane-major rows as :func:`pallas_kernels.plane_layout.tier_table` places them; block
    ``scales`` (device memory), raw ``tail``, ``length`` and ``rotation`` as a :class:`PlaneStore`'s. ``resident``
    (static) is ``p_l`` per layer."""

    hot: UInt32[Array, "Nh R D W"]
    cold: UInt32[Array, "Nc R D W"]
    scales: Float16[Array, "L R D NB"]
    tail: Float[Array, "*L R 64 D"]
    length: Int[Array, "*L R"]
    rotation: KeyRotation | None = None
    resident: tuple[int, ...] = ()

    @property
    def table(self) -> jax.Array:
        return jnp.asarray(tier_table(self.resident))

    @property
    def capacity(self) -> int:
        return self.hot.shape[-1] * fmt.WORD_BITS

    @property
    def head_dim(self) -> int:
        return self.hot.shape[2]

    def layer_store(self, layer, groups: slice, length) -> PlaneStore:
        """The one-tier store of ``layer``'s ``groups`` (a copy, for the plain-jnp reference scan)."""
        return PlaneStore(planes=layer_planes(self.hot, self.cold, self.table, layer, groups),
                          scales=self.scales[layer, groups], tail=self.tail, length=length, rotation=self.rotation)


jax.tree_util.register_dataclass(TieredPlaneStore, data_fields=["hot", "cold", "scales", "tail", "length", "rotation"],
                                 meta_fields=["resident"])


def all_resident(resident: tuple[int, ...]) -> bool:
    """Every plane of every layer in device memory: no plane of the index crosses the link."""
    return all(p == N_PLANES for p in resident)


@dataclasses.dataclass(frozen=True)
class TieredPlanes(Planes):
    """A :class:`Planes` part whose decode cache keeps ``resident[l]`` top planes of layer ``l`` in device memory."""

    resident: tuple[int, ...] = ()

    @classmethod
    def of(cls, part: Planes, resident: tuple[int, ...]) -> "TieredPlanes":
        return cls(part.name, part.rotation, tuple(resident))

    @property
    def all_resident(self) -> bool:
        return all_resident(self.resident)

    def bulk(self, data):
        if isinstance(data, TieredPlaneStore):
            mask = jax.tree.map(lambda _: False, data)
            return dataclasses.replace(mask, hot="device", cold=True, scales="device")
        mask = super().bulk(data)
        return dataclasses.replace(mask, planes="device", scales="device") if self.all_resident else mask

    def bulk_bytes(self, *, layers: int, capacity: int, head_dim: int) -> dict[str, int]:
        plane = head_dim * fmt.plane_words(capacity) * 4
        scales = layers * head_dim * (capacity // BLOCK_TOKENS) * 2
        hot = sum(self.resident) * plane
        return {"planes": layers * N_PLANES * plane - hot, "planes_hbm": hot + scales}

    def empty(self, alloc, length, *, layers, groups, capacity, head_dim):
        if self.all_resident:
            device = lambda shape, dtype, bulk=True: alloc(shape, dtype, bulk="device" if bulk else False)  # noqa: E731
            return super().empty(device, length, layers=layers, groups=groups, capacity=capacity, head_dim=head_dim)
        small = lambda shape, dtype: alloc(shape, dtype, bulk=False)  # noqa: E731
        d, w, hot = head_dim, fmt.plane_words(capacity), sum(self.resident)
        rotation = None
        if self.rotation is not None:
            rotation = KeyRotation(mean=small((layers, groups, d), jnp.float32),
                                   basis=small((layers, groups, d, d), jnp.float32))
        return TieredPlaneStore(
            cold=alloc((layers * N_PLANES - hot, groups, d, w), jnp.uint32),  # largest first (host memory)
            hot=alloc((hot, groups, d, w), jnp.uint32, bulk="device"),
            scales=alloc((layers, groups, d, capacity // BLOCK_TOKENS), jnp.float16, bulk="device"),
            tail=small((layers, groups, BLOCK_TOKENS, d), jnp.float32), length=length, rotation=rotation,
            resident=self.resident)

    def write_layer(self, write, stacked, built, layer, length):
        if not isinstance(stacked, TieredPlaneStore):
            return super().write_layer(write, stacked, built, layer, length)
        start = jnp.zeros(built.length.shape, jnp.int32)
        hot, cold = write.tiers(stacked.hot, stacked.cold, stacked.table, built.planes[None], start, layer)
        set_small = lambda dst, src: dst.at[layer].set(src.astype(dst.dtype))  # noqa: E731
        rotation = None if stacked.rotation is None else jax.tree.map(set_small, stacked.rotation, built.rotation)
        return dataclasses.replace(stacked, hot=hot, cold=cold, scales=write(stacked.scales, built.scales[None],
                                                                              start, 3, layer),
                                   tail=set_small(stacked.tail, built.tail), length=length, rotation=rotation)

    def add_token(self, stacked, layer, position, key):
        if not isinstance(stacked, TieredPlaneStore):
            return super().add_token(stacked, layer, position, key)
        view, block = super().add_token(_as_planes(stacked), layer, position, key)
        return dataclasses.replace(stacked, tail=view.tail, length=view.length, rotation=view.rotation), block

    def write_token(self, write, stacked, block: PlaneBlock, position, layer, due):
        if not isinstance(stacked, TieredPlaneStore):
            return super().write_token(write, stacked, block, position, layer, due)
        return _write_block(write, stacked, block.words, block.scale, position // BLOCK_TOKENS, due, layer)

    def flush(self, write, stacked, length):
        if not isinstance(stacked, TieredPlaneStore):
            return super().flush(write, stacked, length)
        from fathom_jax import store as store_lib

        count = length % BLOCK_TOKENS
        words, scale = jax.vmap(jax.vmap(store_lib.pack_block), in_axes=(0, None))(stacked.tail, count)
        return _write_block(write, stacked, words, scale, length // BLOCK_TOKENS, count > 0, 0)


def _as_planes(stacked: TieredPlaneStore) -> PlaneStore:
    """The small leaves of a tiered store in a :class:`PlaneStore` (for :meth:`Planes.add_token`, which reads no
    planes)."""
    return PlaneStore(planes=stacked.hot, scales=stacked.scales, tail=stacked.tail, length=stacked.length,
                      rotation=stacked.rotation)


def _write_block(write, stacked: TieredPlaneStore, words, scale, block, due, layer):
    """Each group's 64-token block number ``block [R]`` written where ``due`` (words ``[Ls, R, D, 4, 2]``, scales
    ``[Ls, R, D]`` for layers ``layer ..``)."""
    block = jnp.where(due, block, stacked.scales.shape[-1])
    hot, cold = write.tiers(stacked.hot, stacked.cold, stacked.table, words, block * WORDS_PER_BLOCK, layer)
    return dataclasses.replace(stacked, hot=hot, cold=cold, scales=write(stacked.scales, scale[..., None], block, 3,
                                                                         layer))
