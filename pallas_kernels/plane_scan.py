"""Fathom plane scan: approximate scores of all tokens from the first ``t_j`` bit planes of active channels.

For one (sequence, KV head) group and its ``G`` query heads::

    score[h, i] = sum_j q[h, j] * value_j(i; t_j)
    value(t) = (c_t + 1/2 - 2^(t-1)) * a / 2^(t-1),  c_t = c >> (4 - t),  0 at t = 0

with ``a`` the token's fp16 block scale (64-token blocks). Tokens at positions ``>= length`` score 0,
so the result equals ``q @ store.dequantize(store, depth).T`` (in the store's basis: pass KLT-rotated
queries for a KLT store).

The active channels come as a fixed-size run list (:class:`~pallas_kernels.operands.RunList`: ``channels [R, C]``
/ ``depths [R, C]``); slots of depth 0 cost nothing. :func:`active_channels` builds the list from per-channel depths
(e.g. ``ReadPlan.depths``), sorted by decreasing depth, so the kernel runs one loop per *depth class* (t = 4, 3, 2,
1) with the depth a compile-time constant. The store is a :class:`~pallas_kernels.operands.StorePlanes`.

The kernel (:mod:`pallas_kernels.plane_scan_bodies`): one program per (group, tile of tokens), one loop per depth
class over the listed channels, in f32 (``PlaneScanConfig.math = "f32"``, exact to f32 rounding) or on pairs of
tokens in packed f16 (``"f16x2"``: half the arithmetic, scores within :func:`f16x2_error_bound` of the exact ones).
Planes and scales are read in place through ``memory_space=ANY`` refs, so they may live in ``pinned_host`` memory (a
stacked ``[L, R, ...]`` cache indexed by the store's ``layer``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import backend as B
from pallas_kernels import plane_scan_bodies as bodies
from pallas_kernels.operands import LayerTiers, RunList, StorePlanes
from pallas_kernels.plane_layout import BLOCK_TOKENS, N_PLANES, WORD_BITS, tier_rows

KERNEL_NAME = "fathom_plane_scan"
MATHS = ("f32", "f16x2")


@dataclasses.dataclass(frozen=True)
class PlaneScanConfig:
    """Static tuning of the plane scan.

    ``tile``: tokens per program (a power of two, >= 32 * lanes); ``lanes``: consecutive tokens per
    thread (8, 16 or 32); ``num_warps`` / ``num_stages``: Triton launch parameters; ``math``: the kernel's arithmetic,
    ``"f32"`` or ``"f16x2"`` (pairs of tokens in packed f16, ``lanes = 32``; :mod:`pallas_kernels.plane_scan_bodies`).
    ``tile`` and ``lanes`` default to the H200's best for the arithmetic (``results/kernels_h200.md``).
    """

    tile: int | None = None
    lanes: int | None = None
    num_warps: int = 1
    num_stages: int | None = None
    math: str = "f32"

    def __post_init__(self):
        if self.math not in MATHS:
            raise ValueError(f"math must be one of {MATHS}, got {self.math!r}")
        wide = self.math == "f16x2"
        if self.lanes is None:
            object.__setattr__(self, "lanes", WORD_BITS if wide else 16)
        if self.tile is None:
            object.__setattr__(self, "tile", 1024 if wide else 512)
        B.check_pow2("tile", self.tile)
        if self.lanes not in (8, 16, 32) or self.tile < WORD_BITS * self.lanes:
            raise ValueError(f"lanes must be 8, 16 or 32 with tile >= 32 * lanes, got lanes={self.lanes}, tile={self.tile}")
        if wide and self.lanes != WORD_BITS:
            raise ValueError(f"math='f16x2' pairs the tokens of a whole plane word: it needs lanes=32, "
                             f"got {self.lanes}")

    @classmethod
    def heuristic(cls, capacity: int, math: str = "f32") -> "PlaneScanConfig":
        """The defaults for ``math`` (f32: 16 lanes, 512-token tiles, 1 warp: the H200's best from 32k to 128k tokens,
        ``results/kernels_h200.md``; f16x2: 1024-token tiles, 1 warp, within 2% of the best of three shapes,
        ``results/kernels_h200_f16x2.md``); small stores keep the same shape."""
        del capacity
        return cls(math=math)


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


# ----------------------------------------------------------------------------------------------
# Active-channel list


def active_channels(depths, max_active: int | None = None) -> RunList:
    """Fixed-size active-channel list from per-channel depths ``[*, D]`` (e.g. ``ReadPlan.depths``).

    Returns the run list ``(channels [*, C], depths [*, C])`` int32 with ``C = max_active`` (default ``D``), sorted by
    decreasing depth (stable in channel index; ``sorted=True``); slots past the active channels have depth 0. If more
    than ``C`` channels are active the shallowest ones are dropped (use ``C = D`` to keep all).
    """
    depths = jnp.asarray(depths, jnp.int32)
    d = depths.shape[-1]
    c = d if not max_active else int(max_active)
    if not 1 <= c <= d:
        raise ValueError(f"max_active must lie in [1, {d}], got {c}")
    order = jnp.argsort(-depths, axis=-1, stable=True)[..., :c].astype(jnp.int32)
    return RunList(order, jnp.take_along_axis(depths, order, axis=-1), sorted=True)


def _class_bounds(depths):
    """``[*, 4]`` end offsets of the depth classes 4, 3, 2, 1 in a list sorted by decreasing depth."""
    counts = jnp.stack([jnp.sum(depths == t, axis=-1) for t in (4, 3, 2, 1)], axis=-1)
    return jnp.cumsum(counts, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Validation


def _validate(q, store: StorePlanes, length, runs: RunList):
    B.check_array("q", q, ndim_min=2, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16))
    batch = store.check(q.shape[:-2], "plane_scan")
    d = store.head_dim
    runs.check(d)
    if q.shape[:-2] != batch or q.shape[-1] != d:
        raise ValueError(f"q must be [*batch, G, D] = [{batch}, G, {d}], got {q.shape}")
    if jnp.shape(length) != batch:
        raise ValueError(f"length must have the batch shape {batch}, got {jnp.shape(length)}")
    if runs.batch != batch:
        raise ValueError(f"runs: channels/depths must both be [*batch, C] = [{batch}, C], got {runs.channels.shape}")


def _validate_resident(resident: ResidentPlanes, store: StorePlanes, runs: RunList) -> None:
    tiers = resident.tiers
    B.check_array("resident.tiers.hot", tiers.hot, ndim=4, dtypes=(jnp.uint32,))
    B.check_array("resident.tiers.table", tiers.table, ndim=2, dtypes=(jnp.int32,))
    B.check_array("resident.channels", resident.channels, ndim=2, dtypes=(jnp.int32,))
    if store.layer is not None or store.planes.ndim != 4:
        raise ValueError(f"resident planes go with a staged buffer [Rc, C, 4, W] and no layer, got planes "
                         f"{store.planes.shape} and layer {store.layer}")
    if resident.channels.shape != runs.channels.shape:
        raise ValueError(f"resident.channels must be [Rc, C] = {runs.channels.shape}, got {resident.channels.shape}")
    if tiers.hot.shape[-1] != store.width or tiers.table.shape[1:] != (3,):
        raise ValueError(f"resident.tiers.hot must be [Nh, R, D, W = {store.width}] and table [L, 3], got "
                         f"{tiers.hot.shape}, {tiers.table.shape}")
    B.request_groups(tiers.hot.shape[1:2], runs.channels.shape[:1], 0, tiers.group_start, "plane_scan (resident)")
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


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp, independent of the kernel)


def plane_scan_reference(q, store: StorePlanes, length, runs: RunList, *, resident: ResidentPlanes | None = None):
    """Scores ``[*, G, n]`` by unpacking the selected channels' planes to codes and dequantizing."""
    _validate(q, store, length, runs)
    if resident is not None:
        store = dataclasses.replace(store, planes=resident.planes(store.planes))
    planes, scales = store.read(q.shape[0])
    channels, depths = runs.channels, runs.depths
    *batch, d, _, w = planes.shape
    n = WORD_BITS * w
    sel = jnp.take_along_axis(planes, channels[..., :, None, None], axis=-3)  # [*, C, 4, W]
    bits = (sel[..., None] >> jnp.arange(WORD_BITS, dtype=jnp.uint32)) & 1  # [*, C, 4, W, 32]
    bits = bits.reshape(*sel.shape[:-1], n).astype(jnp.int32)  # [*, C, 4, n]
    t = depths[..., :, None]  # [*, C, 1]
    code = jnp.zeros(bits.shape[:-2] + (n,), jnp.int32)
    for p in range(N_PLANES):  # plane p is bit (t-1-p) of c_t when p < t
        code = code + jnp.where(p < t, bits[..., p, :] << jnp.maximum(t - 1 - p, 0), 0)
    half = jnp.left_shift(1, jnp.maximum(t, 1) - 1).astype(jnp.float32)
    a = jnp.take_along_axis(scales, channels[..., :, None], axis=-2).astype(jnp.float32)  # [*, C, NB]
    a = jnp.repeat(a, BLOCK_TOKENS, axis=-1)  # [*, C, n]
    value = jnp.where(t > 0, (code.astype(jnp.float32) + 0.5 - half) * a / half, 0.0)
    value = jnp.where(jnp.arange(n) < jnp.asarray(length)[..., None, None], value, 0.0)
    qc = jnp.take_along_axis(q.astype(jnp.float32), channels[..., None, :], axis=-1)  # [*, G, C]
    return jnp.einsum("...gc,...cn->...gn", qc, value, precision=jax.lax.Precision.HIGHEST)


