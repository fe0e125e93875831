"""Resident planes: a decode cache's plane stores as a memory hierarchy, the top planes of every channel in HBM.

The planner reads the most significant plane most (a read of depth t reads planes 0..t-1), so keeping planes
``[0, p_l)`` of every channel of layer ``l`` in device memory, with the block scales, and only planes ``[p_l, 4)``
in host memory keeps most of the scan off the link (``Placement("pinned_host", resident_planes=p)``).
:class:`TieredPlanes` is the index part of such a cache: it builds, appends and cuts like :class:`Planes` (the same
codes), and holds its stacked data as a :class:`TieredPlaneStore`, each tier plane-major (see
:mod:`pallas_kernels.tier_gather`). Every layer resident (``p = 4``) is the index-in-HBM control: the plain stacked
store, in device memory. :func:`resident_for_budget` picks ``p_l`` for an HBM byte budget from how often the planner
reads each plane.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Float16, Int, UInt32

from fathom_jax import format as fmt
from fathom_jax.format import BLOCK_TOKENS, N_PLANES, WORDS_PER_BLOCK
from fathom_jax.index_parts import PlaneBlock, Planes
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


def plane_bytes(*, groups: int, capacity: int, head_dim: int) -> int:
    """Bytes of one plane of every channel of one layer (the unit a layer's resident planes grow by)."""
    return groups * head_dim * fmt.plane_words(fmt.round_capacity(capacity)) * 4


def resident_for_budget(budget: int, reads: Float[Array, "L 4"], *, groups: int, capacity: int, head_dim: int,
                        hbm_free: int | None = None) -> tuple[int, ...]:
    """Resident planes per layer for an HBM budget of ``budget`` bytes (per cache: every session of its batch).

    ``reads[l, i]`` is how often the planner reads plane ``i`` of a channel of layer ``l`` (a calibration capture's
    read frequencies at the method's budget; non-increasing in ``i``). The block scales of every layer come first
    (they are resident whenever a plane is), then planes are made resident by how many link bytes each saves, each
    layer's as a prefix. Bad budgets raise ValueError before anything is allocated: negative, more than the whole
    index, or (``hbm_free``) more than the device memory left beside the model."""
    reads = np.asarray(reads, np.float64)
    if reads.ndim != 2 or reads.shape[1] != N_PLANES or np.any(reads < 0):
        raise ValueError(f"reads must be [layers, 4] read frequencies >= 0, got shape {reads.shape}")
    layers = reads.shape[0]
    plane = plane_bytes(groups=groups, capacity=capacity, head_dim=head_dim)
    scales = layers * groups * head_dim * (fmt.round_capacity(capacity) // BLOCK_TOKENS) * 2
    whole = layers * N_PLANES * plane + scales
    if not isinstance(budget, (int, np.integer)) or budget < 0:
        raise ValueError(f"budget must be an int >= 0 (bytes of HBM for the index), got {budget!r}")
    if budget > whole:
        raise ValueError(f"budget {budget} B is more than the whole index ({whole} B: every plane and scale of "
                         f"{layers} layers); use resident_planes=4 for the index in HBM")
    if hbm_free is not None and budget > hbm_free:
        raise ValueError(f"budget {budget} B is more than the {hbm_free} B of device memory left beside the model")
    resident = [0] * layers
    if budget < scales + plane:
        return tuple(resident)
    left = budget - scales
    order = sorted(((layer, i) for layer in range(layers) for i in range(N_PLANES)), key=lambda li: -reads[li])
    for layer, i in order:  # by read frequency; a plane goes in only after the planes above it (a prefix)
        if left < plane:
            break
        if resident[layer] == i:
            resident[layer] += 1
            left -= plane
    return tuple(resident)


def link_bytes(resident: tuple[int, ...], reads: Float[Array, "L 4"], *, groups: int, capacity: int,
               head_dim: int) -> float:
    """The planes' bytes a step moves over the link with these resident planes (predicted from read frequencies)."""
    reads = np.asarray(reads, np.float64)
    plane = plane_bytes(groups=groups, capacity=capacity, head_dim=head_dim)
    return float(sum(reads[layer, i] * plane for layer, p in enumerate(resident) for i in range(p, N_PLANES)))
