"""Host run gather: copy each active channel's first ``t_j`` planes and its scales into an HBM staging buffer.

From a store (on the GPU a ``pinned_host`` array, read directly by the kernel through
``memory_space=ANY``; on CPU / interpret mode the same code on device memory) and a fixed-size run
list ``runs`` = ``channels [R, C]`` / ``depths [R, C]`` (one slot per channel; slot ``c`` reads channel
``channels[c]`` to depth ``depths[c]``, 0 = nothing), write::

    staged_planes  u32 [R, C, 4, W]   slot c, plane p < t_c: planes[channels[c], p]
    staged_scales  f16 [R, C, NB]     slot c with t_c > 0: scales[channels[c]]

inside ``jit`` with no host sync, and leaves the rest unwritten (the scan reads no plane at or past a slot's depth
and no slot of depth 0; the reference writes zeros there). Each (slot, plane) is one contiguous run of ``W`` words
in the channel-major store; one work item copies ``chunk`` words of a slot's planes ``p < t``; the work items and
the two grids are :mod:`pallas_kernels.gather`'s. The staged buffer is the input of the plane scan with the identity
channel list: ``plane_scan(q_staged, staged, length, runs.slots())`` with ``q_staged = q[..., channels]``.

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
from pallas_kernels.gather import RunGatherConfig, gather_call, staged_shape
from pallas_kernels.operands import RunList, StorePlanes
from pallas_kernels.plane_layout import N_PLANES

KERNEL_NAME = "run_gather"


def _validate(store: StorePlanes, runs: RunList):
    runs.check(store.head_dim)
    batch = store.check(runs.batch, "run_gather")
    if runs.batch != batch:
        raise ValueError(f"runs: channels/depths must be [*batch, C] with batch {batch}, got {runs.channels.shape}")


def run_gather_reference(store: StorePlanes, runs: RunList) -> StorePlanes:
    """Plain-jnp gather of the same staging buffers."""
    _validate(store, runs)
    planes, scales = store.read(runs.channels.shape[0])
    channels, depths = runs.channels, runs.depths
    sel = jnp.take_along_axis(planes, channels[..., :, None, None], axis=-3)  # [*, C, 4, W]
    keep = jnp.arange(N_PLANES)[:, None] < depths[..., :, None, None]
    staged_planes = jnp.where(keep, sel, jnp.uint32(0))
    sc = jnp.take_along_axis(scales, channels[..., :, None], axis=-2)
    staged_scales = jnp.where(depths[..., :, None] > 0, sc, jnp.zeros((), scales.dtype))
    return StorePlanes(staged_planes, staged_scales)


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


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _run_gather_pallas(store: StorePlanes, runs: RunList, after, *, config, interpret) -> StorePlanes:
    """store ``[L, R, D, 4, W]`` / ``[L, R, D, NB]`` at layer i32[1] (any memory space; groups group_start.. are
    read), runs ``[Rc, C]``."""
    copy = functools.partial(_copy_item, width=store.width, group_start=store.group_start)
    return gather_call(copy, (store.layer, store.planes, store.scales), runs, after,
                       staged_shape(runs, store.width, store.scales.dtype), config=config, interpret=interpret,
                       name=KERNEL_NAME)


def run_gather(
    store: StorePlanes,  # planes u32 [*, D, 4, W], scales f16 [*, D, NB] (pinned_host on the GPU, or HBM)
    runs: RunList,  # i32 [*, C] channels and depths
    *,
    after=None,
    implementation: B.Implementation | None = None,
    config: RunGatherConfig | None = None,
    interpret: bool | None = None,
) -> StorePlanes:
    """The staged buffer ``StorePlanes(planes u32 [*, C, 4, W], scales [*, C, NB])`` of the run list (see the module
    docstring).

    A ``store`` at a layer is read for run lists ``[Rc, C]`` at its groups ``store.group_start .. + Rc - 1`` (see
    :func:`pallas_kernels.backend.request_groups`). ``after``: a pytree of arrays the kernel waits for and never reads
    (ignored by the reference, which has no kernels to order). A list sorted by decreasing depth (``runs.sorted``,
    :func:`pallas_kernels.plane_scan.active_channels`'s) skips the (small) sort that puts each group's slots of
    depth > 0 first.
    """
    implementation = B.resolve_implementation(implementation)
    _validate(store, runs)
    if implementation == "xla":
        return run_gather_reference(store, runs)
    batch = runs.batch
    staged = _run_gather_pallas(store.stacked(), runs.flat(), tuple(jax.tree.leaves(after)),
                                config=config or RunGatherConfig(), interpret=B.resolve_interpret(interpret))
    return StorePlanes(staged.planes.reshape(*batch, *staged.planes.shape[1:]),
                       staged.scales.reshape(*batch, *staged.scales.shape[1:]))
