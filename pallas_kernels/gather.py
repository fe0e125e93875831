"""What the run gather and the tiered gather share: their tuning, their work items and their ``pallas_call``.

A gather copies, for a fixed-size run list ``channels [Rc, C]`` / ``depths [Rc, C]`` (one slot per channel, 0 = no
read), each slot's planes and scales from a store (any memory space) into an HBM staging buffer
``(planes u32 [Rc, C, 4, W], scales [Rc, C, NB])``. One work item copies ``chunk`` words of a slot's planes. Only the
slots of depth > 0 have work items (:func:`walk_items`): a Fathom plan reads a third of the channels or fewer, and
persistent programs that stepped through every slot's items spent most of their time on empty ones. Each gather
brings its own copy of one item (which planes it moves, from where).

Two grids (``RunGatherConfig.programs``): one program per work item (0, the default: ~16k programs per layer at 1M
tokens, which fill every SM while they wait on the link), or a fixed number of persistent programs that loop over the
items with all four planes' loads in flight at once, which leaves the other SMs to kernels running concurrently (the
pipelined decode step).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as B
from pallas_kernels.operands import RunList, StorePlanes
from pallas_kernels.plane_layout import N_PLANES


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


def walk_items(copy, dep_ref, order_ref, *, per_slot: int, programs: int) -> None:
    """Call ``copy(r, c, i, valid)`` for every work item (slot ``c`` of group ``r``, its ``i``-th chunk) of the slots
    of depth > 0. ``order_ref [Rc, C]`` lists each group's slots with those of depth > 0 first (None: the list is
    sorted so already, ``RunList.sorted``, as :func:`pallas_kernels.plane_scan.active_channels` makes it). One
    program per item of the grid ``(Rc, C, per_slot)`` (``programs=0``; the programs past a group's active slots copy
    nothing), else ``programs`` persistent programs walking each group's active items in turn, neighbouring programs
    on neighbouring chunks of a run."""
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


def slot_order(runs: RunList):
    """The slot order :func:`walk_items` takes: None where the list is sorted by decreasing depth, else each group's
    slots of depth > 0 first (one small sort)."""
    if runs.sorted:
        return None
    return jnp.argsort(runs.depths <= 0, axis=-1, stable=True).astype(jnp.int32)


def staged_shape(runs: RunList, width: int, scales_dtype) -> StorePlanes:
    """The shapes of the staged buffer a gather of ``runs [Rc, C]`` writes: ``planes u32 [Rc, C, 4, W]``, ``scales
    [Rc, C, NB]``."""
    r, c = runs.channels.shape
    return StorePlanes(jax.ShapeDtypeStruct((r, c, N_PLANES, width), jnp.uint32),
                       jax.ShapeDtypeStruct((r, c, width // 2), scales_dtype))


def gather_call(copy_item, inputs: tuple, runs: RunList, after: tuple, out: StorePlanes, *, config: RunGatherConfig,
                interpret: bool, name: str) -> StorePlanes:
    """The ``pallas_call`` of a gather into the staged buffer ``out`` (:func:`staged_shape`): its work items walked by
    :func:`walk_items`, each copied by ``copy_item(refs, r, c, i, valid, chunk=)`` with ``refs = (channels, depths,
    *inputs, out_planes, out_scales)`` (the gather binds its width and group window into ``copy_item``); the slot
    order and ``after`` are operands the kernel waits for (``after`` is never read)."""
    r, c = runs.channels.shape
    width = out.planes.shape[-1]
    chunk = min(config.chunk, pl.next_power_of_2(width))
    items = (r, c, pl.cdiv(width, chunk))
    programs = min(config.programs, B.prod(items))
    order = slot_order(runs)
    inputs = (runs.channels, runs.depths, *inputs)
    waits = (*([] if order is None else [order]), *after)

    def kernel(*refs):
        ins, rest = refs[:len(inputs)], refs[len(inputs):]
        copy = functools.partial(copy_item, (*ins, *rest[-2:]), chunk=chunk)
        walk_items(copy, ins[1], None if order is None else rest[0], per_slot=items[2], programs=programs)

    planes, scales = pl.pallas_call(
        kernel,
        out_shape=(out.planes, out.scales),
        grid=(programs,) if programs else items,
        in_specs=[B.any_spec()] * (len(inputs) + len(waits)),
        out_specs=(B.any_spec(), B.any_spec()),
        interpret=interpret,
        name=name,
        compiler_params=B.compiler_params(config.num_warps),
    )(*inputs, *waits)
    return StorePlanes(planes, scales)
