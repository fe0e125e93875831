"""Row fetch: gather the selected K/V rows of every group from (pinned host) memory into HBM.

``keys, values [*, n, F]`` (bf16; on the GPU ``pinned_host`` arrays read by the kernel through
``memory_space=ANY``, on CPU device memory; with ``layer``, stacked ``[L, R, n, F]`` caches read at that
layer in place) and a fixed-size index list ``index i32 [*, S]`` (padding entries are negative or
``>= n``) give ``k_rows, v_rows [*, S, F]`` with zero rows at padding, and ``mask bool [*, S]`` (which
slots hold a real row). One program copies ``rows`` rows (a 2-D gather: ``rows`` x ``F`` elements,
each row one contiguous run; ``F`` any width, e.g. a compressed row format's 33 words). ``columns=(start, width)`` reads only those features of every row (the
keys of a cache that keeps each token's K and V side by side, ``[n, 2 Dh]``).

The decoder's cache keeps K and V of a token in one ``2 Dh`` row and fetches it with ``values=None``:
from host memory the cost of fresh rows scattered over gigabytes is the translation of their pages,
so one 512-byte run per token moves faster than two 256-byte runs (measured on the H200:
``results/rowlayout_h200.md``).

``after`` (optional arrays, never read) orders the fetch after the kernels that produced them, as the run gather's
does: the pipelined step starts a chunk's fetch once the next chunk's scan is done, so the scan has the SMs to
itself (the library's sparse attention step).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as B

KERNEL_NAME = "row_fetch"


@dataclasses.dataclass(frozen=True)
class RowFetchConfig:
    """``rows``: rows copied per work item (a power of two); ``num_warps``: Triton warps; ``programs``: 0 for one
    program per work item, else that many persistent programs walking the items group by group (at any moment
    the rows in flight come from a few groups' regions of host memory, not from every group's at once;
    measured faster from host memory: ``results/decode_step_h200.md``)."""

    rows: int = 32
    num_warps: int = 4
    programs: int = 0

    def __post_init__(self):
        B.check_pow2("rows", self.rows)
        if not isinstance(self.programs, int) or isinstance(self.programs, bool) or self.programs < 0:
            raise ValueError(f"programs must be an int >= 0 (0: one program per work item), got {self.programs!r}")


def _validate(keys, values, index, layer, columns=None, group_start=0):
    B.check_array("keys", keys, ndim_min=2)
    B.check_array("index", index, ndim_min=1, dtypes=(jnp.int32,))
    if values is not None and (values.shape != keys.shape or values.dtype != keys.dtype):
        raise ValueError(f"values must match keys: {keys.shape} {keys.dtype} vs {values.shape} {values.dtype}")
    lead = 1 if layer is not None else 0
    if layer is not None and keys.ndim != 4:
        raise ValueError(f"keys: with a layer index it must be [L, R, n, F], got {keys.shape}")
    batch = B.request_groups(keys.shape[lead:-2], index.shape[:-1], layer, group_start, "row_fetch")
    if index.shape[:-1] != batch:
        raise ValueError(f"index must be [*batch, S] with batch {batch}, got {index.shape}")
    start, width = _window(keys, columns)
    if width < 1:
        raise ValueError(f"columns must read at least one feature, got width {width}")
    if start < 0 or start + width > keys.shape[-1]:
        raise ValueError(f"columns must be (start, width) within the row's {keys.shape[-1]} features, got {columns}")


def _window(keys, columns):
    return (0, keys.shape[-1]) if columns is None else (int(columns[0]), int(columns[1]))


def row_fetch_reference(keys, values, index, *, layer=None, columns=None, group_start: int = 0):
    _validate(keys, values, index, layer, columns, group_start)
    start, width = _window(keys, columns)
    n = keys.shape[-2]
    mask = (index >= 0) & (index < n)
    safe = jnp.where(mask, index, 0)
    if layer is None:
        take = lambda x: jnp.take_along_axis(x, safe[..., None], axis=-2)  # noqa: E731
    else:  # gather from the stacked cache directly: slicing the layer first copies all its rows
        groups = group_start + jnp.arange(index.shape[0], dtype=jnp.int32)[:, None]
        take = lambda x: x[layer, groups, safe]  # noqa: E731
    rows = lambda x: None if x is None else jnp.where(mask[..., None], take(x)[..., start:start + width], 0)  # noqa: E731
    return rows(keys), rows(values), mask


def _row_fetch_kernel(
    # inputs
    idx_ref,  # i32 [Rc, S]
    layer_ref,  # i32 [1]
    *refs,  # sources [L, R, n, F] (any memory space: keys, and values if given; groups group_start.. are read),
    #         then the `after` operands (never read), then the sources' outputs [Rc, S, width]
    sources: int,
    rows: int,
    slots: int,
    n: int,
    start: int,
    width: int,
    group_start: int,
    programs: int,
):
    refs = (*refs[:sources], *refs[-sources:])
    copy = functools.partial(_copy_rows, idx_ref, layer_ref, refs, rows=rows, slots=slots, n=n, start=start,
                             width=width, group_start=group_start)
    if not programs:
        copy(pl.program_id(0), pl.program_id(1), True)
        return
    per_group = pl.cdiv(slots, rows)
    items = idx_ref.shape[0] * per_group
    pid = pl.program_id(0)

    def body(step, carry):
        item = pid + step * programs  # neighbouring programs copy neighbouring rows of one group
        valid = item < items
        item = jnp.minimum(item, items - 1)
        copy(item // per_group, item % per_group, valid)
        return carry

    jax.lax.fori_loop(0, pl.cdiv(items, programs), body, 0)


def _copy_rows(idx_ref, layer_ref, refs, r, i, active, *, rows, slots, n, start, width, group_start):
    """Copy rows ``i * rows ..`` of group ``r``'s index list (nothing where not ``active``)."""
    layer, src_group = layer_ref[0], r + group_start
    s0 = i * rows
    smask = (s0 + jnp.arange(rows, dtype=jnp.int32) < slots) & active
    idx = plgpu.load(idx_ref.at[r, pl.ds(s0, rows)], mask=smask, other=-1)
    valid = (idx >= 0) & (idx < n)
    safe = jnp.where(valid, idx, 0)
    col = jnp.arange(pl.next_power_of_2(width), dtype=jnp.int32)  # Triton's blocks are powers of two: masked past
    m2 = valid[:, None] & (col[None, :] < width)
    out_mask = smask[:, None] & (col[None, :] < width)
    half = len(refs) // 2
    for src, dst in zip(refs[:half], refs[half:]):
        data = plgpu.load(src.at[layer, src_group, safe[:, None], start + col[None, :]], mask=m2, other=0)  # 2-D gather
        if col.shape[0] == width:
            plgpu.store(dst.at[r, pl.ds(s0, rows), :], data, mask=out_mask)
        else:  # rows of any width (a compressed row format's words): a masked 2-D scatter
            out_rows = s0 + jnp.arange(rows, dtype=jnp.int32)
            plgpu.store(dst.at[r, out_rows[:, None], col[None, :]], data, mask=out_mask)