def f16x2_error_bound(q, store: StorePlanes, runs: RunList):
    """How far the ``f16x2`` kernel's scores may lie from the exact ones, per token ``f32 [*, n]`` (every head).

    Its weights ``q_j a_j / 2^(t-1)`` and each of its ``C`` partial sums (``C`` = the listed channels of depth > 0)
    round to f16 once, each term and sum bounded by ``S = sum_j max_h |q_hj| a_j`` (``a_j`` the token's block
    scale): ``(C + 2) 2^-11 S``, plus ``C 2^-33 qbound a_max`` for weights and sums under f16's normal range
    (``qbound = sum_j max_h |q_hj|``, ``a_max`` the block's largest listed scale: the kernel scales its sums to below
    ``2^14`` by them)."""
    planes, scales = store.read(q.shape[0])
    del planes
    active = runs.depths > 0  # [*, C]
    qc = jnp.take_along_axis(q.astype(jnp.float32), runs.channels[..., None, :], axis=-1)  # [*, G, C]
    qmax = jnp.where(active, jnp.max(jnp.abs(qc), axis=-2), 0.0)
    a = jnp.take_along_axis(scales, runs.channels[..., :, None], axis=-2).astype(jnp.float32)  # [*, C, NB]
    a = jnp.where(active[..., None], a, 0.0)
    count = jnp.sum(active, axis=-1)[..., None].astype(jnp.float32)
    per_block = (count + 2) * 2.0**-11 * jnp.einsum("...c,...cb->...b", qmax, a) + (
        count * 2.0**-33 * jnp.sum(qmax, axis=-1)[..., None] * jnp.max(a, axis=-2))
    return jnp.repeat(per_block, BLOCK_TOKENS, axis=-1)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "hot_group_start"))
