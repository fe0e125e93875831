"""Row fetch: gather the selected K/V rows of every group from (pinned host) memory into HBM.

``keys, values [*, n, F]`` (bf16; on the GPU ``pinned_host`` arrays read by the kernel through ``memory_space=ANY``,
on CPU device memory; with a layer, stacked ``[L, R, n, F]`` caches read at that layer in place: a
:class:`StoredRows`) and a fixed-size index list ``index i32 [*, S]`` (padding entries are negative or ``>= n``) give
``k_rows, v_rows [*, S, F]`` with zero rows at padding, and ``mask bool [*, S]`` (which slots hold a real row). One
program copies ``rows`` rows (a 2-D gather: ``rows`` x ``F`` elements, each row one contiguous run; ``F`` any width,
e.g. a compressed row format's 33 words). ``columns=(start, width)`` reads only those features of every row (the keys
of a cache that keeps each token's K and V side by side, ``[n, 2 Dh]``).

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
from pallas_kernels.operands import StoredRows  # noqa: F401 (this module's API too)

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


def _validate(rows: StoredRows, index):
    keys, values, layer = rows.keys, rows.values, rows.layer
    B.check_array("rows.keys", keys, ndim_min=2)
    B.check_array("index", index, ndim_min=1, dtypes=(jnp.int32,))
    if values is not None and (values.shape != keys.shape or values.dtype != keys.dtype):
        raise ValueError(f"rows.values must match rows.keys: {keys.shape} {keys.dtype} vs {values.shape} "
                         f"{values.dtype}")
    lead = 1 if layer is not None else 0
    if layer is not None and keys.ndim != 4:
        raise ValueError(f"rows.keys: with a layer index it must be [L, R, n, F], got {keys.shape}")
    batch = B.request_groups(keys.shape[lead:-2], index.shape[:-1], layer, rows.group_start, "row_fetch")
    if index.shape[:-1] != batch:
        raise ValueError(f"index must be [*batch, S] with batch {batch}, got {index.shape}")
    start, width = rows.window()
    if width < 1:
        raise ValueError(f"columns must read at least one feature, got width {width}")
    if start < 0 or start + width > keys.shape[-1]:
        raise ValueError(f"columns must be (start, width) within the row's {keys.shape[-1]} features, got "
                         f"{rows.columns}")


def row_fetch_reference(rows: StoredRows, index):
    _validate(rows, index)
    start, width = rows.window()
    n = rows.keys.shape[-2]
    mask = (index >= 0) & (index < n)
    safe = jnp.where(mask, index, 0)
    if rows.layer is None:
        take = lambda x: jnp.take_along_axis(x, safe[..., None], axis=-2)  # noqa: E731
    else:  # gather from the stacked cache directly: slicing the layer first copies all its rows
        groups = rows.group_start + jnp.arange(index.shape[0], dtype=jnp.int32)[:, None]
        take = lambda x: x[rows.layer, groups, safe]  # noqa: E731
    def fetched(x):
        return None if x is None else jnp.where(mask[..., None], take(x)[..., start:start + width], 0)

    return fetched(rows.keys), fetched(rows.values), mask


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


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _row_fetch_pallas(stored: StoredRows, index, after, *, config, interpret):
    """``stored`` ``[L, R, n, F]`` at layer i32[1], index ``[Rc, S]``."""
    keys, values = stored.keys, stored.values
    n = keys.shape[-2]
    r, s = index.shape
    start, width = stored.window()
    rows = min(config.rows, pl.next_power_of_2(s))
    srcs = (keys,) if values is None else (keys, values)
    programs = min(config.programs, r * pl.cdiv(s, rows))
    out = pl.pallas_call(
        functools.partial(_row_fetch_kernel, sources=len(srcs), rows=rows, slots=s, n=n, start=start, width=width,
                          group_start=stored.group_start, programs=programs),
        out_shape=tuple(jax.ShapeDtypeStruct((r, s, width), keys.dtype) for _ in srcs),
        grid=(programs,) if programs else (r, pl.cdiv(s, rows)),
        in_specs=[B.any_spec()] * (2 + len(srcs) + len(after)),
        out_specs=tuple(B.any_spec() for _ in srcs),
        interpret=interpret,
        name=KERNEL_NAME,
        compiler_params=B.compiler_params(config.num_warps),
    )(index, stored.layer, *srcs, *after)
    return out[0], (None if values is None else out[1])


def row_fetch(
    rows: StoredRows,  # keys (and values) [*, n, F], or [L, R, n, F] at a layer
    index,  # i32 [*, S]
    *,
    after=None,
    implementation: B.Implementation | None = None,
    config: RowFetchConfig | None = None,
    interpret: bool | None = None,
):
    """``(k_rows [*, S, W], v_rows [*, S, W] or None, mask bool [*, S])``; padding slots are zero rows.

    ``rows.columns=(start, width)``: read features ``start:start + width`` of every row (default all). Rows at a
    layer are read for an index ``[Rc, S]`` at groups ``rows.group_start .. + Rc - 1`` of the stacked cache (see
    :func:`pallas_kernels.backend.request_groups`). ``after``: a pytree of arrays the kernel waits for and never
    reads (ignored by the reference, which has no kernels to order).
    """
    implementation = B.resolve_implementation(implementation)
    if rows.columns is not None:
        rows = dataclasses.replace(rows, columns=(int(rows.columns[0]), int(rows.columns[1])))
    _validate(rows, index)
    if implementation == "xla":
        return row_fetch_reference(rows, index)
    batch, s = index.shape[:-1], index.shape[-1]
    n = rows.keys.shape[-2]
    keys, layer_arr = B.layered(rows.keys, rows.layer, 2, "rows.keys")
    values = None if rows.values is None else B.layered(rows.values, rows.layer, 2, "rows.values")[0]
    k, v = _row_fetch_pallas(dataclasses.replace(rows, keys=keys, values=values, layer=layer_arr), index.reshape(-1, s),
                             tuple(jax.tree.leaves(after)), config=config or RowFetchConfig(),
                             interpret=B.resolve_interpret(interpret))
    mask = (index >= 0) & (index < n)
    unflat = lambda x: None if x is None else x.reshape(*batch, s, -1)  # noqa: E731
    return unflat(k), unflat(v), mask
