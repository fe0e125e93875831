"""Row fetch: gather the selected K/V rows of every KV head from (pinned host) memory into HBM.

``keys, values [*, n, Dh]`` (bf16; on the GPU ``pinned_host`` arrays read by the kernel through
``memory_space=pl.ANY``, on CPU device memory) and a fixed-size index list ``index i32 [*, S]``
(padding entries are negative or ``>= n``) give ``k_rows, v_rows [*, S, Dh]`` with zero rows at
padding, and ``mask bool [*, S]`` (which slots hold a real row). One program copies ``rows`` rows
(a 2-D gather: ``rows`` x ``Dh`` elements, each row one contiguous ``2 Dh``-byte run).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as C

KERNEL_NAME = "row_fetch"


def _validate(keys, values, index):
    C.check_array("keys", keys, ndim_min=2)
    C.check_array("index", index, ndim_min=1, dtypes=(jnp.int32,))
    if values.shape != keys.shape or values.dtype != keys.dtype:
        raise ValueError(f"values must match keys: {keys.shape} {keys.dtype} vs {values.shape} {values.dtype}")
    if index.shape[:-1] != keys.shape[:-2]:
        raise ValueError(f"index must be [*batch, S] with batch {keys.shape[:-2]}, got {index.shape}")
    C.check_pow2("head dim", keys.shape[-1])


def row_fetch_reference(keys, values, index):
    _validate(keys, values, index)
    n = keys.shape[-2]
    mask = (index >= 0) & (index < n)
    safe = jnp.where(mask, index, 0)[..., None]
    k = jnp.where(mask[..., None], jnp.take_along_axis(keys, safe, axis=-2), 0)
    v = jnp.where(mask[..., None], jnp.take_along_axis(values, safe, axis=-2), 0)
    return k, v, mask


def _row_fetch_kernel(
    # inputs
    idx_ref,  # i32 [BH, S]
    k_ref,  # [BH, n, Dh]   (any memory space)
    v_ref,  # [BH, n, Dh]
    # outputs
    ko_ref,  # [BH, S, Dh]
    vo_ref,  # [BH, S, Dh]
    *,
    rows: int,
    slots: int,
    n: int,
    dh: int,
):
    bh, i = pl.program_id(0), pl.program_id(1)
    s0 = i * rows
    smask = s0 + jnp.arange(rows, dtype=jnp.int32) < slots
    idx = plgpu.load(idx_ref.at[bh, pl.ds(s0, rows)], mask=smask, other=-1)
    valid = (idx >= 0) & (idx < n)
    safe = jnp.where(valid, idx, 0)
    col = jnp.arange(dh, dtype=jnp.int32)
    m2 = valid[:, None] & (col[None, :] < dh)
    out_mask = smask[:, None] & (col[None, :] < dh)
    for src, dst in ((k_ref, ko_ref), (v_ref, vo_ref)):
        data = plgpu.load(src.at[bh, safe[:, None], col[None, :]], mask=m2, other=0)  # 2-D gather
        plgpu.store(dst.at[bh, pl.ds(s0, rows), :], data, mask=out_mask)


@functools.partial(jax.jit, static_argnames=("rows", "num_warps", "interpret"))
def _row_fetch_pallas(keys, values, index, *, rows, num_warps, interpret):
    *batch, n, dh = keys.shape
    bh = C.prod(batch)
    s = index.shape[-1]
    rows = min(rows, pl.next_power_of_2(s))
    flat = lambda x: x if x.ndim == 3 else x.reshape(bh, n, dh)  # no XLA op on a flat pinned_host array
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    k, v = pl.pallas_call(
        functools.partial(_row_fetch_kernel, rows=rows, slots=s, n=n, dh=dh),
        out_shape=(jax.ShapeDtypeStruct((bh, s, dh), keys.dtype), jax.ShapeDtypeStruct((bh, s, dh), keys.dtype)),
        grid=(bh, pl.cdiv(s, rows)),
        in_specs=[any_spec, any_spec, any_spec],
        out_specs=(any_spec, any_spec),
        interpret=interpret,
        name=KERNEL_NAME,
        compiler_params=C.compiler_params(num_warps),
    )(index.reshape(bh, s), flat(keys), flat(values))
    mask = (index >= 0) & (index < n)
    return k.reshape(*batch, s, dh), v.reshape(*batch, s, dh), mask


def row_fetch(
    keys,  # [*, n, Dh]
    values,  # [*, n, Dh]
    index,  # i32 [*, S]
    *,
    implementation: str = "pallas",
    rows: int = 32,
    num_warps: int = 4,
    interpret: bool | None = None,
):
    """``(k_rows [*, S, Dh], v_rows [*, S, Dh], mask bool [*, S])``; padding slots are zero rows."""
    C.check_implementation(implementation)
    _validate(keys, values, index)
    if implementation == "xla":
        return row_fetch_reference(keys, values, index)
    C.check_pow2("rows", rows)
    return _row_fetch_pallas(keys, values, index, rows=rows, num_warps=num_warps, interpret=C.resolve_interpret(interpret))
