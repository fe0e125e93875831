"""What the plane kernels take for "this layer's planes" and "these runs", in place of placement parameters.

* :class:`RunList`: a fixed-size run list (slot ``c`` reads channel ``channels[c]`` to depth ``depths[c]``);
* :class:`StorePlanes`: a channel-major plane store as a kernel reads it in place (a plain store, one layer of a
  stacked one for a window of its groups, or the staged buffer a gather returns);
* :class:`LayerTiers`: a stacked store held in two memory tiers (:mod:`pallas_kernels.plane_layout`) at one layer;
* :class:`ResidentPlanes`: a staged buffer's resident (and warm) planes, read in place from a :class:`LayerTiers`;
* :class:`StoredRows`: K/V rows as a kernel reads them in place (a plain array, or one layer of a stacked cache).

Each is a frozen pytree: arrays (and a traced layer) are its leaves, what fixes a kernel's shape (``group_start``,
``sorted``) is static, so a ``jit`` over an operand compiles once per window and list kind, as the keyword arguments
it replaces did.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import backend as B
from pallas_kernels.plane_layout import N_PLANES, check_run_list, tier_rows


@dataclasses.dataclass(frozen=True)
class RunList:
    """A fixed-size run list: slot ``c`` of group ``r`` reads channel ``channels[r, c]`` to depth ``depths[r, c]`` (0:
    nothing). ``sorted``: the slots are in decreasing depth (as :func:`pallas_kernels.plane_scan.active_channels`
    makes them), so the kernels skip the small sorts that would otherwise bring each class of depth together."""

    channels: jax.Array  # i32 [*, C]
    depths: jax.Array  # i32 [*, C]
    sorted: bool = False

    @property
    def batch(self) -> tuple[int, ...]:
        return self.channels.shape[:-1]

    def check(self, head_dim: int, *, ndim: int | None = None) -> None:
        """Dtypes and shapes (``[*, C]``, ``ndim`` dims where given), and the values where they are known."""
        B.check_array("runs.channels", self.channels, ndim_min=1, ndim=ndim, dtypes=(jnp.int32,))
        B.check_array("runs.depths", self.depths, ndim_min=1, ndim=ndim, dtypes=(jnp.int32,))
        if self.depths.shape != self.channels.shape:
            raise ValueError(f"runs: channels/depths must both be [*batch, C], got {self.channels.shape}, "
                             f"{self.depths.shape}")
        check_run_list(self.channels, self.depths, head_dim)

    def flat(self) -> RunList:
        """The list over one group axis ``[R, C]`` (a free reshape)."""
        r, c = B.prod(self.batch), self.channels.shape[-1]
        return dataclasses.replace(self, channels=self.channels.reshape(r, c), depths=self.depths.reshape(r, c))

    def slots(self) -> RunList:
        """The run list of the staged buffer a gather wrote from this one: slot ``c`` reads slot ``c`` (the identity
        channel list), at the same depths."""
        iota = jnp.broadcast_to(jnp.arange(self.channels.shape[-1], dtype=jnp.int32), self.channels.shape)
        return dataclasses.replace(self, channels=iota)


jax.tree_util.register_dataclass(RunList, data_fields=["channels", "depths"], meta_fields=["sorted"])


@dataclasses.dataclass(frozen=True)
class StorePlanes:
    """A channel-major plane store as a kernel reads it in place: ``planes u32 [*, D, 4, W]``, ``scales [*, D, NB]``
    (the kernels take any batch shape); with ``layer`` (an int or traced scalar) layer ``layer`` of a stacked
    ``[L, R, D, 4, W]`` / ``[L, R, D, NB]`` store, whose groups ``group_start ..`` (static) are read: work split over
    groups never slices the store, which may be a ``pinned_host`` array no XLA op may touch. The staged buffer a
    gather returns is one too: ``StorePlanes(planes [Rc, C, 4, W], scales [Rc, C, NB])``, read with
    :meth:`RunList.slots`."""

    planes: jax.Array  # u32 [*, D, 4, W]  or [L, R, D, 4, W] with a layer
    scales: jax.Array  # f16 [*, D, NB]    or [L, R, D, NB]
    layer: jax.Array | int | None = None
    group_start: int = 0

    @property
    def head_dim(self) -> int:
        return self.planes.shape[-3]

    @property
    def width(self) -> int:
        return self.planes.shape[-1]

    def check(self, request_batch: tuple, name: str) -> tuple:
        """Dtypes and shapes of the store; returns the batch shape of the per-group operands that read it (those of
        ``request_batch``: the whole store's batch, or a window of a stacked store's groups)."""
        planes, scales, layer = self.planes, self.scales, self.layer
        B.check_array("store.planes", planes, ndim_min=3, dtypes=(jnp.uint32,))
        B.check_array("store.scales", scales, ndim_min=2, dtypes=(jnp.float16, jnp.float32))
        lead = 1 if layer is not None else 0
        if layer is not None and (planes.ndim != 5 or scales.ndim != 4):
            raise ValueError(f"store planes/scales: with a layer index they must be [L, R, D, 4, W] / [L, R, D, NB], "
                             f"got {planes.shape} / {scales.shape}")
        *store_batch, d, four, w = planes.shape[lead:]
        if four != N_PLANES:
            raise ValueError(f"store.planes must be [*, D, 4, W], got {planes.shape}")
        if w % 2:
            raise ValueError(f"plane width W={w} must be even (capacity a multiple of 64)")
        if scales.shape[lead:] != (*store_batch, d, w // 2) or scales.shape[:lead] != planes.shape[:lead]:
            raise ValueError(f"store.scales must be {planes.shape[:lead] + (*store_batch, d, w // 2)}, got "
                             f"{scales.shape}")
        return B.request_groups(tuple(store_batch), request_batch, layer, self.group_start, name)

    def stacked(self) -> StorePlanes:
        """The store as the kernels index it: ``[L, R, ...]`` at ``layer i32 [1]`` (a plain store viewed as layer 0
        of ``[1, prod(batch), ...]``, a free reshape; a stacked one untouched)."""
        planes, layer = B.layered(self.planes, self.layer, 3, "store.planes")
        scales, _ = B.layered(self.scales, self.layer, 2, "store.scales")
        return StorePlanes(planes, scales, layer, self.group_start)

    def read(self, groups: int) -> tuple[jax.Array, jax.Array]:
        """``(planes, scales)`` of the groups a request over ``groups`` groups reads (plain jnp, for the references;
        a plain store whole)."""
        if self.layer is None:
            return self.planes, self.scales
        window = slice(self.group_start, self.group_start + groups)
        return self.planes[self.layer][window], self.scales[self.layer][window]


jax.tree_util.register_dataclass(StorePlanes, data_fields=["planes", "scales", "layer"], meta_fields=["group_start"])


@dataclasses.dataclass(frozen=True)
class LayerTiers:
    """A stacked store in two tiers (:mod:`pallas_kernels.plane_layout`) at ``layer`` (an int or traced scalar), for
    groups ``group_start ..`` (static). ``tier_write`` writes layers ``layer ..`` of every group and reads no
    ``scales`` (None there is fine).

    ``warm`` (optional, device memory: the warm tier) holds copies of some channel planes past the resident ones,
    chosen per group: ``warm_map[l, r, j, i]`` is one plus the row of ``warm[l, r]`` holding plane ``i`` of channel
    ``j`` (0: none, so a map of zeros holds nothing). A channel's mapped planes are the ones right after the resident
    planes (``[p_l, h_j)``), so a read of depth ``t`` crosses the link for planes ``[h_j, t)`` only; the cold tier
    still holds every plane ``>= p_l``."""

    hot: jax.Array  # u32 [Nh, R, D, W]  planes i < p_l (device memory)
    cold: jax.Array  # u32 [Nc, R, D, W]  planes i >= p_l (pinned_host on the GPU)
    scales: jax.Array | None  # f16 [L, R, D, NB]
    table: jax.Array  # i32 [L, 3]  tier_table(resident)
    layer: jax.Array | int = 0
    group_start: int = 0
    warm: jax.Array | None = None  # u32 [L, R, S, W]  copies of channel planes i >= p_l (device memory)
    warm_map: jax.Array | None = None  # i32 [L, R, D, 4]  1 + the row of warm holding (channel, plane), or 0

    def check(self, request_groups: int, name: str) -> None:
        """Dtypes and shapes of the tiers and ``scales``; ``request_groups`` groups from ``group_start`` must lie in
        the store."""
        B.check_array("tiers.hot", self.hot, ndim=4, dtypes=(jnp.uint32,))
        B.check_array("tiers.cold", self.cold, ndim=4, dtypes=(jnp.uint32,))
        B.check_array("tiers.scales", self.scales, ndim=4, dtypes=(jnp.float16, jnp.float32))
        B.check_array("tiers.table", self.table, ndim=2, dtypes=(jnp.int32,))
        layers, groups, d, nb = self.scales.shape
        if self.cold.shape[1:] != (groups, d, 2 * nb):
            raise ValueError(f"tiers.cold must be [N, R, D, W] with R, D = {groups, d} and W = 2 NB = {2 * nb}, got "
                             f"{self.cold.shape}")
        if self.hot.shape[1:] != self.cold.shape[1:]:
            raise ValueError(f"tiers.hot and tiers.cold must be [N, R, D, W] of one R, D, W, got {self.hot.shape} and "
                             f"{self.cold.shape}")
        if self.table.shape != (layers, 3):
            raise ValueError(f"tiers.table must be [L, 3] = [{layers}, 3], got {self.table.shape}")
        B.request_groups((groups,), (request_groups,), 0, self.group_start, name)
        if (self.warm is None) != (self.warm_map is None):
            raise ValueError("tiers.warm and tiers.warm_map come together (both or neither)")
        if self.warm is not None:
            B.check_array("tiers.warm", self.warm, ndim=4, dtypes=(jnp.uint32,))
            B.check_array("tiers.warm_map", self.warm_map, ndim=4, dtypes=(jnp.int32,))
            if self.warm.shape[:2] != (layers, groups) or self.warm.shape[3] != 2 * nb:
                raise ValueError(f"tiers.warm must be [L, R, S, W] with L, R = {layers, groups} and W = {2 * nb}, got "
                                 f"{self.warm.shape}")
            if self.warm_map.shape != (layers, groups, d, N_PLANES):
                raise ValueError(f"tiers.warm_map must be [L, R, D, 4] = {[layers, groups, d, N_PLANES]}, got "
                                 f"{self.warm_map.shape}")

    def layer_index(self) -> jax.Array:
        """``layer`` as the kernels take it: ``i32 [1]``."""
        return jnp.reshape(jnp.asarray(self.layer, jnp.int32), (1,))

    def warm_rows(self, channels: jax.Array) -> jax.Array:
        """``i32 [Rc, C, 4]``: the row of ``warm`` holding each plane of slot ``c``'s channel ``channels[r, c]`` at
        this layer (-1: none), for the window's groups (plain jnp)."""
        layer = jnp.reshape(jnp.asarray(self.layer, jnp.int32), ())  # an int, a scalar or the kernels' i32 [1]
        layer_map = jax.lax.dynamic_index_in_dim(self.warm_map, layer, keepdims=False)
        window = layer_map[self.group_start:self.group_start + channels.shape[0]]  # [Rc, D, 4]
        return jnp.take_along_axis(window, channels[:, :, None], axis=1) - 1

    def first_planes(self, channels: jax.Array) -> jax.Array:
        """``i32 [Rc, C]``: the first plane of each slot's channel that only the cold tier holds (``p_l`` plus its
        planes in ``warm``): what a gather moves over the link starts there."""
        p = jnp.asarray(self.table, jnp.int32)[jnp.reshape(jnp.asarray(self.layer, jnp.int32), ()), 0]
        return p + jnp.sum((self.warm_rows(channels) >= 0).astype(jnp.int32), axis=-1)


