"""Tiered write: new plane words of a stacked store held in two tiers, each plane into its own tier, in one launch.

The tiers are :mod:`pallas_kernels.plane_layout`'s (plane-major rows, ``table [L, 3]`` = (p_l, first hot row, first
cold row)). Given ``src u32 [Ls, R, D, 4, M]`` (the plane words of layers ``layer ..``: a decode step's newest block,
``M = 2``, or a prefilled layer, ``M = W``; the tiers a :class:`~pallas_kernels.operands.LayerTiers` at ``layer``) and
``start i32 [R]`` (a word offset per group)::

    hot [table[l, 1] + i,       r, j, start[r] + m] = src[l - layer, r, j, i, m]   for planes i <  p_l
    cold[table[l, 2] + i - p_l, r, j, start[r] + m] = src[l - layer, r, j, i, m]   for planes i >= p_l

for ``m < M`` with ``start[r] + m < W`` (words past the end are dropped); nothing else is touched. Writing the
planes one :func:`~pallas_kernels.cache_write.cache_write` at a time took eight launches per layer (each plane to
each tier, the wrong tier's write dropping out) of one program per (channel, plane); here one program writes every
plane of a block of channels and issues both tiers' stores, the wrong tier's masked off. Like ``cache_write`` it
aliases the tiers to its outputs, or writes a ``pinned_host`` tier in place through its pointer and returns a
completion token (:func:`tier_write_in_place`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as B
from pallas_kernels.operands import LayerTiers
from pallas_kernels.plane_layout import N_PLANES

KERNEL_NAME = "tier_write"


@dataclasses.dataclass(frozen=True)
class TierWriteConfig:
    """``block``: words per program and plane (channels x words: a decode step's block of every channel fits one
    program); ``num_warps``: Triton warps."""

    block: int = 1024
    num_warps: int = 4

    def __post_init__(self):
        B.check_pow2("block", self.block)


def _validate(tiers: LayerTiers, src, start):
    hot, cold, table = tiers.hot, tiers.cold, tiers.table
    B.check_array("tiers.hot", hot, ndim=4, dtypes=(jnp.uint32,))
    B.check_array("tiers.cold", cold, ndim=4, dtypes=(jnp.uint32,))
    B.check_array("tiers.table", table, ndim=2, dtypes=(jnp.int32,))
    B.check_array("src", src, ndim=5, dtypes=(jnp.uint32,))
    B.check_array("start", start, ndim=1, dtypes=(jnp.int32,))
    if hot.shape[1:] != cold.shape[1:]:
        raise ValueError(f"tiers.hot and tiers.cold must be [N, R, D, W] of one R, D, W, got {hot.shape} and "
                         f"{cold.shape}")
    if hot.shape[0] == 0 or cold.shape[0] == 0:
        raise ValueError(f"tiers.hot and tiers.cold must each hold a plane row (a store of two tiers), got "
                         f"{hot.shape}, {cold.shape}")
    if tiers.group_start:
        raise ValueError(f"tier_write writes every group: tiers.group_start must be 0, got {tiers.group_start}")
    _, groups, d, w = hot.shape
    if table.shape[1:] != (3,):
        raise ValueError(f"tiers.table must be [L, 3] (tier_table), got {table.shape}")
    ls, r, sd, planes, m = src.shape
    if (r, sd, planes) != (groups, d, N_PLANES) or m > w or ls > table.shape[0]:
        raise ValueError(f"src must be [Ls <= {table.shape[0]}, {groups}, {d}, {N_PLANES}, M <= {w}], got {src.shape}")
    if start.shape != (groups,):
        raise ValueError(f"start must be [R] = [{groups}], got {start.shape}")


def tier_write_reference(tiers: LayerTiers, src, start):
    """Plain-jnp write: one scatter into each tier, each plane's row index pointing past the tier's end (dropped)
    where the plane lives in the other tier."""
    _validate(tiers, src, start)
    hot, cold = tiers.hot, tiers.cold
    ls, groups, d, _, m = src.shape
    lay = jnp.asarray(tiers.layer, jnp.int32) + jnp.arange(ls, dtype=jnp.int32)
    p, hot_row, cold_row = (tiers.table[lay, i][:, None] for i in range(3))  # [Ls, 1]
    plane = jnp.arange(N_PLANES, dtype=jnp.int32)[None, :]
    hot_rows = jnp.where(plane < p, hot_row + plane, hot.shape[0])  # [Ls, 4]
    cold_rows = jnp.where(plane >= p, cold_row + plane - p, cold.shape[0])
    words = start[:, None] + jnp.arange(m, dtype=jnp.int32)  # [R, M]
    idx = lambda rows: (rows[:, None, None, :, None], jnp.arange(groups)[None, :, None, None, None],  # noqa: E731
                        jnp.arange(d)[None, None, :, None, None], words[None, :, None, None, :])
    return (hot.at[idx(hot_rows)].set(src, mode="drop"), cold.at[idx(cold_rows)].set(src, mode="drop"))


def _tier_write_kernel(start_ref, layer_ref, tier_ref, src_ref, hot_ref, cold_ref, *outs, d_block: int, m_block: int,
                       words: int, in_place: bool):
    l, r, b, c = (pl.program_id(i) for i in range(4))
    if in_place:
        @pl.when((l == 0) & (r == 0) & (b == 0) & (c == 0))
        def _():
            outs[0][0] = jnp.int32(1)

        hot_out, cold_out = hot_ref, cold_ref
    else:
        hot_out, cold_out = outs
    n_hot, _, d, width = hot_ref.shape
    layer = layer_ref[0] + l
    p, hot_row, cold_row = tier_ref[layer, 0], tier_ref[layer, 1], tier_ref[layer, 2]
    j = b * d_block + jnp.arange(d_block, dtype=jnp.int32)
    m = c * m_block + jnp.arange(m_block, dtype=jnp.int32)
    at = start_ref[r] + m
    ok = (j < d)[:, None] & ((m < words) & (at < width))[None, :]
    data = [plgpu.load(src_ref.at[l, r, j[:, None], (i * words + m)[None, :]], mask=ok, other=0)
            for i in range(N_PLANES)]  # every load before the first store
    for i in range(N_PLANES):
        h = jnp.clip(hot_row + i, 0, n_hot - 1)
        k = jnp.clip(cold_row + i - p, 0, cold_ref.shape[0] - 1)
        plgpu.store(hot_out.at[h, r, j[:, None], at[None, :]], data[i], mask=ok & (i < p))
        plgpu.store(cold_out.at[k, r, j[:, None], at[None, :]], data[i], mask=ok & (i >= p))


def _tier_write_pallas(tiers: LayerTiers, src, start, *, config, interpret, in_place=False):
    hot, cold = tiers.hot, tiers.cold
    ls, groups, d, _, words = src.shape
    m_block = min(config.block, pl.next_power_of_2(words))
    d_block = min(pl.next_power_of_2(d), max(1, config.block // m_block))
    kernel = functools.partial(_tier_write_kernel, d_block=d_block, m_block=m_block, words=words, in_place=in_place)
    flat = src.reshape(ls, groups, d, N_PLANES * words)  # plane i's words at columns i * M ..
    if in_place:
        out_shape = jax.ShapeDtypeStruct((1,), jnp.int32)
        out_specs, aliases = B.any_spec(), {}
    else:
        out_shape = (jax.ShapeDtypeStruct(hot.shape, hot.dtype), jax.ShapeDtypeStruct(cold.shape, cold.dtype))
        out_specs, aliases = (B.any_spec(), B.any_spec()), {4: 0, 5: 1}
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(ls, groups, pl.cdiv(d, d_block), pl.cdiv(words, m_block)),
        in_specs=[B.any_spec()] * 6,
        out_specs=out_specs,
        input_output_aliases=aliases,
        interpret=interpret,
        name=KERNEL_NAME,
        compiler_params=B.compiler_params(config.num_warps),
    )(start, tiers.layer_index(), tiers.table, flat, hot, cold)


def _checked(tiers: LayerTiers, src, start):
    start = jnp.asarray(start, jnp.int32)
    _validate(tiers, src, start)
    B.check_starts(start)
    return start


def tier_write(
    tiers: LayerTiers,  # hot/cold (donate both: they are updated in place), table; src holds layers tiers.layer ..
    src,  # u32 [Ls, R, D, 4, M]  plane words of layers ``tiers.layer ..``, in HBM
    start,  # i32 [R]            word offset per group
    *,
    implementation: B.Implementation | None = None,
    config: TierWriteConfig | None = None,
    interpret: bool | None = None,
):
    """``(hot, cold)`` with ``src`` written into its tiers (see the module docstring); in place under a ``jit`` that
    donates them, elsewhere new arrays. ``tiers.scales`` is not read (None is fine); every group is written
    (``tiers.group_start`` 0)."""
    implementation = B.resolve_implementation(implementation)
    start = _checked(tiers, src, start)
    if implementation == "xla":
        return tier_write_reference(tiers, src, start)
    return _tier_write_pallas(tiers, src, start, config=config or TierWriteConfig(),
                              interpret=B.resolve_interpret(interpret))


def tier_write_in_place(tiers: LayerTiers, src, start, *, config: TierWriteConfig | None = None):
    """Write ``src`` into the tiers in place, as a side effect of the kernel; returns a completion token i32[1].

    As :func:`~pallas_kernels.cache_write.cache_write_in_place` (why: XLA copies a ``pinned_host`` buffer aliased to a
    custom call's output): the caller keeps the token and does not return the tiers from that program. GPU only."""
    start = _checked(tiers, src, start)
    if not B.on_gpu():
        raise ValueError("tier_write_in_place writes host memory through a GPU kernel; use tier_write elsewhere")
    return _tier_write_pallas(tiers, src, start, config=config or TierWriteConfig(), interpret=False, in_place=True)