def _plane_scan_pallas(q, store: StorePlanes, length, runs: RunList, extra: tuple, *, config, interpret,
                       hot_group_start):
    """q [Rc, G, D], store [L, R, D, 4, W] / [L, R, D, NB] at layer i32[1], length and runs over Rc; ``extra``: the
    resident planes' operands (:meth:`ResidentPlanes.kernel_operands`, hot tier groups ``hot_group_start ..``)."""
    w = store.width
    r, g = q.shape[:2]
    channels, depths = runs.channels, runs.depths
    if not runs.sorted:
        order = jnp.argsort(-depths, axis=-1, stable=True)
        channels = jnp.take_along_axis(channels, order, axis=-1)
        depths = jnp.take_along_axis(depths, order, axis=-1)
        if extra:  # the kernel reads slot k's resident planes at its store channel (and its warm rows)
            hot, table, channels_in, *warm = extra
            warm = warm and [warm[0], jnp.take_along_axis(warm[1], order[..., None], axis=1)]
            extra = (hot, table, jnp.take_along_axis(channels_in, order, axis=-1), *warm)
    bounds = _class_bounds(depths)
    qc = jnp.take_along_axis(q.astype(jnp.float32), channels[:, None, :], axis=-1)
    split = WORD_BITS // config.lanes
    elems = config.tile // config.lanes
    inputs = (qc, channels, bounds, length, store.layer, store.planes, store.scales, *extra)
    if config.math == "f16x2":  # each thread's sums are bounded through the listed channels' largest |q|
        body = bodies.f16x2_body
        inputs = (qc, jnp.sum(jnp.where(depths[:, None, :] > 0, jnp.abs(qc), 0.0).max(axis=1), axis=-1), *inputs[1:])
    else:
        body = bodies.f32_body
    kernel = functools.partial(body, groups=g, elems=elems, lanes=config.lanes, num_words=w,
                               group_start=store.group_start, hot_group_start=hot_group_start, interpret=interpret)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((r, g, w * split, config.lanes), jnp.float32),
        grid=(r, pl.cdiv(w * split, elems)),
        in_specs=[B.any_spec()] * len(inputs),
        interpret=interpret,
        name=KERNEL_NAME if config.math == "f32" else f"{KERNEL_NAME}_{config.math}",
        compiler_params=B.compiler_params(config.num_warps, config.num_stages),
    )(*inputs)
    return out.reshape(r, g, w * WORD_BITS)