jax.tree_util.register_dataclass(LayerTiers, data_fields=["hot", "cold", "scales", "table", "layer", "warm",
                                                          "warm_map"], meta_fields=["group_start"])


@dataclasses.dataclass(frozen=True)
class ResidentPlanes:
    """Planes ``[0, p_l)`` of a staged scan read in place from a tiered store's hot tier (and its warm tier's planes
    from there).

    With a staged buffer from :func:`pallas_kernels.tier_gather.tier_gather` (which stages only the planes past the
    resident ones), slot ``c`` of group ``r`` reads plane ``i < p_l`` from ``hot[table[layer, 1] + i, group_start + r,
    channels[r, c]]`` of ``tiers``, a plane the warm tier holds from ``warm[layer, group_start + r, row]``
    (:meth:`~pallas_kernels.operands.LayerTiers.warm_rows`), and the others from the staged buffer. ``channels [Rc,
    C]``: the store channel of each slot (the run list the gather staged)."""

    tiers: LayerTiers
    channels: jax.Array  # i32 [Rc, C]

    def planes(self, staged):
        """The staged buffer ``[Rc, C, 4, W]`` with its resident and warm planes filled in (plain jnp)."""
        tiers = self.tiers
        p, hot_row = tiers.table[tiers.layer, 0], tiers.table[tiers.layer, 1]
        groups = slice(tiers.group_start, tiers.group_start + self.channels.shape[0])
        hot = jnp.take_along_axis(tier_rows(tiers.hot, hot_row, groups), self.channels[..., None, None], axis=-3)
        planes = jnp.where(jnp.arange(N_PLANES)[:, None] < p, hot, staged)
        if tiers.warm is None:
            return planes
        rows = tiers.warm_rows(self.channels)  # [Rc, C, 4]
        warm = jax.lax.dynamic_index_in_dim(tiers.warm, jnp.asarray(tiers.layer, jnp.int32), keepdims=False)[groups]
        held = jnp.take_along_axis(warm[:, None], jnp.maximum(rows, 0)[..., None], axis=2)  # [Rc, C, 4, W]
        return jnp.where(rows[..., None] >= 0, held, planes)

    def check(self, store: StorePlanes, runs: RunList, name: str) -> None:
        """Dtypes and shapes against the staged buffer ``store`` and the run list it was staged from."""
        tiers = self.tiers
        B.check_array("resident.tiers.hot", tiers.hot, ndim=4, dtypes=(jnp.uint32,))
        B.check_array("resident.tiers.table", tiers.table, ndim=2, dtypes=(jnp.int32,))
        B.check_array("resident.channels", self.channels, ndim=2, dtypes=(jnp.int32,))
        if store.layer is not None or store.planes.ndim != 4:
            raise ValueError(f"resident planes go with a staged buffer [Rc, C, 4, W] and no layer, got planes "
                             f"{store.planes.shape} and layer {store.layer}")
        if self.channels.shape != runs.channels.shape:
            raise ValueError(f"resident.channels must be [Rc, C] = {runs.channels.shape}, got {self.channels.shape}")
        if tiers.hot.shape[-1] != store.width or tiers.table.shape[1:] != (3,):
            raise ValueError(f"resident.tiers.hot must be [Nh, R, D, W = {store.width}] and table [L, 3], got "
                             f"{tiers.hot.shape}, {tiers.table.shape}")
        B.request_groups(tiers.hot.shape[1:2], runs.channels.shape[:1], 0, tiers.group_start, f"{name} (resident)")
        if (tiers.warm is None) != (tiers.warm_map is None):
            raise ValueError("resident.tiers.warm and warm_map come together (both or neither)")
        if tiers.warm is not None:
            B.check_array("resident.tiers.warm", tiers.warm, ndim=4, dtypes=(jnp.uint32,))
            B.check_array("resident.tiers.warm_map", tiers.warm_map, ndim=4, dtypes=(jnp.int32,))
            if tiers.warm.shape[1] != tiers.hot.shape[1] or tiers.warm.shape[3] != store.width:
                raise ValueError(f"resident.tiers.warm must be [L, R = {tiers.hot.shape[1]}, S, W = {store.width}], got "
                                 f"{tiers.warm.shape}")
            if tiers.warm_map.shape[:2] != tiers.warm.shape[:2] or tiers.warm_map.shape[3] != N_PLANES:
                raise ValueError(f"resident.tiers.warm_map must be [L, R, D, 4] of the warm tier's L, R, got "
                                 f"{tiers.warm_map.shape}")

    def kernel_operands(self) -> tuple:
        """What the kernel reads: ``(hot u32 [Nh, R, D, W], (p_l, first hot row) i32 [2], channels i32 [Rc, C])``; with
        a warm tier ``(p_l, first hot row, layer) i32 [3]`` and then ``(warm u32 [L, R, S, W], rows i32 [Rc, C, 4])``."""
        tiers = self.tiers
        info = tiers.table[tiers.layer, :2]
        if tiers.warm is None:
            return tiers.hot, info, self.channels
        info = jnp.concatenate([info, tiers.layer_index()])
        return tiers.hot, info, self.channels, tiers.warm, tiers.warm_rows(self.channels)


jax.tree_util.register_dataclass(ResidentPlanes, data_fields=["tiers", "channels"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class StoredRows:
    """The K/V rows a fetch reads, in place: ``keys`` (and ``values``, or None to fetch rows of ``keys`` alone)
    ``[*, n, F]``; with ``layer`` (an int or traced scalar) layer ``layer`` of stacked ``[L, R, n, F]`` caches, whose
    groups ``group_start ..`` (static) are read. ``columns=(start, width)`` (static): features ``start:start +
    width`` of every row (default all), e.g. the keys of a cache that keeps K and V side by side."""

    keys: jax.Array  # [*, n, F]  or [L, R, n, F] with a layer
    values: jax.Array | None = None  # as keys
    layer: jax.Array | int | None = None
    group_start: int = 0
    columns: tuple[int, int] | None = None

    def window(self) -> tuple[int, int]:
        """``(start, width)`` of the features read."""
        return (0, self.keys.shape[-1]) if self.columns is None else (int(self.columns[0]), int(self.columns[1]))


jax.tree_util.register_dataclass(StoredRows, data_fields=["keys", "values", "layer"],
                                 meta_fields=["group_start", "columns"])
