"""Slot copy: one sequence's groups of a stacked ``[L, R, ...]`` array, read out or written in, in place.

A stacked array ``store [L, R, *trail]`` (any dtype; HBM or ``pinned_host``, reached through ``memory_space=ANY``
and never touched by an XLA op) and a device array ``part [L, H, *trail]`` give, with ``start`` (traced: one compile
serves every slot)::

    slot_read : part = store[:, start:start + H, ...]
    slot_write: store[:, start:start + H, ...] = part      (nothing else of store is touched)

``start`` is clamped into ``[0, R - H]`` as XLA's dynamic slices clamp it (the references are those slices). The
write aliases ``store`` to its output (``input_output_aliases``: in place under a ``jit`` that donates it), or, for
a ``pinned_host`` store, writes through its pointer and returns a completion token (:func:`slot_write_in_place`; why:
:func:`pallas_kernels.cache_write.cache_write_in_place`). A session pool moves a session in and out of its slot this
way when its cache lives in host memory, where XLA's slices cannot reach.

The trailing axes are walked as one flat run of ``prod(trail)`` elements per (layer, group), unravelled into indices
inside the kernel (a reshape of a host array would be an XLA op on it); each program copies ``chunk`` elements. The
copy moves elements in their own dtype with no arithmetic on them, so it is exact for every dtype (f16, bf16, u32,
i32, u8, ...).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as B

READ_NAME = "slot_read"
WRITE_NAME = "slot_write"


@dataclasses.dataclass(frozen=True)
class SlotCopyConfig:
    """``chunk``: elements of one (layer, group)'s flat run copied per program (a power of two); ``num_warps``:
    Triton warps."""

    chunk: int = 2048
    num_warps: int = 4

    def __post_init__(self):
        B.check_pow2("chunk", self.chunk)


def _check_store(store, name: str) -> None:
    if store.ndim < 3:
        raise ValueError(f"{name} must be [L, R, ...] with at least one axis after the group axis, got {store.shape}")


def _check_start(start, groups: int, heads: int) -> jax.Array:
    start = jnp.asarray(start)
    if start.shape != () or not jnp.issubdtype(start.dtype, jnp.integer):
        raise ValueError(f"start must be an integer scalar (the slot's first group), got {start.dtype} {start.shape}")
    if not B.is_traced(start) and not 0 <= int(start) <= groups - heads:
        raise ValueError(f"start must lie in [0, {groups - heads}] (heads {heads} of {groups} groups), "
                         f"got {int(start)}")
    return start.astype(jnp.int32)


def _check_read(store, heads: int) -> None:
    _check_store(store, "store")
    if not isinstance(heads, int) or isinstance(heads, bool) or not 1 <= heads <= store.shape[1]:
        raise ValueError(f"heads must be an int in [1, {store.shape[1]}] (the store's groups), got {heads!r}")


def _check_write(store, part) -> None:
    _check_store(store, "store")
    if part.ndim != store.ndim or part.shape[0] != store.shape[0] or part.shape[2:] != store.shape[2:]:
        raise ValueError(f"part must be [L, H, ...] like store {store.shape} on every axis but 1, got {part.shape}")
    if not 1 <= part.shape[1] <= store.shape[1]:
        raise ValueError(f"part's {part.shape[1]} groups do not fit the store's {store.shape[1]}")
    if part.dtype != store.dtype:
        raise TypeError(f"part dtype {part.dtype} must match store dtype {store.dtype}")


def slot_read_reference(store, start, heads: int):
    """Plain-XLA read: a dynamic slice of ``heads`` groups at ``start`` (clamped)."""
    _check_read(store, heads)
    return jax.lax.dynamic_slice_in_dim(store, _check_start(start, store.shape[1], heads), heads, axis=1)


def slot_write_reference(store, part, start):
    """Plain-XLA write: a dynamic update slice of ``part`` at group ``start`` (clamped)."""
    _check_write(store, part)
    return jax.lax.dynamic_update_slice_in_dim(store, part, _check_start(start, store.shape[1], part.shape[1]), axis=1)


def _copy(start_ref, src_ref, dst_ref, *, trail: tuple[int, ...], chunk: int, groups: int, heads: int,
          into_store: bool):
    """Copy chunk ``pl.program_id(2)`` of (layer, group) ``program_id(0, 1)`` between the store and the part."""
    l, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # the store's group: the slot's h-th, its first clamped like XLA's dynamic slices
    g = jnp.clip(start_ref[0], 0, groups - heads) + h
    flat = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
    ok = flat < B.prod(trail)
    idx, stride = [], B.prod(trail)
    for i, size in enumerate(trail):  # row-major unravel of the flat run into the trailing axes' indices
        stride //= size
        # no wrap on the first axis: a masked element points past the end instead of at a copied one (interpret
        # mode's masked store writes back the old value, which would race the copied one)
        idx.append(flat // stride if i == 0 else (flat // stride) % size)
    src_g, dst_g = (h, g) if into_store else (g, h)
    data = plgpu.load(src_ref.at[(l, src_g, *idx)], mask=ok, other=0)
    plgpu.store(dst_ref.at[(l, dst_g, *idx)], data, mask=ok)


def _read_kernel(start_ref, store_ref, out_ref, **kw):
    _copy(start_ref, store_ref, out_ref, into_store=False, **kw)


def _write_kernel(start_ref, part_ref, store_ref, out_ref, *, in_place: bool, **kw):
    if in_place:
        @pl.when((pl.program_id(0) == 0) & (pl.program_id(1) == 0) & (pl.program_id(2) == 0))
        def _():
            out_ref[0] = jnp.int32(1)

        out_ref = store_ref
    _copy(start_ref, part_ref, out_ref, into_store=True, **kw)


def _call(kernel, operands, out_shape, aliases, *, layers, heads, trail, store_groups, config, interpret, name):
    chunk = min(config.chunk, pl.next_power_of_2(B.prod(trail)))
    kernel = functools.partial(kernel, trail=tuple(trail), chunk=chunk, groups=store_groups, heads=heads)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(layers, heads, pl.cdiv(B.prod(trail), chunk)),
        in_specs=[B.any_spec()] * len(operands),
        out_specs=B.any_spec(),
        input_output_aliases=aliases,
        interpret=interpret,
        name=name,
        compiler_params=B.compiler_params(config.num_warps),
    )(*operands)


def _read_pallas(store, start, heads, *, config, interpret):
    layers, groups, *trail = store.shape
    return _call(_read_kernel, (start.reshape(1), store), jax.ShapeDtypeStruct((layers, heads, *trail), store.dtype),
                 {}, layers=layers, heads=heads, trail=trail, store_groups=groups, config=config,
                 interpret=interpret, name=READ_NAME)


def _write_pallas(store, part, start, *, config, interpret, in_place=False):
    layers, groups, *trail = store.shape
    heads = part.shape[1]
    out_shape = jax.ShapeDtypeStruct((1,), jnp.int32) if in_place else jax.ShapeDtypeStruct(store.shape, store.dtype)
    kernel = functools.partial(_write_kernel, in_place=in_place)
    return _call(kernel, (start.reshape(1), part, store), out_shape, {} if in_place else {2: 0}, layers=layers,
                 heads=heads, trail=trail, store_groups=groups, config=config, interpret=interpret, name=WRITE_NAME)


def slot_read(
    store,  # [L, R, *trail]  the stacked array (pinned_host on the GPU, or HBM): read in place
    start,  # i32 scalar      the slot's first group (traced or not)
    heads: int,  # groups per slot
    *,
    implementation: B.Implementation | None = None,
    config: SlotCopyConfig | None = None,
    interpret: bool | None = None,
):
    """``store[:, start:start + heads, ...]`` as a new device array ``[L, heads, *trail]`` (see the module
    docstring)."""
    implementation = B.resolve_implementation(implementation)
    _check_read(store, heads)
    start = _check_start(start, store.shape[1], heads)
    if implementation == "xla":
        return slot_read_reference(store, start, heads)
    return _read_pallas(store, start, heads, config=config or SlotCopyConfig(),
                        interpret=B.resolve_interpret(interpret))


def slot_write(
    store,  # [L, R, *trail]  the stacked array (donate it: it is updated in place)
    part,  # [L, H, *trail]   one slot's groups, in device memory
    start,  # i32 scalar      the slot's first group
    *,
    implementation: B.Implementation | None = None,
    config: SlotCopyConfig | None = None,
    interpret: bool | None = None,
):
    """``store`` with ``part`` written at groups ``start ..`` (see the module docstring); in place under a ``jit``
    that donates ``store``, elsewhere a new array."""
    implementation = B.resolve_implementation(implementation)
    _check_write(store, part)
    start = _check_start(start, store.shape[1], part.shape[1])
    if implementation == "xla":
        return slot_write_reference(store, part, start)
    return _write_pallas(store, part, start, config=config or SlotCopyConfig(),
                         interpret=B.resolve_interpret(interpret))


def slot_write_in_place(store, part, start, *, config: SlotCopyConfig | None = None):
    """Write ``part`` into a ``pinned_host`` ``store`` through its pointer; returns a completion token i32[1].

    As :func:`~pallas_kernels.cache_write.cache_write_in_place`: the caller keeps the token (a program output depends
    on it) and neither donates nor returns ``store`` (returning a host array makes XLA copy it whole). GPU only:
    interpret mode cannot write through an input."""
    _check_write(store, part)
    start = _check_start(start, store.shape[1], part.shape[1])
    if not B.on_gpu():
        raise ValueError("slot_write_in_place writes host memory through a GPU kernel; use slot_write elsewhere")
    return _write_pallas(store, part, start, config=config or SlotCopyConfig(), interpret=False, in_place=True)
