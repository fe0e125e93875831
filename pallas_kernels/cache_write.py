"""Cache write: copy new slices into a stacked ``[L, R, ...]`` cache in place (HBM or ``pinned_host``).

``dst [L, R, *mid, N, *tail]`` (the cache: K/V rows, bit planes, block scales, landmarks),
``src [Ls, R, *mid, M, *tail]`` (what changed, in HBM), ``start i32 [R]`` and a ``layer`` offset give::

    dst[layer + l, r, ..., start[r] + m, ...] = src[l, r, ..., m, ...]   for m < M (and start + m < N)

Everything else of ``dst`` is untouched. The kernel aliases ``dst`` to its output
(``input_output_aliases``), so under a ``jit`` that donates the cache nothing is copied: a decode step
writes each layer's new K/V row and the newest block's plane words straight into host memory, and
prefill writes a whole layer. XLA cannot do this for a ``pinned_host`` array (a dynamic-update-slice
across memory spaces is rejected), which is why this is a kernel. One program copies ``chunk`` rows of
one (layer, group, mid index).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as B

KERNEL_NAME = "cache_write"


@dataclasses.dataclass(frozen=True)
class CacheWriteConfig:
    """``chunk``: rows (entries along the written axis) per program; ``num_warps``: Triton warps."""

    chunk: int = 256
    num_warps: int = 4

    def __post_init__(self):
        B.check_pow2("chunk", self.chunk)


def _validate(dst, src, start, axis):
    B.check_array("start", start, ndim=1, dtypes=(jnp.int32,))
    if dst.ndim < 3 or src.ndim != dst.ndim:
        raise ValueError(f"dst and src must be [L, R, ..., N, ...] of one rank >= 3, got {dst.shape} and {src.shape}")
    if not 2 <= axis < dst.ndim:
        raise ValueError(f"axis must lie in [2, {dst.ndim}), got {axis}")
    if src.dtype != dst.dtype:
        raise TypeError(f"src dtype {src.dtype} must match dst dtype {dst.dtype}")
    same = [i for i in range(1, dst.ndim) if i != axis]
    if any(src.shape[i] != dst.shape[i] for i in same) or src.shape[axis] > dst.shape[axis] or src.shape[0] > dst.shape[0]:
        raise ValueError(f"src {src.shape} does not fit dst {dst.shape} along axis {axis}")
    if start.shape != (dst.shape[1],):
        raise ValueError(f"start must be [R] = [{dst.shape[1]}], got {start.shape}")


def cache_write_reference(dst, src, start, *, axis: int, layer=0):
    """Plain-jnp in-place write: one scatter of every (layer, group, mid index, row); rows past N are dropped.

    One scatter with the cache's own axis order: under a loop carry XLA updates the buffer in place (a
    per-group ``vmap`` over axis 1 made XLA transpose the whole cache twice per write).
    """
    _validate(dst, src, start, axis)
    lead = src.shape[: axis + 1]  # [Ls, R, *mid, M]

    def grid(dim, values):
        shape = [1] * len(lead)
        shape[dim] = values.shape[-1]
        return values.reshape(shape)

    idx = [grid(0, jnp.asarray(layer, jnp.int32) + jnp.arange(lead[0], dtype=jnp.int32)),
           grid(1, jnp.arange(lead[1], dtype=jnp.int32))]
    idx += [grid(d, jnp.arange(lead[d], dtype=jnp.int32)) for d in range(2, axis)]
    rows = start.astype(jnp.int32)[:, None] + jnp.arange(lead[axis], dtype=jnp.int32)  # [R, M]
    idx.append(rows.reshape((1, lead[1]) + (1,) * (axis - 2) + (lead[axis],)))
    return dst.at[tuple(idx)].set(src, mode="drop")


def _cache_write_kernel(
    # inputs
    start_ref,  # i32 [R]
    layer_ref,  # i32 [1]
    src_ref,  # [Ls, R, *mid, M, *tail]   (HBM)
    dst_ref,  # [L, R, *mid, N, *tail]    (any memory space)
    # outputs
    out_ref,  # = dst (aliased), or i32 [1]: a completion token when writing into dst in place
    *,
    mid: tuple[int, ...],
    rows: int,
    n: int,
    chunk: int,
    tail: int | None,
    in_place: bool,
):
    l, r, i, c = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    if in_place:
        @pl.when((l == 0) & (r == 0) & (i == 0) & (c == 0))
        def _():
            out_ref[0] = jnp.int32(1)

        out_ref = dst_ref
    mid_idx = []
    for size in reversed(mid):  # unravel the flat mid index, last axis fastest
        mid_idx.append(i % size)
        i = i // size
    mid_idx = tuple(reversed(mid_idx))
    m0 = c * chunk
    m = m0 + jnp.arange(chunk, dtype=jnp.int32)
    at = start_ref[r] + m
    ok = (m < rows) & (at < n)
    layer = layer_ref[0] + l
    if tail is None:
        data = plgpu.load(src_ref.at[(l, r, *mid_idx, pl.ds(m0, chunk))], mask=ok, other=0)
        plgpu.store(out_ref.at[(layer, r, *mid_idx, pl.ds(start_ref[r] + m0, chunk))], data, mask=ok)
    else:
        col = jnp.arange(pl.next_power_of_2(tail), dtype=jnp.int32)  # Triton's blocks are powers of two
        ok2 = ok[:, None] & (col[None, :] < tail)
        if col.shape[0] == tail:
            data = plgpu.load(src_ref.at[(l, r, *mid_idx, pl.ds(m0, chunk), slice(None))], mask=ok2, other=0)
            plgpu.store(out_ref.at[(layer, r, *mid_idx, pl.ds(start_ref[r] + m0, chunk), slice(None))], data,
                        mask=ok2)
        else:  # rows of any width (a compressed row format's words): masked 2-D gather and scatter
            data = plgpu.load(src_ref.at[(l, r, *mid_idx, m[:, None], col[None, :])], mask=ok2, other=0)
            plgpu.store(out_ref.at[(layer, r, *mid_idx, at[:, None], col[None, :])], data, mask=ok2)


def _cache_write_pallas(dst, src, start, layer, *, axis, config, interpret, in_place=False):
    mid = tuple(dst.shape[2:axis])
    tail_shape = dst.shape[axis + 1:]
    if len(tail_shape) > 1:
        raise ValueError(f"cache_write: at most one axis after the written one, got dst {dst.shape}, axis {axis}")
    tail = tail_shape[0] if tail_shape else None
    rows, n = src.shape[axis], dst.shape[axis]
    chunk = min(config.chunk, pl.next_power_of_2(rows))
    kernel = functools.partial(_cache_write_kernel, mid=mid, rows=rows, n=n, chunk=chunk, tail=tail, in_place=in_place)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((1,), jnp.int32) if in_place else jax.ShapeDtypeStruct(dst.shape, dst.dtype),
        grid=(src.shape[0], src.shape[1], B.prod(mid), pl.cdiv(rows, chunk)),
        in_specs=[B.any_spec()] * 4,
        out_specs=B.any_spec(),
        input_output_aliases={} if in_place else {3: 0},
        interpret=interpret,
        name=KERNEL_NAME,
        compiler_params=B.compiler_params(config.num_warps),
    )(start, layer, src, dst)


def cache_write(
    dst,  # [L, R, *mid, N, *tail]   the stacked cache (donate it: it is updated in place)
    src,  # [Ls, R, *mid, M, *tail]  new slices, in HBM
    start,  # i32 [R]                  offset along ``axis`` per group
    *,
    axis: int,
    layer=0,
    implementation: B.Implementation | None = None,
    config: CacheWriteConfig | None = None,
    interpret: bool | None = None,
):
    """``dst`` with ``src`` written at ``[layer:, :, ..., start:, ...]`` (see the module docstring).

    In place only inside a ``jit`` that donates ``dst`` (and, for a ``pinned_host`` cache, gives it a
    host ``out_shardings``: the library's placement does both); elsewhere the result
    is a new array.
    """
    implementation = B.resolve_implementation(implementation)
    start = jnp.asarray(start, jnp.int32)
    _validate(dst, src, start, axis)
    B.check_starts(start)
    if implementation == "xla":
        return cache_write_reference(dst, src, start, axis=axis, layer=layer)
    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    return _cache_write_pallas(dst, src, start, layer_arr, axis=axis, config=config or CacheWriteConfig(),
                               interpret=B.resolve_interpret(interpret))


def cache_write_in_place(
    dst,  # [L, R, *mid, N, *tail]   a cache in pinned_host memory, mutated
    src,  # [Ls, R, *mid, M, *tail]
    start,  # i32 [R]
    *,
    axis: int,
    layer=0,
    config: CacheWriteConfig | None = None,
):
    """Write ``src`` into ``dst`` in place, as a side effect of the kernel; returns a completion token i32[1].

    XLA does not alias a custom call's output into ``pinned_host`` memory: with ``input_output_aliases`` it
    allocated a new host buffer for every write and copied the whole cache into it, every decode step
    (``results/offload_h200_before_inplace.md``). Here ``dst`` is only an input, written
    through its pointer, so nothing is allocated or copied. The caller must keep the token (return it from
    its jitted program, or XLA may drop the kernel) and must not return ``dst`` from that program (that
    would copy it): the array object itself now holds the update. GPU only: interpret mode cannot write
    through an input, and only GPUs have ``pinned_host`` memory.
    """
    start = jnp.asarray(start, jnp.int32)
    _validate(dst, src, start, axis)
    if not B.on_gpu():
        raise ValueError("cache_write_in_place writes host memory through a GPU kernel; use cache_write elsewhere")
    layer_arr = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    return _cache_write_pallas(dst, src, start, layer_arr, axis=axis, config=config or CacheWriteConfig(),
                               interpret=False, in_place=True)
