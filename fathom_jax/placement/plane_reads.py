"""Where a Fathom read's bits come from: how often each bit plane is read, per layer, and its share of the bits.

A Fathom read of depth ``t`` on channel j reads planes ``0 .. t-1`` of that channel (MSB first) and, when ``t >= 1``,
the channel's fp16 block scales (:data:`~fathom_jax.format.SCALE_BITS` per :data:`~fathom_jax.format.BLOCK_TOKENS`
tokens). The planner gives channel j its t-th plane only when ``g_j 4^-t`` clears the water line, so a plane is read
at most as often as the one above it, and the most significant plane carries most of what is read. That is what a
store holding its top planes in HBM and the rest in host memory keeps off the link:

    reads = plane_reads(Fathom(48), queries, calib)   # queries [L, *B, G, D], calib [L, *C] (C a suffix of B)
    reads.read_frequency                              # [L, 4]
    reads.code_share, reads.resident_share            # [L, 4], [L, 5]; overall_* pool the layers

``read_frequency[l, i]`` is the fraction of (query, group, channel) triples of layer l whose planned depth exceeds
``i``: how often the planner reads plane i of a channel, averaged over the queries, the KV groups and the D channels.
It is non-increasing in i, and everything else here follows from it and D:

* per token and group, layer l reads ``D x read_frequency[l, i]`` bits of plane i, and
  ``D x read_frequency[l, 0] x SCALE_BITS / BLOCK_TOKENS`` scale bits (a channel's scales are read iff its plane 0 is);
* a step over ``tokens`` tokens moves ``read_frequency[l, i] x D x groups x tokens / 8`` bytes of plane i of layer l
  (``groups`` = batch x KV heads): the link bytes that placing plane i of layer l in HBM saves, in expectation over
  queries like these. A resident-plane planner ranks (layer, plane) pairs by this against plane i's HBM bytes,
  ``D x groups x tokens / 8`` per layer, the same for every plane.

Every layer pools the same number of groups, so the overall shares (``overall_*``) are each layer's bits summed.
Only the raw-plane store is covered (:class:`~fathom_jax.methods.Fathom`): the KLT store's planes are of rotated
keys, whose read depends on the store's rotation as well.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from fathom_jax.calibrate import Calibration
from fathom_jax.format import N_PLANES, SCALE_BITS_PER_TOKEN
from fathom_jax.methods import Fathom, ScanMethod

PLANES = np.arange(N_PLANES)


def plane_read_counts(depths: Int[Array, "*N D"]) -> Int[Array, "4"]:
    """``[sum(depths > i) for i in 0..3]`` over every group and channel: how many channel reads include plane i
    (divided by ``depths.size``, the read frequency; counts keep it exact in float64)."""
    depths = jnp.asarray(depths)
    read = depths[..., None] > jnp.arange(N_PLANES, dtype=depths.dtype)
    return jnp.sum(read.reshape(-1, N_PLANES), axis=0, dtype=jnp.int32)


@dataclasses.dataclass(frozen=True)
class PlaneReads:
    """Per-layer plane read frequencies of one method on one set of queries (see the module's doc), and the shares
    of the read bits they imply. Arrays are numpy, layer first."""

    read_frequency: np.ndarray  # [L, 4]: fraction of (query, group, channel) triples that read plane i
    head_dim: int

    def __post_init__(self):
        f = np.asarray(self.read_frequency, np.float64)
        if f.ndim != 2 or f.shape[1] != N_PLANES:
            raise ValueError(f"read_frequency must be [layers, {N_PLANES}], got shape {f.shape}")
        if np.any((f < 0) | (f > 1)) or np.any(np.diff(f, axis=1) > 1e-12):
            raise ValueError("read_frequency must lie in [0, 1] and not increase with the plane (a read of plane i "
                             "reads every plane above it)")
        if self.head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {self.head_dim}")
        object.__setattr__(self, "read_frequency", f)

    @property
    def n_layers(self) -> int:
        return self.read_frequency.shape[0]

    @property
    def plane_bits(self) -> np.ndarray:
        """``[L, 4]`` code bits per token and group read from each plane."""
        return self.head_dim * self.read_frequency

    @property
    def code_bits(self) -> np.ndarray:
        """``[L]`` code bits per token and group (the planner's ``sum_j t_j``, averaged)."""
        return self.plane_bits.sum(axis=1)

    @property
    def scale_bits(self) -> np.ndarray:
        """``[L]`` scale bits per token and group: the block scales of every channel read."""
        return self.plane_bits[:, 0] * SCALE_BITS_PER_TOKEN

    @property
    def bits(self) -> np.ndarray:
        """``[L]`` bits per token and group, code and scales: the mean of the read's ``bits_per_token``."""
        return self.code_bits + self.scale_bits

    @property
    def code_share(self) -> np.ndarray:
        """``[L, 4]`` fraction of layer l's code bits that come from plane i (0 where it reads nothing)."""
        return _share(self.plane_bits, self.code_bits[:, None])

    @property
    def scale_share(self) -> np.ndarray:
        """``[L]`` fraction of layer l's bits (code and scales) that are scale bits."""
        return _share(self.scale_bits, self.bits)

    @property
    def resident_share(self) -> np.ndarray:
        """``[L, 5]``: the fraction of layer l's bits (code and scales) that planes ``[0, p)`` hold, ``p = 0..4``, the
        block scales counted with plane 0 (where a resident-plane store keeps them). Column 4 is 1 (or 0)."""
        return _share(_resident_bits(self.plane_bits, self.scale_bits), self.bits[:, None])

    @property
    def overall_read_frequency(self) -> np.ndarray:
        """``[4]`` the read frequency pooled over layers."""
        return self.read_frequency.mean(axis=0)

    @property
    def overall_code_share(self) -> np.ndarray:
        """``[4]`` fraction of every layer's code bits together that come from plane i."""
        return _share(self.plane_bits.sum(axis=0), self.code_bits.sum())

    @property
    def overall_scale_share(self) -> float:
        return float(_share(self.scale_bits.sum(), self.bits.sum()))

    @property
    def overall_resident_share(self) -> np.ndarray:
        """``[5]`` :attr:`resident_share` with every layer at the same ``p``."""
        resident = _resident_bits(self.plane_bits.sum(axis=0, keepdims=True), self.scale_bits.sum(keepdims=True))
        return _share(resident[0], self.bits.sum())

    def summary(self) -> dict:
        """Plain lists and floats (JSON): the frequencies, and every share overall and per layer."""
        return {
            "head_dim": self.head_dim,
            "bits": float(self.bits.mean()), "code_bits": float(self.code_bits.mean()),
            "scale_bits": float(self.scale_bits.mean()),
            "read_frequency": self.overall_read_frequency.tolist(),
            "code_share": self.overall_code_share.tolist(),
            "scale_share": self.overall_scale_share,
            "resident_share": self.overall_resident_share.tolist(),
            "per_layer": {
                "read_frequency": self.read_frequency.tolist(), "code_share": self.code_share.tolist(),
                "scale_share": self.scale_share.tolist(), "resident_share": self.resident_share.tolist(),
                "bits": self.bits.tolist(),
            },
        }


def _share(part, whole):
    part, whole = np.asarray(part, np.float64), np.asarray(whole, np.float64)
    return np.divide(part, whole, out=np.zeros(np.broadcast_shapes(part.shape, whole.shape)), where=whole > 0)


def _resident_bits(plane_bits: np.ndarray, scale_bits: np.ndarray) -> np.ndarray:
    """``[L, 5]`` bits of planes ``[0, p)`` plus, from ``p = 1`` on, the scales."""
    cumulative = np.concatenate([np.zeros_like(plane_bits[:, :1]), np.cumsum(plane_bits, axis=1)], axis=1)
    return cumulative + np.where(np.arange(N_PLANES + 1) >= 1, scale_bits[:, None], 0.0)


def _layer_methods(method: Fathom | Sequence[Fathom], n_layers: int, head_dim: int) -> tuple[Fathom, ...]:
    methods = (method,) * n_layers if isinstance(method, ScanMethod) else tuple(method)
    if len(methods) != n_layers:
        raise ValueError(f"method must be one Fathom or one per layer ({n_layers}), got {len(methods)}")
    for m in methods:
        if type(m) is not Fathom:
            raise TypeError(f"method must be Fathom (the raw-plane store), got {m!r}: the KLT store's read depends on "
                            "its rotation as well, and other methods read no planes by depth")
        m.validate(head_dim)
    return methods


def _check_shapes(queries, calib: Calibration) -> None:
    if queries.ndim < 3:
        raise ValueError(f"queries must be [L, *B, G, D] (layers first), got shape {queries.shape}")
    n_layers, batch, d = queries.shape[0], queries.shape[1:-2], queries.shape[-1]
    if calib.head_dim != d:
        raise ValueError(f"queries' head_dim {d} does not match the calibration's {calib.head_dim}")
    if not calib.batch_shape or calib.batch_shape[0] != n_layers:
        raise ValueError(f"calib must be [L, *C] with L = {n_layers} layers first (as queries), got leading axes "
                         f"{calib.batch_shape}")
    per_layer = calib.batch_shape[1:]
    if len(per_layer) > len(batch) or any(c not in (1, b) for c, b in zip(per_layer[::-1], batch[::-1])):
        raise ValueError(f"calib's axes after the layer {per_layer} must match the trailing axes of queries' "
                         f"groups {batch} (e.g. calib [L, Hkv] with queries [L, P, Hkv, G, D])")


@functools.partial(jax.jit, static_argnames=("planner", "implementation"))
def _layer_depths(q, calib, budget, *, planner, implementation):
    # The budget enters as data (one program for every budget; Fathom checks a traced budget at run time). Fathom
    # reads nothing from the index to plan its depths: only the queries and the calibration variance.
    method = Fathom(budget, planner=planner)
    return method.read(q, None, calib, implementation=implementation).depths


def _layer_counts(q, calib, budget, *, planner, implementation):
    return plane_read_counts(_layer_depths(q, calib, budget, planner=planner, implementation=implementation))


def plane_reads(
    method: Fathom | Sequence[Fathom],
    queries: Float[Array, "L *B G D"],
    calib: Calibration,
    *,
    implementation: str | None = None,
) -> PlaneReads:
    """Plan every group's read with ``method`` (one :class:`~fathom_jax.methods.Fathom`, or one per layer) and count
    how often each plane is read, layer by layer.

    ``queries`` are post-RoPE, ``[L, *B, G, D]``: layers first, any group axes ``B`` (positions, KV heads, ...), the
    G query heads of a KV group. ``calib`` has leading axes ``[L, *C]`` with ``C`` matching the trailing axes of ``B``
    (``calib [L, Hkv]`` with ``queries [L, P, Hkv, G, D]``); only its ``variance`` is read. ``implementation`` is the
    planner's (None: the backend's default).
    """
    queries = jnp.asarray(queries, jnp.float32)
    _check_shapes(queries, calib)
    methods = _layer_methods(method, queries.shape[0], queries.shape[-1])
    counts = [np.asarray(_layer_counts(queries[layer], calib[layer], np.int32(m.budget), planner=m.planner,
                                       implementation=implementation)) for layer, m in enumerate(methods)]
    triples = queries[0].size // queries.shape[-2]  # groups x channels per layer
    return PlaneReads(np.stack(counts) / triples, queries.shape[-1])


def plan_depths(
    method: Fathom | Sequence[Fathom],
    queries: Float[Array, "L *B G D"],
    calib: Calibration,
    *,
    implementation: str | None = None,
) -> Int[Array, "L *B D"]:
    """The planned depth of every channel of every group, layer by layer (arguments as :func:`plane_reads`)."""
    queries = jnp.asarray(queries, jnp.float32)
    _check_shapes(queries, calib)
    methods = _layer_methods(method, queries.shape[0], queries.shape[-1])
    return jnp.stack([_layer_depths(queries[layer], calib[layer], np.int32(m.budget), planner=m.planner,
                                    implementation=implementation) for layer, m in enumerate(methods)])


@dataclasses.dataclass(frozen=True)
class PlaneReuse:
    """What a device cache of the host planes read by the last ``window`` decode steps would fetch, pooled over
    steps and groups (:func:`plane_reuse`). Counts are channel planes per group and step: one channel's plane is one
    bit per token, so a count times ``tokens / 8`` is bytes over the link (or in the cache)."""

    resident: int
    window: int
    read: float  # host channel planes a step reads (mean)
    new: float  # the share of them that none of the last ``window`` steps read
    held_mean: float  # channel planes the cache holds: this step's and the window's (mean)
    held_max: int  # and its largest (what a fixed-size cache needs)


def plane_reuse(depths: Int[Array, "T *N D"], resident: int, window: int) -> PlaneReuse:
    """Plane reuse of ``T`` consecutive steps' planned ``depths`` (any group axes ``N``): a step reads channel j's
    planes ``[resident, depth_j)`` from the host; a cache of what the last ``window`` steps read holds planes
    ``[resident, max_w depth_j(t - w))``, so the step still fetches ``max(0, depth_j - max(resident, held_j))`` of
    them. Steps ``window .. T - 1`` are counted (each has a full window before it)."""
    d = np.asarray(depths, np.int64)
    if d.ndim < 2 or not 1 <= window < d.shape[0]:
        raise ValueError(f"depths must be [T, *N, D] with T > window >= 1, got shape {d.shape} and window {window}")
    if not 0 <= resident <= N_PLANES:
        raise ValueError(f"resident must lie in [0, {N_PLANES}] planes, got {resident}")
    now = d[window:]
    held = np.max(np.stack([d[window - w:d.shape[0] - w] for w in range(1, window + 1)]), axis=0)
    read = np.maximum(now - resident, 0).sum(-1)
    new = np.maximum(now - np.maximum(held, resident), 0).sum(-1)
    kept = np.maximum(np.maximum(now, held) - resident, 0).sum(-1)
    total = read.sum()
    return PlaneReuse(resident, window, float(read.mean()), float(new.sum() / total) if total else 0.0,
                      float(kept.mean()), int(kept.max()))
