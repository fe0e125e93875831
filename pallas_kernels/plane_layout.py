"""The bit-plane index as the kernels read it: the format constants they are built for, the run list's value check,
and the row layout of a store held in two memory tiers.

The constants are the format's one definition (the library's format module re-exports them): the kernels unroll
over the planes and shift by the word width at compile time, so a store of another shape needs other kernels.

A tiered store keeps, per layer ``l``, planes ``[0, p_l)`` of every channel in device memory (the hot tier) and
planes ``[p_l, 4)`` in host memory (the cold tier), each tier plane-major: one row of ``W`` words per (plane, group,
channel), ``tiers [L, 3]`` = (p_l, first hot row, first cold row) per layer (:func:`tier_table`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import backend as B

BLOCK_TOKENS = 64  # tokens per fp16 block scale
N_PLANES = 4  # bit planes per code (4-bit codes)
WORD_BITS = 32  # tokens per packed plane word (uint32)


def check_run_list(channels, depths, head_dim: int) -> None:
    """A run list's values: channels in ``[0, head_dim)``, depths in ``[0, 4]`` (eager only: skipped when traced)."""
    if B.is_traced(channels, depths):
        return
    ch, dp = np.asarray(channels), np.asarray(depths)
    if np.any((ch < 0) | (ch >= head_dim)):
        raise ValueError(f"channels must lie in [0, {head_dim})")
    if np.any((dp < 0) | (dp > N_PLANES)):
        raise ValueError(f"depths must lie in [0, {N_PLANES}]")


def tier_table(resident: tuple[int, ...]) -> np.ndarray:
    """``tiers [L, 3]``: (p_l, first hot row, first cold row) of each layer for resident planes ``p_l``."""
    p = np.asarray(resident, np.int64)
    hot = np.concatenate([[0], np.cumsum(p)[:-1]])
    cold = np.concatenate([[0], np.cumsum(N_PLANES - p)[:-1]])
    return np.stack([p, hot, cold], axis=1).astype(np.int32)


def tier_rows(tier, first, groups: slice):
    """``[Rc, D, 4, W]``: rows ``first + i`` of a tier ``[N, R, D, W]`` as planes ``i = 0..3`` of ``groups`` (rows
    past either end clipped: the caller keeps only the planes that tier holds; plain jnp)."""
    rows = [jax.lax.dynamic_index_in_dim(tier, jnp.clip(first + i, 0, tier.shape[0] - 1), keepdims=False)[groups]
            for i in range(N_PLANES)]
    return jnp.stack(rows, axis=-2)


def layer_planes(hot, cold, tiers, layer, groups: slice):
    """The planes ``[Rc, D, 4, W]`` of ``layer`` for ``groups`` as one tier holds them (plain jnp)."""
    p, hot_row, cold_row = tiers[layer, 0], tiers[layer, 1], tiers[layer, 2]
    in_hot = jnp.arange(N_PLANES)[:, None] < p
    return jnp.where(in_hot, tier_rows(hot, hot_row, groups), tier_rows(cold, cold_row - p, groups))
