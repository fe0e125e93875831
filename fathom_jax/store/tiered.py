"""A stacked plane store in two tiers: the top planes of every channel in device memory, the rest in host memory.

A decode cache with resident planes (``Placement("pinned_host", resident_planes=p)``) keeps planes ``[0, p_l)`` of
every channel of layer ``l`` and the block scales in HBM and planes ``[p_l, 4)`` in host memory, each tier
plane-major (rows ``[plane, group, channel, words]``, :func:`pallas_kernels.plane_layout.tier_table`): the same codes as
the one-tier :class:`~fathom_jax.store.PlaneStore`, whose planes are channel-major. With warm planes
(``Placement(..., warm_planes=S)``) a third tier in device memory holds copies of ``S`` channel planes past the resident
ones per layer and group, chosen at prefill (:func:`warm_choice`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float16, Int, UInt32

from fathom_jax.store.layout import BlockScaled, KeyRotation, PlaneStore
from pallas_kernels.operands import LayerTiers
from pallas_kernels.plane_layout import N_PLANES, layer_planes, tier_table


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


def warm_choice(importance: Float[Array, "R D"], resident, slots: int) -> Int[Array, "R D 4"]:
    """The warm map of one layer (``1 + row`` of the warm tier holding plane ``i`` of channel ``j``, 0 for none, as
    :class:`~pallas_kernels.operands.LayerTiers` takes it): each group's ``slots`` channel planes past the ``resident``
    ones (an int, or traced) with the largest gains ``importance_j 4^-i``, rows in order of gain. A channel's planes
    gain less the deeper they are, so its chosen planes follow the resident ones with no gap (ties: lower channel,
    then plane, first)."""
    r, d = importance.shape
    plane = jnp.arange(N_PLANES)
    gain = importance.astype(jnp.float32)[..., None] * 4.0 ** -plane.astype(jnp.float32)
    gain = jnp.where(plane >= jnp.asarray(resident), gain, -jnp.inf).reshape(r, d * N_PLANES)
    order = jnp.argsort(-gain, axis=-1, stable=True)[:, :slots]  # [R, S]: the flat (channel, plane) of each row
    rows = jnp.zeros((r, d * N_PLANES), jnp.int32)
    taken = jnp.take_along_axis(gain, order, axis=-1) > -jnp.inf
    rows = rows.at[jnp.arange(r)[:, None], order].set(jnp.where(taken, jnp.arange(1, slots + 1, dtype=jnp.int32), 0))
    return rows.reshape(r, d, N_PLANES)


def warm_sources(warm_map: Int[Array, "*B D 4"], slots: int) -> tuple[Int[Array, "*B S"], Array]:
    """Row by row, the flat ``channel * 4 + plane`` a warm map puts there and whether it puts one: what a write copies
    into each row of the warm tier."""
    flat = warm_map.reshape(*warm_map.shape[:-2], -1)
    hit = flat[..., None, :] == jnp.arange(1, slots + 1, dtype=flat.dtype)[:, None]  # [*B, S, D * 4]
    return jnp.argmax(hit, axis=-1).astype(jnp.int32), jnp.any(hit, axis=-1)
