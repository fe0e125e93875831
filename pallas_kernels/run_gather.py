"""Host run gather: copy each active channel's first ``t_j`` planes and its scales into an HBM staging buffer.

From a store (on the GPU a ``pinned_host`` array, read directly by the kernel through
``memory_space=ANY``; on CPU / interpret mode the same code on device memory) and a fixed-size run
list ``channels [R, C]`` / ``depths [R, C]`` (one slot per channel; slot ``c`` reads channel
``channels[c]`` to depth ``depths[c]``, 0 = nothing), write::

    staged_planes  u32 [R, C, 4, W]   slot c, plane p < t_c: planes[channels[c], p]
    staged_scales  f16 [R, C, NB]     slot c with t_c > 0: scales[channels[c]]

inside ``jit`` with no host sync, and leaves the rest unwritten (the scan reads no plane at or past a slot's depth
and no slot of depth 0; the reference writes zeros there). Each (slot, plane) is one contiguous run of ``W`` words
in the channel-major store; one work item copies ``chunk`` words of a slot's planes ``p < t``. Only the slots of
depth > 0 have work items (:func:`walk_items`): a Fathom plan reads a third of the channels or fewer, and
persistent programs that stepped through every slot's items spent most of their time on empty ones. The staged
buffer is the input of the plane scan with the identity channel list: ``plane_scan(q_staged, staged_planes,
staged_scales, length, iota(C), depths)`` with ``q_staged = q[..., channels]``.

Two grids (``RunGatherConfig.programs``): one program per work item (0, the default: ~16k programs per
layer at 1M tokens, which fill every SM while they wait on the link), or a fixed number of persistent
programs that loop over the items with all four planes' loads in flight at once, which leaves the other
SMs to kernels running concurrently (the pipelined step, ``StepConfig(pipeline=N)``).

``after`` (optional arrays, never read) orders the gather after the kernels that produced them: the
pipelined step chains each chunk's gather to the previous chunk's staged buffer, so the transfers run one
after another while the scans, selections and row fetches of earlier chunks run beside them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fathom_jax.format import N_PLANES
from pallas_kernels import backend as B

KERNEL_NAME = "run_gather"


@dataclasses.dataclass(frozen=True)
class RunGatherConfig:
    """``chunk``: words of each plane run copied per work item (a power of two); ``num_warps``: Triton warps;
    ``programs``: 0 for one program per work item, else that many persistent programs looping over them.

    The defaults move runs of 8 KiB and more from pinned_host at the link rate on the H200, and no other chunk or
    warp count moves them faster (``results/kernels_h200.md``, ``results/gather_tune_h200.md``)."""

    chunk: int = 2048
    num_warps: int = 4
    programs: int = 0

    def __post_init__(self):
        B.check_pow2("chunk", self.chunk)
        if self.chunk < 2:
            raise ValueError("chunk must be >= 2 words")
        if not isinstance(self.programs, int) or self.programs < 0:
            raise ValueError(f"programs must be an int >= 0 (0: one program per work item), got {self.programs!r}")


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


def check_values(channels, depths, head_dim: int) -> None:
    if B.is_traced(channels, depths):
        return
    ch, dp = np.asarray(channels), np.asarray(depths)
    if np.any((ch < 0) | (ch >= head_dim)) or np.any((dp < 0) | (dp > N_PLANES)):
        raise ValueError(f"channels must lie in [0, {head_dim}) and depths in [0, 4]")


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


def walk_items(copy, dep_ref, order_ref, *, per_slot: int, programs: int) -> None:
    """Call ``copy(r, c, i, valid)`` for every work item (slot ``c`` of group ``r``, its ``i``-th chunk) of the slots
    of depth > 0. ``order_ref [Rc, C]`` lists each group's slots with those of depth > 0 first (None: the list is
    sorted so already, as :func:`pallas_kernels.plane_scan.active_channels` makes it). One program per item of the
    grid ``(Rc, C, per_slot)`` (``programs=0``; the programs past a group's active slots copy nothing), else
    ``programs`` persistent programs walking each group's active items in turn, neighbouring programs on
    neighbouring chunks of a run."""
    slots = dep_ref.shape[1]
    cols = jnp.arange(pl.next_power_of_2(slots), dtype=jnp.int32)

    def active(r):
        dep = plgpu.load(dep_ref.at[r, pl.ds(0, cols.shape[0])], mask=cols < slots, other=0)
        return jnp.sum((dep > 0).astype(jnp.int32))

    def slot(r, k):
        return k if order_ref is None else order_ref[r, k]

    if not programs:
        r, k = pl.program_id(0), pl.program_id(1)
        valid = k < active(r)
        copy(r, slot(r, jnp.minimum(k, slots - 1)), pl.program_id(2), valid)
        return
    pid = pl.program_id(0)

    def group(r, carry):
        items = active(r) * per_slot

        def body(step, carry):
            item = pid + step * programs
            copy(r, slot(r, item // per_slot), item % per_slot, True)
            return carry

        return jax.lax.fori_loop(0, jnp.maximum(items - pid + programs - 1, 0) // programs, body, carry)

    jax.lax.fori_loop(0, dep_ref.shape[0], group, 0)


def slot_order(depths, assume_sorted: bool):
    """The slot order :func:`walk_items` takes: None where the list is sorted by decreasing depth, else each group's
    slots of depth > 0 first (one small sort)."""
    if assume_sorted:
        return None
    return jnp.argsort(depths <= 0, axis=-1, stable=True).astype(jnp.int32)


def gather_call(copy_item, store, channels, depths, layer, after, *, width: int, scales_dtype, config: RunGatherConfig,
                interpret: bool, group_start: int, assume_sorted: bool, name: str):
    """The ``pallas_call`` of a gather into ``(planes u32 [Rc, C, 4, W], scales [Rc, C, NB])``: its work items walked
    by :func:`walk_items`, each copied by ``copy_item(refs, r, c, i, valid, chunk=, width=, group_start=)`` with
    ``refs = (channels, depths, layer, *store, out_planes, out_scales)``; the slot order and ``after`` are operands
    the kernel waits for (``after`` is never read)."""
    r, c = channels.shape
    chunk = min(config.chunk, pl.next_power_of_2(width))
    items = (r, c, pl.cdiv(width, chunk))
    programs = min(config.programs, B.prod(items))
    order = slot_order(depths, assume_sorted)
    inputs = (channels, depths, layer, *store)
    waits = (*([] if order is None else [order]), *after)

    def kernel(*refs):
        ins, rest = refs[:len(inputs)], refs[len(inputs):]
        copy = functools.partial(copy_item, (*ins, *rest[-2:]), chunk=chunk, width=width, group_start=group_start)
        walk_items(copy, ins[1], None if order is None else rest[0], per_slot=items[2], programs=programs)

    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((r, c, N_PLANES, width), jnp.uint32),
                   jax.ShapeDtypeStruct((r, c, width // 2), scales_dtype)),
        grid=(programs,) if programs else items,
        in_specs=[B.any_spec()] * (len(inputs) + len(waits)),
        out_specs=(B.any_spec(), B.any_spec()),
        interpret=interpret,
        name=name,
        compiler_params=B.compiler_params(config.num_warps),
    )(*inputs, *waits)


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
    check_values(channels, depths, planes.shape[-3])
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
