"""Host run gather: copy each active channel's first ``t_j`` planes and its scales into an HBM staging buffer.

From a store (on the GPU a ``pinned_host`` array, read directly by the kernel through
``memory_space=ANY``; on CPU / interpret mode the same code on device memory) and a fixed-size run
list ``channels [R, C]`` / ``depths [R, C]`` (one slot per channel; slot ``c`` reads channel
``channels[c]`` to depth ``depths[c]``, 0 = nothing), write::

    staged_planes  u32 [R, C, 4, W]   slot c, plane p < t_c: planes[channels[c], p]
    staged_scales  f16 [R, C, NB]     slot c with t_c > 0: scales[channels[c]]

inside ``jit`` with no host sync, and leaves the rest unwritten (the scan reads no plane at or past a slot's depth
and no slot of depth 0; the reference writes zeros there). Each (slot, plane) is one contiguous run of ``W`` words
in the channel-major store; one work item copies ``chunk`` words of a slot's planes ``p < t``; the work items and
the two grids are :mod:`pallas_kernels.gather`'s. The staged buffer is the input of the plane scan with the identity
channel list: ``plane_scan(q_staged, staged_planes, staged_scales, length, iota(C), depths)`` with
``q_staged = q[..., channels]``.

``after`` (optional arrays, never read) orders the gather after the kernels that produced them: the
pipelined step chains each chunk's gather to the previous chunk's staged buffer, so the transfers run one
after another while the scans, selections and row fetches of earlier chunks run beside them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as B
from pallas_kernels.gather import RunGatherConfig, gather_call
from pallas_kernels.plane_layout import N_PLANES, check_run_list

KERNEL_NAME = "run_gather"


def _validate(planes, scales, channels, depths, layer, group_start=0):
    B.check_array("planes", planes, ndim_min=3, dtypes=(jnp.uint32,))
    B.check_array("scales", scales, ndim_min=2, dtypes=(jnp.float16, jnp.float32))
    B.check_array("channels", channels, ndim_min=1, dtypes=(jnp.int32,))
    B.check_array("depths", depths, ndim_min=1, dtypes=(jnp.int32,))
    lead = 1 if layer is not None else 0
    *store_batch, d, four, w = planes.shape[lead:]
    if four != N_PLANES or w % 2:
        raise ValueError(f"planes must be [*, D, 4, W] with W even, got {planes.shape}")
    if scales.shape[lead:] != (*store_batch, d, w // 2):
        raise ValueError(f"scales must be {(*store_batch, d, w // 2)} after the layer axis, got {scales.shape}")
    if depths.shape != channels.shape:
        raise ValueError(f"channels/depths must be [*batch, C], got {channels.shape}, {depths.shape}")
    batch = B.request_groups(tuple(store_batch), channels.shape[:-1], layer, group_start, "run_gather")
    if channels.shape[:-1] != batch:
        raise ValueError(f"channels/depths must be [*batch, C] with batch {batch}, got {channels.shape}")


def run_gather_reference(planes, scales, channels, depths, *, layer=None, group_start: int = 0):
    """Plain-jnp gather of the same staging buffers."""
    _validate(planes, scales, channels, depths, layer, group_start)
    if layer is not None:
        groups = slice(group_start, group_start + channels.shape[0])
        planes, scales = planes[layer][groups], scales[layer][groups]
    sel = jnp.take_along_axis(planes, channels[..., :, None, None], axis=-3)  # [*, C, 4, W]
    keep = jnp.arange(N_PLANES)[:, None] < depths[..., :, None, None]
    staged_planes = jnp.where(keep, sel, jnp.uint32(0))
    sc = jnp.take_along_axis(scales, channels[..., :, None], axis=-2)
    staged_scales = jnp.where(depths[..., :, None] > 0, sc, jnp.zeros((), scales.dtype))
    return staged_planes, staged_scales


def _copy_item(refs, r, c, i, valid, *, chunk: int, width: int, group_start: int):
    """Copy work item (slot ``c`` of group ``r``, words ``i * chunk ..``) of all four planes and its scales;
    every load is issued before the first store, so the four planes' bytes are in flight together."""
    ch_ref, dep_ref, layer_ref, planes_ref, scales_ref, out_planes_ref, out_scales_ref = refs
    layer, src = layer_ref[0], r + group_start
    j = ch_ref[r, c]
    t = dep_ref[r, c]
    w0 = i * chunk
    wmask = (w0 + jnp.arange(chunk, dtype=jnp.int32) < width) & valid
    data = [plgpu.load(planes_ref.at[layer, src, j, jnp.int32(p), pl.ds(w0, chunk)], mask=wmask & (p < t), other=0)
            for p in range(N_PLANES)]
    half = chunk // 2
    s0 = i * half
    smask = (s0 + jnp.arange(half, dtype=jnp.int32) < width // 2) & valid
    sc = plgpu.load(scales_ref.at[layer, src, j, pl.ds(s0, half)], mask=smask, other=0)
    for p in range(N_PLANES):
        plgpu.store(out_planes_ref.at[r, c, jnp.int32(p), pl.ds(w0, chunk)], data[p], mask=wmask & (p < t))
    plgpu.store(out_scales_ref.at[r, c, pl.ds(s0, half)], sc, mask=smask)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "group_start", "assume_sorted"))
