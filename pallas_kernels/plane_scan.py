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

The kernel (its bodies in :mod:`pallas_kernels.plane_scan_bodies`, its launch in
:mod:`pallas_kernels.plane_scan_common`): one
program per (group, tile of tokens), one loop per depth class over the listed channels, in f32 (``PlaneScanConfig.math = "f32"``, exact to f32 rounding) or on pairs of
tokens in packed f16 (``"f16x2"``: half the arithmetic, scores within :func:`f16x2_error_bound` of the exact ones).
Planes and scales are read in place through ``memory_space=ANY`` refs, so they may live in ``pinned_host`` memory (a
stacked ``[L, R, ...]`` cache indexed by the store's ``layer``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import backend as B
from pallas_kernels import plane_scan_bodies as bodies
from pallas_kernels import plane_scan_common as common
from pallas_kernels.plane_scan_common import PlaneScanConfig  # noqa: F401 (this module's API too)
from pallas_kernels.operands import ResidentPlanes, RunList, StorePlanes  # noqa: F401 (ResidentPlanes: API)
from pallas_kernels.plane_layout import BLOCK_TOKENS, WORD_BITS

KERNEL_NAME = "fathom_plane_scan"


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


# ----------------------------------------------------------------------------------------------
# Reference (plain jnp, independent of the kernel)


def plane_scan_reference(q, store: StorePlanes, length, runs: RunList, *, resident: ResidentPlanes | None = None):
    """Scores ``[*, G, n]`` by unpacking the selected channels' planes to codes and dequantizing."""
    common.check_scan_inputs(q, store, length, runs, "plane_scan")
    return common.scores_reference(q, store, length, runs, resident=resident)


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
    r, g = q.shape[:2]
    split = WORD_BITS // config.lanes
    out = common.scan_call(
        q, store, length, runs, extra, config=config, interpret=interpret, hot_group_start=hot_group_start,
        epilogue=bodies.store_scores,
        out_shape=jax.ShapeDtypeStruct((r, g, store.width * split, config.lanes), jnp.float32),
        name=KERNEL_NAME if config.math == "f32" else f"{KERNEL_NAME}_{config.math}")
    return out.reshape(r, g, store.width * WORD_BITS)


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
    common.check_scan_inputs(q, store, length, runs, "plane_scan")
    if resident is not None:
        resident.check(store, runs, "plane_scan")
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
