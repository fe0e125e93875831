"""How many planes of each layer to keep in device memory: resident planes chosen for an HBM budget, and the warm
channel planes chosen per group beside them.

The planner reads the most significant plane most (a read of depth t reads planes 0..t-1), so keeping planes
``[0, p_l)`` of every channel of layer ``l`` in device memory keeps most of the scan off the link
(``Placement("pinned_host", resident_planes=p)``; the tiered store is :mod:`fathom_jax.store.tiered`).
:func:`resident_for_budget` picks ``p_l`` from how often the planner reads each plane
(:mod:`fathom_jax.placement.plane_reads` measures that on a calibration capture).

A plan's deeper planes sit on the same few channels step after step (``results/plane_reuse.md``), so a fixed set of
channel planes per KV group, chosen once from the prompt, keeps most of the rest off the link too
(``Placement("pinned_host", resident_planes=p, warm_planes=S)``): :func:`warm_choice` takes the ``S`` with the
largest planner gains ``g_j 4^-i`` at the prompt's mean importance (:func:`prompt_importance`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from fathom_jax import format as fmt
from fathom_jax.format import BLOCK_TOKENS, N_PLANES


def all_resident(resident: tuple[int, ...]) -> bool:
    """Every plane of every layer in device memory: no plane of the index crosses the link."""
    return all(p == N_PLANES for p in resident)


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


def prompt_importance(q: Float[Array, "R G T D"], variance: Float[Array, "R D"], length: Int[Array, "R"],
                      window: int = 1024) -> Float[Array, "R D"]:
    """The planner's importance ``g_j = E[sum_h q_hj^2] Var(k_j)`` (Eq. 3) averaged over each group's last ``window``
    valid prompt positions (``< length``): what :func:`warm_choice` ranks a session's channel planes by."""
    _, g, t, d = q.shape
    w = min(window, t)
    start = jnp.clip(length - w, 0, t - w)  # each group's last w positions (the whole prompt if shorter)
    q = jax.vmap(lambda x, s: jax.lax.dynamic_slice(x, (0, s, 0), (g, w, d)))(q, start)  # [R, G, w, D]
    used = start[:, None] + jnp.arange(w) < length[:, None]  # [R, w]
    energy = jnp.sum(jnp.square(q.astype(jnp.float32)), axis=1)  # [R, w, D]
    mean = jnp.sum(energy * used[..., None], axis=1) / jnp.maximum(jnp.sum(used, axis=1), 1)[:, None]
    return mean * variance.astype(jnp.float32)


def warm_choice(importance: Float[Array, "R D"], resident, slots: int) -> Int[Array, "R D 4"]:
    """The warm map of one layer (``1 + row`` of the warm tier holding plane ``i`` of channel ``j``, 0 for none, as
    :class:`~pallas_kernels.operands.LayerTiers` takes it): each group's ``slots`` channel planes past the ``resident``
    ones (an int, or traced) with the largest gains ``importance_j 4^-i``, rows in order of gain. A channel's planes
    gain less the deeper they are, so its chosen planes follow the resident ones with no gap (ties: lower channel,
    then plane, first)."""
    r, d = importance.shape
    plane = jnp.arange(N_PLANES)
    gain = importance.astype(jnp.float32)[..., None] * 4.0 ** -plane.astype(jnp.float32)
    gain = jnp.where(plane >= jnp.asarray(resident), gain, -jnp.inf).reshape(r, d * N_PLANES)
    order = jnp.argsort(-gain, axis=-1, stable=True)[:, :slots]  # [R, S]: the flat (channel, plane) of each row
    rows = jnp.zeros((r, d * N_PLANES), jnp.int32)
    taken = jnp.take_along_axis(gain, order, axis=-1) > -jnp.inf
    rows = rows.at[jnp.arange(r)[:, None], order].set(jnp.where(taken, jnp.arange(1, slots + 1, dtype=jnp.int32), 0))
    return rows.reshape(r, d, N_PLANES)


def warm_sources(warm_map: Int[Array, "*B D 4"], slots: int) -> tuple[Int[Array, "*B S"], Array]:
    """Row by row, the flat ``channel * 4 + plane`` a warm map puts there and whether it puts one: what a write copies
    into each row of the warm tier."""
    flat = warm_map.reshape(*warm_map.shape[:-2], -1)
    hit = flat[..., None, :] == jnp.arange(1, slots + 1, dtype=flat.dtype)[:, None]  # [*B, S, D * 4]
    return jnp.argmax(hit, axis=-1).astype(jnp.int32), jnp.any(hit, axis=-1)