def plane_scan(
    q,  # [*, G, D] queries (store basis)
    store: StorePlanes,  # planes u32 [*, D, 4, W], scales f16 [*, D, NB] (or a layer of a stacked store)
    length,  # i32 [*]
    runs: RunList,  # i32 [*, C] channels and depths
    *,
    resident: ResidentPlanes | None = None,
    implementation: B.Implementation | None = None,
    config: PlaneScanConfig | None = None,
    interpret: bool | None = None,
):
    """Approximate scores ``f32 [*, G, n]`` (``n = 32 W``) of every token for the ``G`` query heads.

    A ``store`` at a layer (an int or traced scalar) is read in place (no copy or reshape of the store: it may be a
    ``pinned_host`` array); queries ``[Rc, G, D]`` then read its groups ``store.group_start .. + Rc - 1``. A run list
    sorted by decreasing depth (``runs.sorted``, :func:`active_channels`'s) skips the (tiny) sort by depth.
    ``resident``: a staged buffer's resident planes are read in place from a tiered store's hot tier
    (:class:`ResidentPlanes`; the store a staged buffer ``[Rc, C, 4, W]`` without a layer).
    """
    implementation = B.resolve_implementation(implementation)
    _validate(q, store, length, runs)
    if resident is not None:
        _validate_resident(resident, store, runs)
    if implementation == "xla":
        return plane_scan_reference(q, store, length, runs, resident=resident)
    config = config or PlaneScanConfig.heuristic(store.width * WORD_BITS)
    batch = q.shape[:-2]
    r = B.prod(batch)
    extra, hot_group_start = ((), None) if resident is None else (resident.kernel_operands(),
                                                                  resident.tiers.group_start)
    out = _plane_scan_pallas(q.reshape(r, *q.shape[-2:]), store.stacked(), jnp.asarray(length, jnp.int32).reshape(r),
                             runs.flat(), extra, config=config, interpret=B.resolve_interpret(interpret),
                             hot_group_start=hot_group_start)
    return out.reshape(*batch, *out.shape[1:])


def plane_scan_store(q, store, depths, *, max_active: int | None = None, **kwargs):
    """Scan a plane store (``planes``, ``scales`` and ``length`` fields) at per-channel ``depths [*, D]`` (e.g. a read
    plan's)."""
    runs = active_channels(depths, max_active)
    return plane_scan(q, StorePlanes(store.planes, store.scales), store.length, runs, **kwargs)
