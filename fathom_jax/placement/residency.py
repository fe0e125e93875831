"""How many planes of each layer to keep in device memory: resident planes chosen for an HBM budget, and the warm
channel planes chosen per group beside them.

The planner reads the most significant plane most (a read of depth t reads planes 0..t-1), so keeping planes
``[0, p_l)`` of every channel of layer ``l`` in device memory keeps most of the scan off the link
(``Placement("pinned_host", resident_planes=p)``; the tiered store is :mod:`fathom_jax.store.tiered`).
:func:`resident_for_budget` picks ``p_l`` from how often the planner reads each plane
(:mod:`fathom_jax.placement.plane_reads` measures that on a calibration capture).

A plan's deeper planes sit on the same few channels step after step (``results/plane_reuse.md``), so a fixed set of
channel planes per KV group, chosen once from the prompt, keeps most of the rest off the link too
(``Placement("pinned_host", resident_planes=p, warm_planes=S)``): the tiered store's
:func:`~fathom_jax.store.tiered.warm_choice` takes the ``S`` with the largest planner gains ``g_j 4^-i`` at the
prompt's mean importance (:func:`fathom_jax.planner.prompt_importance`).
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Array, Float

from fathom_jax import format as fmt
from fathom_jax.format import BLOCK_TOKENS, N_PLANES


def plane_bytes(*, groups: int, capacity: int, head_dim: int) -> int:
    """Bytes of one plane of every channel of one layer (the unit a layer's resident planes grow by)."""
    return groups * head_dim * fmt.plane_words(fmt.round_capacity(capacity)) * 4


def resident_for_budget(budget: int, reads: Float[Array, "L 4"], *, groups: int, capacity: int, head_dim: int,
                        hbm_free: int | None = None) -> tuple[int, ...]:
    """Resident planes per layer for an HBM budget of ``budget`` bytes (per cache: every session of its batch).

    ``reads[l, i]`` is how often the planner reads plane ``i`` of a channel of layer ``l`` (a calibration capture's
    read frequencies at the method's budget; non-increasing in ``i``). The block scales of every layer come first
    (they are resident whenever a plane is), then planes are made resident by how many link bytes each saves, each
    layer's as a prefix. Bad budgets raise ValueError before anything is allocated: negative, more than the whole
    index, or (``hbm_free``) more than the device memory left beside the model."""
    reads = np.asarray(reads, np.float64)
    if reads.ndim != 2 or reads.shape[1] != N_PLANES or np.any(reads < 0):
        raise ValueError(f"reads must be [layers, 4] read frequencies >= 0, got shape {reads.shape}")
    layers = reads.shape[0]
    plane = plane_bytes(groups=groups, capacity=capacity, head_dim=head_dim)
    scales = layers * groups * head_dim * (fmt.round_capacity(capacity) // BLOCK_TOKENS) * 2
    whole = layers * N_PLANES * plane + scales
    if not isinstance(budget, (int, np.integer)) or budget < 0:
        raise ValueError(f"budget must be an int >= 0 (bytes of HBM for the index), got {budget!r}")
    if budget > whole:
        raise ValueError(f"budget {budget} B is more than the whole index ({whole} B: every plane and scale of "
                         f"{layers} layers); use resident_planes=4 for the index in HBM")
    if hbm_free is not None and budget > hbm_free:
        raise ValueError(f"budget {budget} B is more than the {hbm_free} B of device memory left beside the model")
    resident = [0] * layers
    if budget < scales + plane:
        return tuple(resident)
    left = budget - scales
    order = sorted(((layer, i) for layer in range(layers) for i in range(N_PLANES)), key=lambda li: -reads[li])
    for layer, i in order:  # by read frequency; a plane goes in only after the planes above it (a prefix)
        if left < plane:
            break
        if resident[layer] == i:
            resident[layer] += 1
            left -= plane
    return tuple(resident)


def link_bytes(resident: tuple[int, ...], reads: Float[Array, "L 4"], *, groups: int, capacity: int,
               head_dim: int) -> float:
    """The planes' bytes a step moves over the link with these resident planes (predicted from read frequencies)."""
    reads = np.asarray(reads, np.float64)
    plane = plane_bytes(groups=groups, capacity=capacity, head_dim=head_dim)
    return float(sum(reads[layer, i] * plane for layer, p in enumerate(resident) for i in range(p, N_PLANES)))
