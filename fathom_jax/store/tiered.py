"""A stacked plane store in two tiers: the top planes of every channel in device memory, the rest in host memory.

A decode cache with resident planes (``Placement("pinned_host", resident_planes=p)``) keeps planes ``[0, p_l)`` of
every channel of layer ``l`` and the block scales in HBM and planes ``[p_l, 4)`` in host memory, each tier
plane-major (rows ``[plane, group, channel, words]``, :func:`pallas_kernels.plane_layout.tier_table`): the same codes as
the one-tier :class:`~fathom_jax.store.PlaneStore`, whose planes are channel-major. With warm planes
(``Placement(..., warm_planes=S)``) a third tier in device memory holds copies of ``S`` channel planes past the resident
ones per layer and group, chosen at prefill (:func:`fathom_jax.placement.residency.warm_choice`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float16, Int, UInt32

from fathom_jax.store.layout import BlockScaled, KeyRotation, PlaneStore
from pallas_kernels.operands import LayerTiers
from pallas_kernels.plane_layout import layer_planes, tier_table


@dataclasses.dataclass(frozen=True)
class TieredPlaneStore(BlockScaled):
    """A stacked plane store in two tiers: ``hot`` (planes ``i < p_l`` of layer ``l``, device memory) and ``cold``
    (the rest, host memory), plane-major rows as :func:`pallas_kernels.plane_layout.tier_table` places them; block
    ``scales`` (device memory), raw ``tail``, ``length`` and ``rotation`` as a :class:`PlaneStore`'s. ``resident``
    (static) is ``p_l`` per layer. ``warm`` (device memory, optional) holds copies of chosen channel planes past the
    resident ones, ``warm_map`` which (:class:`~pallas_kernels.operands.LayerTiers`); the cold tier keeps them too."""

    hot: UInt32[Array, "Nh R D W"]
    cold: UInt32[Array, "Nc R D W"]
    scales: Float16[Array, "L R D NB"]
    tail: Float[Array, "*L R 64 D"]
    length: Int[Array, "*L R"]
    rotation: KeyRotation | None = None
    resident: tuple[int, ...] = ()
    warm: UInt32[Array, "L R S W"] | None = None
    warm_map: Int[Array, "L R D 4"] | None = None

    @property
    def table(self) -> jax.Array:
        return jnp.asarray(tier_table(self.resident))

    def tiers(self, layer, group_start: int = 0) -> LayerTiers:
        """The tiers at ``layer`` for groups ``group_start ..`` as the kernels take them (read in place)."""
        return LayerTiers(self.hot, self.cold, self.scales, self.table, layer, group_start, self.warm, self.warm_map)

    def layer_store(self, layer, groups: slice, length) -> PlaneStore:
        """The one-tier store of ``layer``'s ``groups`` (a copy, for the plain-jnp reference scan)."""
        return PlaneStore(planes=layer_planes(self.hot, self.cold, self.table, layer, groups),
                          scales=self.scales[layer, groups], tail=self.tail, length=length, rotation=self.rotation)


jax.tree_util.register_dataclass(TieredPlaneStore, data_fields=["hot", "cold", "scales", "tail", "length", "rotation",
                                                                "warm", "warm_map"], meta_fields=["resident"])