def _run_gather_pallas(planes, scales, channels, depths, layer, after, *, config, interpret, group_start,
                       assume_sorted):
    """planes ``[L, R, D, 4, W]`` (any memory space; groups group_start.. are read), scales ``[L, R, D, NB]``."""
    return gather_call(_copy_item, (planes, scales), channels, depths, layer, after, width=planes.shape[-1],
                       scales_dtype=scales.dtype, config=config, interpret=interpret, group_start=group_start,
                       assume_sorted=assume_sorted, name=KERNEL_NAME)


def run_gather(
    planes,  # u32 [*, D, 4, W]   store planes (pinned_host on the GPU, or HBM); [L, R, ...] with layer
    scales,  # f16 [*, D, NB]
    channels,  # i32 [*, C]
    depths,  # i32 [*, C]
    *,
    layer=None,
    group_start: int = 0,
    after=None,
    implementation: B.Implementation | None = None,
    config: RunGatherConfig | None = None,
    interpret: bool | None = None,
    assume_sorted: bool = False,
):
    """Staged ``(planes u32 [*, C, 4, W], scales [*, C, NB])`` of the run list (see the module docstring).

    With ``layer``, run lists ``[Rc, C]`` read groups ``group_start .. group_start + Rc - 1`` of the stacked
    store (static; see :func:`pallas_kernels.backend.request_groups`). ``after``: a pytree of arrays the
    kernel waits for and never reads (ignored by the reference, which has no kernels to order).
    ``assume_sorted=True`` skips the (small) sort that puts each group's slots of depth > 0 first, for a list sorted
    by decreasing depth (:func:`pallas_kernels.plane_scan.active_channels`'s).
    """
    implementation = B.resolve_implementation(implementation)
    _validate(planes, scales, channels, depths, layer, group_start)
    check_run_list(channels, depths, planes.shape[-3])
    if implementation == "xla":
        return run_gather_reference(planes, scales, channels, depths, layer=layer, group_start=group_start)
    batch = channels.shape[:-1]
    planes, layer_arr = B.layered(planes, layer, 3, "planes")
    scales, _ = B.layered(scales, layer, 2, "scales")
    r, c = B.prod(batch), channels.shape[-1]
    after = tuple(jax.tree.leaves(after))
    sp, ss = _run_gather_pallas(planes, scales, channels.reshape(r, c), depths.reshape(r, c), layer_arr, after,
                                config=config or RunGatherConfig(), interpret=B.resolve_interpret(interpret),
                                group_start=group_start, assume_sorted=assume_sorted)
    return sp.reshape(*batch, *sp.shape[1:]), ss.reshape(*batch, *ss.shape[1:])
