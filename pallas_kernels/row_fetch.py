"""Row fetch: gather the selected K/V rows of every group from (pinned host) memory into HBM.

``keys, values [*, n, Dh]`` (bf16; on the GPU ``pinned_host`` arrays read by the kernel through
``memory_space=ANY``, on CPU device memory; with ``layer``, stacked ``[L, R, n, Dh]`` caches read at that
layer in place) and a fixed-size index list ``index i32 [*, S]`` (padding entries are negative or
``>= n``) give ``k_rows, v_rows [*, S, Dh]`` with zero rows at padding, and ``mask bool [*, S]`` (which
slots hold a real row). One program copies ``rows`` rows (a 2-D gather: ``rows`` x ``Dh`` elements,
each row one contiguous ``2 Dh``-byte run).
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
    """``rows``: rows copied per program (a power of two); ``num_warps``: Triton warps.
    H200: 2048 rows x 8 heads (K and V, bf16) in 0.187 ms from host (results/kernels_h200.md)."""

    rows: int = 32
    num_warps: int = 4

    def __post_init__(self):
        B.check_pow2("rows", self.rows)


def _validate(keys, values, index, layer):
    B.check_array("keys", keys, ndim_min=2)
    B.check_array("index", index, ndim_min=1, dtypes=(jnp.int32,))
    if values is not None and (values.shape != keys.shape or values.dtype != keys.dtype):
        raise ValueError(f"values must match keys: {keys.shape} {keys.dtype} vs {values.shape} {values.dtype}")
    lead = 1 if layer is not None else 0
    if index.shape[:-1] != keys.shape[lead:-2]:
        raise ValueError(f"index must be [*batch, S] with batch {keys.shape[lead:-2]}, got {index.shape}")
    B.check_pow2("head dim", keys.shape[-1])


def row_fetch_reference(keys, values, index, *, layer=None):
    _validate(keys, values, index, layer)
    n = keys.shape[-2]
    mask = (index >= 0) & (index < n)
    safe = jnp.where(mask, index, 0)
    if layer is None:
        take = lambda x: jnp.take_along_axis(x, safe[..., None], axis=-2)  # noqa: E731
    else:  # gather from the stacked cache directly: slicing the layer first copies all its rows
        batch = index.shape[:-1]
        grids = tuple(jnp.arange(size, dtype=jnp.int32).reshape((1,) * i + (size,) + (1,) * (len(batch) - i))
                      for i, size in enumerate(batch))
        take = lambda x: x[(layer, *grids, safe)]  # noqa: E731
    rows = lambda x: None if x is None else jnp.where(mask[..., None], take(x), 0)  # noqa: E731
    return rows(keys), rows(values), mask


def _row_fetch_kernel(
    # inputs
    idx_ref,  # i32 [R, S]
    layer_ref,  # i32 [1]
    *refs,  # sources [L, R, n, Dh] (any memory space: keys, and values if given), then their outputs [R, S, Dh]
    rows: int,
    slots: int,
    n: int,
    dh: int,
):
    r, i = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    s0 = i * rows
    smask = s0 + jnp.arange(rows, dtype=jnp.int32) < slots
    idx = plgpu.load(idx_ref.at[r, pl.ds(s0, rows)], mask=smask, other=-1)
    valid = (idx >= 0) & (idx < n)
    safe = jnp.where(valid, idx, 0)
    col = jnp.arange(dh, dtype=jnp.int32)
    m2 = valid[:, None] & (col[None, :] < dh)
    out_mask = smask[:, None] & (col[None, :] < dh)
    half = len(refs) // 2
    for src, dst in zip(refs[:half], refs[half:]):
        data = plgpu.load(src.at[layer, r, safe[:, None], col[None, :]], mask=m2, other=0)  # 2-D gather
        plgpu.store(dst.at[r, pl.ds(s0, rows), :], data, mask=out_mask)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _row_fetch_pallas(keys, values, index, layer, *, config, interpret):
    _, r, n, dh = keys.shape
    s = index.shape[-1]
    rows = min(config.rows, pl.next_power_of_2(s))
    srcs = (keys,) if values is None else (keys, values)
    out = pl.pallas_call(
        functools.partial(_row_fetch_kernel, rows=rows, slots=s, n=n, dh=dh),
        out_shape=tuple(jax.ShapeDtypeStruct((r, s, dh), keys.dtype) for _ in srcs),
        grid=(r, pl.cdiv(s, rows)),
        in_specs=[B.any_spec()] * (2 + len(srcs)),
        out_specs=tuple(B.any_spec() for _ in srcs),
        interpret=interpret,
        name=KERNEL_NAME,
        compiler_params=B.compiler_params(config.num_warps),
    )(index, layer, *srcs)
    return out[0], (None if values is None else out[1])


def row_fetch(
    keys,  # [*, n, Dh]   (or [L, R, n, Dh] with layer)
    values,  # [*, n, Dh], or None to fetch rows of ``keys`` alone
    index,  # i32 [*, S]
    *,
    layer=None,
    implementation: B.Implementation | None = None,
    config: RowFetchConfig | None = None,
    interpret: bool | None = None,
):
    """``(k_rows [*, S, Dh], v_rows [*, S, Dh] or None, mask bool [*, S])``; padding slots are zero rows."""
    implementation = B.resolve_implementation(implementation)
    _validate(keys, values, index, layer)
    if implementation == "xla":
        return row_fetch_reference(keys, values, index, layer=layer)
    batch, s = index.shape[:-1], index.shape[-1]
    n = keys.shape[-2]
    keys, layer_arr = B.layered(keys, layer, 2, "keys")
    if values is not None:
        values, _ = B.layered(values, layer, 2, "values")
    k, v = _row_fetch_pallas(keys, values, index.reshape(-1, s), layer_arr, config=config or RowFetchConfig(),
                             interpret=B.resolve_interpret(interpret))
    mask = (index >= 0) & (index < n)
    unflat = lambda x: None if x is None else x.reshape(*batch, s, -1)  # noqa: E731
    return unflat(k), unflat(v), mask
