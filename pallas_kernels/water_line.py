"""Water line: Fathom's bisection planner as one program per block of query groups.

Each of ``N`` groups has, per channel ``j`` and plane ``t = 0..3``, a threshold on the log water line,
``thresholds[t, n, j] = log g_j - (t + 1/2) log 4`` (NaN where ``g_j = 0``: never read), a code-bit
``budget[n]`` and a bracket ``(log_lo[n], log_hi[n])`` that holds the water line. Channel ``j`` reads
``depth_j(x) = #{t : x <= thresholds[t, j]}`` planes at log water line ``x``. Bisection: ``steps`` times,
try ``x = (lo + hi) / 2``; if the depths overflow the budget, ``x`` becomes the new ``lo``, else the new
``hi`` and its depths the plan. ``steps`` and ``plane_cost`` are static (a :class:`WaterLineSpec`); ``plane_cost``
prices plane t of a channel: all ones count code bits; ``(1.25, 1, 1, 1)`` counts bits as read, the first plane of
a channel paying its fp16 block scale (the library's allocation). Returns the plan ``depths i32 [N, D]`` and the final ``log_hi f32 [N]``.

Why a kernel: in XLA the 30 steps are ~40 small kernels per layer (each step ends in a reduction), whose
launches the decode step paid at every context (``results/offload_h200.md``, NOTES.md "Planner"); here they
are one launch. Why thresholds: the loop is comparisons, one IEEE add and a multiply by 1/2 only, so
the kernel and the XLA reference give the same plan bit for bit on every backend; the logarithms (which
Triton and XLA round differently) are taken once, outside, by XLA (the library's planner).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import backend as B
from pallas_kernels.plane_layout import N_PLANES

KERNEL_NAME = "water_line"


@dataclasses.dataclass(frozen=True)
class WaterLineConfig:
    """``rows``: groups per program (a power of two); ``num_warps``: Triton warps."""

    rows: int = 8
    num_warps: int = 4

    def __post_init__(self):
        B.check_pow2("rows", self.rows)


def _validate(thresholds, budget, bracket):
    B.check_array("thresholds", thresholds, ndim=3, dtypes=(jnp.float32,))
    if thresholds.shape[0] != N_PLANES:
        raise ValueError(f"thresholds must be [{N_PLANES}, N, D] (one row per plane), got {thresholds.shape}")
    if not isinstance(bracket, (tuple, list)) or len(bracket) != 2:
        raise ValueError(f"bracket must be (log_lo [N], log_hi [N]), got {type(bracket).__name__}")
    n = thresholds.shape[1]
    for name, x in (("budget", budget), ("log_lo", bracket[0]), ("log_hi", bracket[1])):
        B.check_array(name, x, ndim=1, dtypes=(jnp.float32,))
        if x.shape != (n,):
            raise ValueError(f"{name} must be [N] = [{n}], got {x.shape}")


UNIT_COST = (1.0,) * N_PLANES  # every plane one code bit: the paper's budget


@dataclasses.dataclass(frozen=True)
class WaterLineSpec:
    """What fixes the bisection (static): ``steps`` bisection steps, ``plane_cost`` the bits of plane t of a channel
    (positive multiples of 1/4; all ones count code bits)."""

    steps: int
    plane_cost: tuple[float, ...] = UNIT_COST

    def __post_init__(self):
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {self.steps!r}")
        cost = tuple(float(c) for c in self.plane_cost)
        if len(cost) != N_PLANES or not all(c > 0 and (4 * c).is_integer() for c in cost):
            raise ValueError(f"plane_cost must be {N_PLANES} positive multiples of 1/4 (bits per plane), got "
                             f"{self.plane_cost}")
        object.__setattr__(self, "plane_cost", cost)  # one hashable form: a static argument of the kernel's jit


def _used(reads, plane_cost) -> jax.Array:
    """Bits a trial spends from its per-plane reads ``[4] x [rows, D]`` (bool): code bits when every plane costs
    one (summed as integers, as before plane costs existed), else each channel's cost in quarter bits summed as
    integers, then quartered (exact: the costs are multiples of 1/4 and the sums small). One reduction per
    trial either way: four (one per plane) made XLA:CPU compile the unrolled bisection ~3x slower."""
    if plane_cost == UNIT_COST:
        total = reads[0].astype(jnp.int32)
        for r in reads[1:]:
            total += r.astype(jnp.int32)
        return jnp.sum(total, axis=-1).astype(jnp.float32)
    quarters = [int(4 * c) for c in plane_cost]
    total = quarters[0] * reads[0].astype(jnp.int32)
    for q, r in zip(quarters[1:], reads[1:]):
        total += q * r.astype(jnp.int32)
    return 0.25 * jnp.sum(total, axis=-1).astype(jnp.float32)


def water_line_reference(thresholds, budget, bracket, *, spec: WaterLineSpec):
    """Plain jnp: the bisection as a loop."""
    _validate(thresholds, budget, bracket)
    plane_cost = spec.plane_cost

    def step(_, carry):
        lo, hi, depths = carry
        mid = 0.5 * (lo + hi)
        reads = [mid[:, None] <= thresholds[t] for t in range(N_PLANES)]
        trial = jnp.sum(jnp.stack(reads), axis=0, dtype=jnp.int32)
        over = _used(reads, plane_cost) > budget
        return jnp.where(over, mid, lo), jnp.where(over, hi, mid), jnp.where(over[:, None], depths, trial)

    init = (*bracket, jnp.zeros(thresholds.shape[1:], jnp.int32))
    _, hi, depths = jax.lax.fori_loop(0, spec.steps, step, init)
    return depths, hi


def _water_line_kernel(
    # inputs
    thr_ref,  # f32 [4, rows, D]
    budget_ref,  # f32 [rows]
    lo_ref,  # f32 [rows]
    hi_ref,  # f32 [rows]
    # outputs
    depths_ref,  # i32 [rows, D]
    hi_out_ref,  # f32 [rows]
    *,
    steps: int,
    plane_cost: tuple[float, ...],
):
    thresholds = [thr_ref[t] for t in range(N_PLANES)]
    budget = budget_ref[...]

    def step(_, carry):
        lo, hi, depths = carry
        mid = 0.5 * (lo + hi)
        reads = [mid[:, None] <= thr for thr in thresholds]
        trial = reads[0].astype(jnp.int32)
        for r in reads[1:]:
            trial += r.astype(jnp.int32)
        over = _used(reads, plane_cost) > budget
        return jnp.where(over, mid, lo), jnp.where(over, hi, mid), jnp.where(over[:, None], depths, trial)

    init = (lo_ref[...], hi_ref[...], jnp.zeros(depths_ref.shape, jnp.int32))
    _, hi, depths = jax.lax.fori_loop(0, steps, step, init)
    depths_ref[...] = depths
    hi_out_ref[...] = hi


@functools.partial(jax.jit, static_argnames=("spec", "config", "interpret"))
def _water_line_pallas(thresholds, budget, bracket, *, spec, config, interpret):
    _, n, d = thresholds.shape
    rows = config.rows
    n_pad, d_pad = pl.cdiv(n, rows) * rows, pl.next_power_of_2(d)
    # Padded channels and groups never read (NaN thresholds); padded groups are cut off below.
    thresholds = jnp.pad(thresholds, ((0, 0), (0, n_pad - n), (0, d_pad - d)), constant_values=jnp.nan)
    budget, log_lo, log_hi = (jnp.pad(x, (0, n_pad - n)) for x in (budget, *bracket))
    row_spec = pl.BlockSpec((rows,), lambda i: (i,))
    depths, hi = pl.pallas_call(
        functools.partial(_water_line_kernel, steps=spec.steps, plane_cost=spec.plane_cost),
        out_shape=(jax.ShapeDtypeStruct((n_pad, d_pad), jnp.int32), jax.ShapeDtypeStruct((n_pad,), jnp.float32)),
        grid=(n_pad // rows,),
        in_specs=[pl.BlockSpec((N_PLANES, rows, d_pad), lambda i: (0, i, 0)), row_spec, row_spec, row_spec],
        out_specs=(pl.BlockSpec((rows, d_pad), lambda i: (i, 0)), row_spec),
        interpret=interpret,
        name=KERNEL_NAME,
        compiler_params=B.compiler_params(config.num_warps),
    )(thresholds, budget, log_lo, log_hi)
    return depths[:n, :d], hi[:n]


def water_line(
    thresholds,  # f32 [4, N, D]   log g_j - (t + 1/2) log 4; NaN: never read
    budget,  # f32 [N]   bits: code bits (unit plane costs) or sum of plane_cost over the planes read
    bracket,  # (log_lo f32 [N], log_hi f32 [N])  a bracket of the log water line
    *,
    spec: WaterLineSpec,
    implementation: B.Implementation | None = None,
    config: WaterLineConfig | None = None,
    interpret: bool | None = None,
):
    """``(depths i32 [N, D], log_hi f32 [N])``: the last trial that fit the budget and the final upper end."""
    implementation = B.resolve_implementation(implementation)
    bracket = tuple(bracket) if isinstance(bracket, list) else bracket
    _validate(thresholds, budget, bracket)
    if implementation == "xla":
        return water_line_reference(thresholds, budget, bracket, spec=spec)
    return _water_line_pallas(thresholds, budget, bracket, spec=spec, config=config or WaterLineConfig(),
                              interpret=B.resolve_interpret(interpret))
