"""The plane scan's (:func:`pallas_kernels.plane_scan.plane_scan`) configuration, the check of its operands, the
launch of a kernel body (:mod:`pallas_kernels.plane_scan_bodies`) with its epilogue, and the plain-jnp scores of its
reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import plane_scan_bodies as bodies
from pallas_kernels.backend import check_array, check_pow2
from pallas_kernels.operands import ResidentPlanes, RunList, StorePlanes
from pallas_kernels.plane_layout import BLOCK_TOKENS, N_PLANES, WORD_BITS

MATHS = ("f32", "f16x2")


@dataclasses.dataclass(frozen=True)
class PlaneScanConfig:
    """Static tuning of the plane scan.

    ``tile``: tokens per program (a power of two, >= 32 * lanes); ``lanes``: consecutive tokens per
    thread (8, 16 or 32); ``num_warps`` / ``num_stages``: Triton launch parameters; ``math``: the kernel's arithmetic,
    ``"f32"`` or ``"f16x2"`` (pairs of tokens in packed f16, ``lanes = 32``; :mod:`pallas_kernels.plane_scan_bodies`).
    ``tile`` and ``lanes`` default to the H200's best for the arithmetic (``results/kernels_h200.md``).
    """

    tile: int | None = None
    lanes: int | None = None
    num_warps: int = 1
    num_stages: int | None = None
    math: str = "f32"

    def __post_init__(self):
        if self.math not in MATHS:
            raise ValueError(f"math must be one of {MATHS}, got {self.math!r}")
        wide = self.math == "f16x2"
        if self.lanes is None:
            object.__setattr__(self, "lanes", WORD_BITS if wide else 16)
        if self.tile is None:
            object.__setattr__(self, "tile", 1024 if wide else 512)
        check_pow2("tile", self.tile)
        if self.lanes not in (8, 16, 32) or self.tile < WORD_BITS * self.lanes:
            raise ValueError(f"lanes must be 8, 16 or 32 with tile >= 32 * lanes, got lanes={self.lanes}, tile={self.tile}")
        if wide and self.lanes != WORD_BITS:
            raise ValueError(f"math='f16x2' pairs the tokens of a whole plane word: it needs lanes=32, "
                             f"got {self.lanes}")

    @classmethod
    def heuristic(cls, capacity: int, math: str = "f32") -> "PlaneScanConfig":
        """The defaults for ``math`` (f32: 16 lanes, 512-token tiles, 1 warp: the H200's best from 32k to 128k tokens,
        ``results/kernels_h200.md``; f16x2: 1024-token tiles, 1 warp, within 2% of the best of three shapes,
        ``results/kernels_h200_f16x2.md``); small stores keep the same shape."""
        del capacity
        return cls(math=math)



def check_scan_inputs(q, store: StorePlanes, length, runs: RunList, name: str) -> tuple:
    """The scan's operands checked (dtypes, shapes); returns the batch shape of the per-group operands."""
    check_array("q", q, ndim_min=2, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16))
    batch = store.check(q.shape[:-2], name)
    d = store.head_dim
    runs.check(d)
    if q.shape[:-2] != batch or q.shape[-1] != d:
        raise ValueError(f"q must be [*batch, G, D] = [{batch}, G, {d}], got {q.shape}")
    if jnp.shape(length) != batch:
        raise ValueError(f"length must have the batch shape {batch}, got {jnp.shape(length)}")
    if runs.batch != batch:
        raise ValueError(f"runs: channels/depths must both be [*batch, C] = [{batch}, C], got {runs.channels.shape}")
    return batch


