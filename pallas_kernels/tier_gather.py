"""Tiered run gather: the planned planes of each active channel that live in host memory, with its scales, into an
HBM staging buffer; the plane scan reads the resident planes where they are.

A plane store held in two tiers (:mod:`pallas_kernels.plane_layout`) keeps, per layer ``l``, planes ``[0, p_l)`` of
every channel in device memory and planes ``[p_l, 4)`` in ``pinned_host`` memory, each tier plane-major (one row of
``W`` words per (plane, group, channel))::

    hot    u32 [Nh, R, D, W]   plane i < p_l of layer l at row table[l, 1] + i
    cold   u32 [Nc, R, D, W]   plane i >= p_l of layer l at row table[l, 2] + i - p_l
    scales f16 [L, R, D, NB]   (device memory)
    table  i32 [L, 3]          (p_l, first hot row, first cold row) per layer

Given these at ``layer`` for groups ``group_start ..`` (a :class:`~pallas_kernels.operands.LayerTiers`) and a
fixed-size run list ``runs`` = ``channels [Rc, C]`` / ``depths [Rc, C]``, it writes::

    staged_planes  u32 [Rc, C, 4, W]   slot c, plane p_l <= i < t_c: plane i of channel channels[c] (from cold)
    staged_scales  f16 [Rc, C, NB]     slot c with t_c > 0: scales[channels[c]]

(with ``tiers.warm``, copies of chosen channel planes past ``p_l`` in device memory: planes ``h_c <= i < t_c``,
``h_c`` the slot's first plane outside it, :meth:`~pallas_kernels.operands.LayerTiers.first_planes`) and leaves the
slot's other planes and the slots of depth 0 unwritten: the plane scan reads planes ``i < p_l`` from the hot tier and
the ``warm`` ones from the warm tier (:class:`pallas_kernels.plane_scan.ResidentPlanes`), no plane at or past ``t_c`` and
no slot of depth 0, so nothing crosses HBM twice and only the deeper planes cross the link. Each (slot, plane) is one contiguous
run of ``W`` words. The work items (the slots of depth > 0 only) and the persistent-programs grid are the run gather's
(:func:`~pallas_kernels.gather.walk_items`, :class:`~pallas_kernels.gather.RunGatherConfig`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as B
from pallas_kernels.gather import RunGatherConfig, gather_call, staged_shape
from pallas_kernels.operands import LayerTiers, RunList, StorePlanes
from pallas_kernels.plane_layout import N_PLANES, tier_rows

KERNEL_NAME = "tier_gather"


def _validate(tiers: LayerTiers, runs: RunList):
    tiers.check(runs.channels.shape[0], "tier_gather")
    runs.check(tiers.cold.shape[2], ndim=2)


def tier_gather_reference(tiers: LayerTiers, runs: RunList) -> StorePlanes:
    """Plain-jnp gather of the same staging buffers (the planes the kernel leaves unwritten: 0)."""
    _validate(tiers, runs)
    channels, depths = runs.channels, runs.depths
    groups = slice(tiers.group_start, tiers.group_start + channels.shape[0])
    p, cold_row = tiers.table[tiers.layer, 0], tiers.table[tiers.layer, 2]
    planes = tier_rows(tiers.cold, cold_row - p, groups)  # [Rc, D, 4, W]: plane i as the cold tier would hold it
    sel = jnp.take_along_axis(planes, channels[:, :, None, None], axis=-3)  # [Rc, C, 4, W]
    plane = jnp.arange(N_PLANES)[:, None]
    first = p if tiers.warm is None else tiers.first_planes(channels)[:, :, None, None]
    keep = (plane >= first) & (plane < depths[:, :, None, None])
    staged_planes = jnp.where(keep, sel, jnp.uint32(0))
    sc = jnp.take_along_axis(tiers.scales[tiers.layer][groups], channels[:, :, None], axis=-2)
    staged_scales = jnp.where(depths[:, :, None] > 0, sc, jnp.zeros((), tiers.scales.dtype))
    return StorePlanes(staged_planes, staged_scales)


def _copy_item(refs, r, c, i, valid, *, chunk: int, width: int, group_start: int):
    """Copy work item (slot ``c`` of group ``r``, words ``i * chunk ..``) of the slot's planes in ``[p_l, t)`` (from
    the slot's first plane outside the warm tier where the tiers have one), from the cold tier, and its scales; every load
    is issued before the first store."""
    ch_ref, dep_ref, layer_ref, tier_ref, cold_ref, scales_ref, *first_ref, out_planes_ref, out_scales_ref = refs
    layer, src = layer_ref[0], r + group_start
    p, cold_row = tier_ref[layer, 0], tier_ref[layer, 2]
    first = first_ref[0][r, c] if first_ref else p
    j = ch_ref[r, c]
    t = dep_ref[r, c]
    w0 = i * chunk
    wmask = (w0 + jnp.arange(chunk, dtype=jnp.int32) < width) & valid
    data = []
    for plane in range(N_PLANES):
        k = jnp.clip(cold_row + plane - p, 0, cold_ref.shape[0] - 1)
        moved = wmask & (plane >= first) & (plane < t)
        data.append((plgpu.load(cold_ref.at[k, src, j, pl.ds(w0, chunk)], mask=moved, other=0), moved))
    half = chunk // 2
    s0 = i * half
    smask = (s0 + jnp.arange(half, dtype=jnp.int32) < width // 2) & valid
    sc = plgpu.load(scales_ref.at[layer, src, j, pl.ds(s0, half)], mask=smask, other=0)
    for plane, (words, moved) in enumerate(data):
        plgpu.store(out_planes_ref.at[r, c, jnp.int32(plane), pl.ds(w0, chunk)], words, mask=moved)
    plgpu.store(out_scales_ref.at[r, c, pl.ds(s0, half)], sc, mask=smask)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _tier_gather_pallas(tiers: LayerTiers, runs: RunList, after, *, config, interpret) -> StorePlanes:
    """``tiers.layer i32 [1]``; the kernel reads the cold tier, the table and the scales (the hot tier rides along
    unread), and with a warm tier each slot's first plane outside it."""
    width = tiers.cold.shape[-1]
    copy = functools.partial(_copy_item, width=width, group_start=tiers.group_start)
    first = () if tiers.warm is None else (tiers.first_planes(runs.channels),)
    return gather_call(copy, (tiers.layer, tiers.table, tiers.cold, tiers.scales, *first), runs, after,
                       staged_shape(runs, width, tiers.scales.dtype), config=config, interpret=interpret,
                       name=KERNEL_NAME)


def tier_gather(
    tiers: LayerTiers,  # the cold tier pinned_host on the GPU; layer and groups group_start .. read
    runs: RunList,  # i32 [Rc, C] channels and depths
    *,
    after=None,
    implementation: B.Implementation | None = None,
    config: RunGatherConfig | None = None,
    interpret: bool | None = None,
) -> StorePlanes:
    """The staged buffer ``StorePlanes(planes u32 [Rc, C, 4, W], scales [Rc, C, NB])`` of the run list's planes past
    the resident ones at ``tiers.layer`` for groups ``tiers.group_start ..`` (see the module docstring). ``after``:
    arrays the kernel waits for and never reads. A list sorted by decreasing depth (``runs.sorted``) is walked as it
    is, as by :func:`pallas_kernels.run_gather.run_gather`."""
    implementation = B.resolve_implementation(implementation)
    _validate(tiers, runs)
    if implementation == "xla":
        return tier_gather_reference(tiers, runs)
    tiers = dataclasses.replace(tiers, layer=tiers.layer_index())
    return _tier_gather_pallas(tiers, runs, tuple(jax.tree.leaves(after)),
                               config=config or RunGatherConfig(), interpret=B.resolve_interpret(interpret))