@functools.partial(jax.jit, static_argnames=("columns", "config", "interpret", "group_start"))
def _row_fetch_pallas(keys, values, index, layer, after, *, columns, config, interpret, group_start):
    n = keys.shape[-2]
    r, s = index.shape
    start, width = _window(keys, columns)
    rows = min(config.rows, pl.next_power_of_2(s))
    srcs = (keys,) if values is None else (keys, values)
    programs = min(config.programs, r * pl.cdiv(s, rows))
    out = pl.pallas_call(
        functools.partial(_row_fetch_kernel, sources=len(srcs), rows=rows, slots=s, n=n, start=start, width=width,
                          group_start=group_start, programs=programs),
        out_shape=tuple(jax.ShapeDtypeStruct((r, s, width), keys.dtype) for _ in srcs),
        grid=(programs,) if programs else (r, pl.cdiv(s, rows)),
        in_specs=[B.any_spec()] * (2 + len(srcs) + len(after)),
        out_specs=tuple(B.any_spec() for _ in srcs),
        interpret=interpret,
        name=KERNEL_NAME,
        compiler_params=B.compiler_params(config.num_warps),
    )(index, layer, *srcs, *after)
    return out[0], (None if values is None else out[1])


def row_fetch(
    keys,  # [*, n, F]   (or [L, R, n, F] with layer)
    values,  # [*, n, F], or None to fetch rows of ``keys`` alone
    index,  # i32 [*, S]
    *,
    layer=None,
    columns: tuple[int, int] | None = None,
    group_start: int = 0,
    after=None,
    implementation: B.Implementation | None = None,
    config: RowFetchConfig | None = None,
    interpret: bool | None = None,
):
    """``(k_rows [*, S, W], v_rows [*, S, W] or None, mask bool [*, S])``; padding slots are zero rows.

    ``columns=(start, width)``: read features ``start:start + width`` of every row (static; default all).
    With ``layer``, an index ``[Rc, S]`` reads groups ``group_start .. group_start + Rc - 1`` of the stacked
    cache (static; see :func:`pallas_kernels.backend.request_groups`). ``after``: a pytree of arrays the kernel
    waits for and never reads (ignored by the reference, which has no kernels to order).
    """
    implementation = B.resolve_implementation(implementation)
    if columns is not None:
        columns = (int(columns[0]), int(columns[1]))
    _validate(keys, values, index, layer, columns, group_start)
    if implementation == "xla":
        return row_fetch_reference(keys, values, index, layer=layer, columns=columns, group_start=group_start)
    batch, s = index.shape[:-1], index.shape[-1]
    n = keys.shape[-2]
    keys, layer_arr = B.layered(keys, layer, 2, "keys")
    if values is not None:
        values, _ = B.layered(values, layer, 2, "values")
    k, v = _row_fetch_pallas(keys, values, index.reshape(-1, s), layer_arr, tuple(jax.tree.leaves(after)),
                             columns=columns, config=config or RowFetchConfig(), interpret=B.resolve_interpret(interpret),
                             group_start=group_start)
    mask = (index >= 0) & (index < n)
    unflat = lambda x: None if x is None else x.reshape(*batch, s, -1)  # noqa: E731
    return unflat(k), unflat(v), mask