def scores_reference(q, store: StorePlanes, length, runs: RunList, *, resident: ResidentPlanes | None = None):
    """The scan's scores ``[*, G, n]`` in plain jnp, independent of the kernels: the selected channels' planes
    unpacked to codes and dequantized (0 past ``length``)."""
    if resident is not None:
        store = dataclasses.replace(store, planes=resident.planes(store.planes))
    planes, scales = store.read(q.shape[0])
    channels, depths = runs.channels, runs.depths
    *batch, d, _, w = planes.shape
    n = WORD_BITS * w
    sel = jnp.take_along_axis(planes, channels[..., :, None, None], axis=-3)  # [*, C, 4, W]
    bits = (sel[..., None] >> jnp.arange(WORD_BITS, dtype=jnp.uint32)) & 1  # [*, C, 4, W, 32]
    bits = bits.reshape(*sel.shape[:-1], n).astype(jnp.int32)  # [*, C, 4, n]
    t = depths[..., :, None]  # [*, C, 1]
    code = jnp.zeros(bits.shape[:-2] + (n,), jnp.int32)
    for p in range(N_PLANES):  # plane p is bit (t-1-p) of c_t when p < t
        code = code + jnp.where(p < t, bits[..., p, :] << jnp.maximum(t - 1 - p, 0), 0)
    half = jnp.left_shift(1, jnp.maximum(t, 1) - 1).astype(jnp.float32)
    a = jnp.take_along_axis(scales, channels[..., :, None], axis=-2).astype(jnp.float32)  # [*, C, NB]
    a = jnp.repeat(a, BLOCK_TOKENS, axis=-1)  # [*, C, n]
    value = jnp.where(t > 0, (code.astype(jnp.float32) + 0.5 - half) * a / half, 0.0)
    value = jnp.where(jnp.arange(n) < jnp.asarray(length)[..., None, None], value, 0.0)
    qc = jnp.take_along_axis(q.astype(jnp.float32), channels[..., None, :], axis=-1)  # [*, G, C]
    return jnp.einsum("...gc,...cn->...gn", qc, value, precision=jax.lax.Precision.HIGHEST)


def _class_bounds(depths):
    """``[*, 4]`` end offsets of the depth classes 4, 3, 2, 1 in a list sorted by decreasing depth."""
    counts = jnp.stack([jnp.sum(depths == t, axis=-1) for t in (4, 3, 2, 1)], axis=-1)
    return jnp.cumsum(counts, axis=-1).astype(jnp.int32)


def scan_call(q, store, length, runs, extra: tuple, *, config, interpret: bool, hot_group_start, epilogue,
              out_shape, name: str):
    """One scan launch over ``q [Rc, G, D]``, the stacked ``store`` at its layer (``i32 [1]``), ``length`` and the
    run list ``runs`` (``[Rc, C]``), grid (group, tile): each program scores its tile and hands the scores to
    ``epilogue(refs, tile, scores)``, whose refs are ``out_shape``'s outputs. ``extra``: the resident planes'
    operands (their hot tier groups ``hot_group_start ..``)."""
    r, g = q.shape[:2]
    channels, depths = runs.channels, runs.depths
    if not runs.sorted:
        order = jnp.argsort(-depths, axis=-1, stable=True)
        channels = jnp.take_along_axis(channels, order, axis=-1)
        depths = jnp.take_along_axis(depths, order, axis=-1)
        if extra:  # the kernel reads slot k's resident planes at its store channel (and its warm rows)
            hot, table, channels_in, *warm = extra
            warm = warm and [warm[0], jnp.take_along_axis(warm[1], order[..., None], axis=1)]
            extra = (hot, table, jnp.take_along_axis(channels_in, order, axis=-1), *warm)
    bounds = _class_bounds(depths)
    qc = jnp.take_along_axis(q.astype(jnp.float32), channels[:, None, :], axis=-1)
    split = WORD_BITS // config.lanes
    elems = config.tile // config.lanes
    inputs = (qc, channels, bounds, length, store.layer, store.planes, store.scales, *extra)
    if config.math == "f16x2":  # each thread's sums are bounded through the listed channels' largest |q|
        body = bodies.f16x2_body
        inputs = (qc, jnp.sum(jnp.where(depths[:, None, :] > 0, jnp.abs(qc), 0.0).max(axis=1), axis=-1), *inputs[1:])
    else:
        body = bodies.f32_body
    kernel = functools.partial(body, groups=g, elems=elems, lanes=config.lanes, num_words=store.width,
                               group_start=store.group_start, hot_group_start=hot_group_start, interpret=interpret,
                               n_resident=len(extra), epilogue=epilogue)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(r, pl.cdiv(store.width * split, elems)),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * len(inputs),
        interpret=interpret,
        name=name,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    )(*inputs)
