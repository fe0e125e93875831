"""Per-query read depths by reverse water-filling (paper Eq. 3 and 4).

For the G query heads that share a KV head, channel j carries score variance
``g_j = sum_h q_j^(h)^2 Var(k_j)`` (raw basis) or ``sum_h ((q V)_j)^2 lambda_j`` (KLT basis). Reading
``t_j`` planes leaves error ``~ g_j 4^-t_j``; under a budget ``sum_j t_j <= B`` the optimum is
``t_j = clip(round(log4(g_j / theta)), 0, 4)`` at the smallest water line ``theta`` that fits, found
by 30 bisection steps on ``log theta``.

Rounding ``log4(g/theta)`` gives channel j its t-th plane exactly when ``g_j 4^-t >= theta / 2``, the
same order as the marginal gains ``3/4 g_j 4^-(t-1)``. So the bisection reproduces the exact greedy
integer allocation (``plan_exact``) except for ties; ``results/planner_cpu.md`` times both.

Everything here is jit- and vmap-friendly: leading axes of ``importance`` (groups, heads, layers,
batch) broadcast against ``budget``; budgets may be traced (per-layer budgets inside ``lax.scan``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from fathom_jax import format as fmt
from fathom_jax.checks import CheckError, fail_if, is_traced
from fathom_jax.format import N_PLANES
from pallas_kernels import backend
from pallas_kernels import water_line as water_line_lib

BISECTION_STEPS = 30
_LOG4 = math.log(4.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """Depths for one query group, with its water line and exact bit accounting."""

    depths: Int[Array, "*G D"]  # planes read per channel, 0..4
    theta: Float[Array, "*G"]  # water line (for plan_exact: the smallest marginal gain taken)
    code_bits: Int[Array, "*G"]  # sum_j t_j
    bits_per_token: Float[Array, "*G"]  # code bits + 16 bits per 64 tokens per active channel

    @property
    def active(self) -> Int[Array, "*G D"]:
        return self.depths > 0


def make_plan(depths: Array, theta: Array) -> ReadPlan:
    """A :class:`ReadPlan` of ``depths`` with its exact bit accounting (code bits, bits per token as read)."""
    depths = depths.astype(jnp.int32)
    return ReadPlan(depths=depths, theta=theta, code_bits=jnp.sum(depths, axis=-1), bits_per_token=fmt.bits_per_token(depths))


def _check_real(name: str, x, want: str) -> None:
    """Trace-time dtype check: real numbers (floating point or integer), with the expected shape in the message."""
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"{name} must be real numbers {want}, got dtype {dtype}")


def _check_shapes(name: str, q_shape, stat_shape, stat: str, want: str) -> None:
    """``q [*G, H, D]`` against a per-channel statistic ``[*G, D]`` (leading axes broadcast)."""
    lead, d = q_shape[:-2], q_shape[-1] if q_shape else None
    ok = len(q_shape) >= 2 and len(stat_shape) >= 1 and stat_shape[-1] == d
    if ok:
        try:
            np.broadcast_shapes(lead, stat_shape[:-1])
        except ValueError:
            ok = False
    if not ok:
        raise CheckError(f"{name}: q must be [*G, H, D] and {stat} {want}; got q {list(q_shape)} and {stat} "
                         f"{list(stat_shape)}" + (f" (expected {stat} [..., {d}])" if len(q_shape) >= 2 else ""))


def importance(q: Float[Array, "*G H D"], variance: Float[Array, "*G D"]) -> Float[Array, "*G D"]:
    """Eq. 3: ``g_j = sum_h q_j^2 Var(k_j)`` over the query heads of the group (axis -2).

    For the KLT store pass queries already rotated (``q V``) and the eigenvalues as ``variance``. Shapes and
    dtypes are checked at trace time (``variance``'s leading axes broadcast against the groups ``*G``).
    """
    _check_real("importance: q", q, "[*G, H, D]")
    _check_real("importance: variance", variance, "[*G, D]")
    _check_shapes("importance", jnp.shape(q), jnp.shape(variance), "variance", "[*G, D]")
    q = jnp.asarray(q, jnp.float32)
    return jnp.sum(q * q, axis=-2) * jnp.asarray(variance, jnp.float32)


def prompt_importance(q: Float[Array, "R G T D"], variance: Float[Array, "R D"], length: Int[Array, "R"],
                      window: int = 1024) -> Float[Array, "R D"]:
    """The planner's importance ``g_j = E[sum_h q_hj^2] Var(k_j)`` (Eq. 3) averaged over each group's last ``window``
    valid prompt positions (``< length``): what :func:`fathom_jax.store.tiered.warm_choice` ranks a session's channel
    planes by."""
    _, g, t, d = q.shape
    w = min(window, t)
    start = jnp.clip(length - w, 0, t - w)  # each group's last w positions (the whole prompt if shorter)
    q = jax.vmap(lambda x, s: jax.lax.dynamic_slice(x, (0, s, 0), (g, w, d)))(q, start)  # [R, G, w, D]
    used = start[:, None] + jnp.arange(w) < length[:, None]  # [R, w]
    energy = jnp.sum(jnp.square(q.astype(jnp.float32)), axis=1)  # [R, w, D]
    mean = jnp.sum(energy * used[..., None], axis=1) / jnp.maximum(jnp.sum(used, axis=1), 1)[:, None]
    return mean * variance.astype(jnp.float32)


def importance_klt(
    q: Float[Array, "*G H D"], basis: Float[Array, "*G D D"], eigenvalues: Float[Array, "*G D"]
) -> Float[Array, "*G D"]:
    """The KLT form of Eq. 3: ``g_j = sum_h ((q V)_j)^2 lambda_j`` for raw (unrotated) queries."""
    _check_real("importance_klt: q", q, "[*G, H, D]")
    _check_real("importance_klt: basis", basis, "[*G, D, D]")
    b = jnp.shape(basis)
    if len(b) < 2 or b[-1] != b[-2]:
        raise CheckError(f"importance_klt: basis must be [*G, D, D], got shape {list(b)}")
    _check_shapes("importance_klt", jnp.shape(q), b[:-1], "basis", "[*G, D, D]")
    return importance(jnp.einsum("...hd,...de->...he", q, basis), eigenvalues)


def water_line_thresholds(g: Float[Array, "*G D"]) -> Float[Array, "*G 4 D"]:
    """``log g_j - (t + 1/2) log 4`` for planes ``t = 0..3``: channel j reads plane t at log water line x iff
    ``x <= thresholds[t, j]``, i.e. ``g_j 4^-t >= theta / 2`` (NaN where ``g_j = 0``: never read).

    Eq. 4 as comparisons: the bisection then needs no logarithm per trial, so every implementation of it
    (XLA, the Pallas kernel) gives the same depths bit for bit.
    """
    g = jnp.asarray(g, jnp.float32)
    offsets = jnp.asarray([(t + 0.5) * _LOG4 for t in range(N_PLANES)], jnp.float32)
    thresholds = jnp.log(g)[..., None, :] - offsets[:, None]
    return jnp.where((g > 0)[..., None, :], thresholds, jnp.nan)


def _depths_from(thresholds: Array, log_theta: Array) -> Array:
    return jnp.sum(log_theta[..., None, None] <= thresholds, axis=-2, dtype=jnp.int32)


def depths_at(g: Float[Array, "*G D"], theta: Float[Array, "*G"]) -> Int[Array, "*G D"]:
    """Eq. 4 at a given water line: ``clip(round(log4(g / theta)), 0, 4)``; zero importance reads nothing.

    Exact halves round up (``floor(x + 1/2)``), as Appendix A does: a channel whose gain for its t-th
    plane is exactly ``theta / 2`` gets that plane (``jnp.round`` would round half to even).
    """
    return _depths_from(water_line_thresholds(g), jnp.log(jnp.asarray(theta, jnp.float32)))


def _check_budget(budget, d: int) -> None:
    """Budgets are whole numbers of code bits in [0, 4 D]: eagerly, or at run time when traced (a host call only
    on failure), because a larger budget would otherwise be clamped to reading everything, and 48.7 planned as 48,
    without a word."""
    top = N_PLANES * d
    b = jnp.asarray(budget, jnp.float32) if is_traced(budget) else np.asarray(budget, np.float64)

    def bad(x):  # NaN fails every comparison
        floor = jnp.floor if is_traced(x) else np.floor
        return ~((x >= 0) & (x <= top) & (x == floor(x)))

    fail_if(bad(b), lambda got: f"budget must lie in [0, {top}] code bits (4 x D = {top} at D = {d}) and be a whole "
                                f"number, got {got[bad(got)].ravel()[:4].tolist()}", b)


def _check_importance(g) -> jax.Array:
    """Importances ``[*G, D]`` must be finite and non-negative. Concrete: a CheckError. Traced (the decode hot
    path): checked in checkify mode only; otherwise a channel whose importance is NaN, inf or negative is not
    read (depth 0), the documented default, and the other channels are planned as if it were 0."""
    _check_real("importance", g, "[*G, D]")
    if jnp.ndim(g) < 1:
        raise CheckError(f"importance must be [*G, D], got shape {list(jnp.shape(g))}")
    g = jnp.asarray(g, jnp.float32)
    valid = jnp.isfinite(g) & (g >= 0)
    fail_if(~valid, lambda got: f"importance must be finite and non-negative (sum of squared query weights x "
                                f"variances), got {int(np.sum(~np.isfinite(got)))} NaN or inf and "
                                f"{int(np.sum(got < 0))} negative value(s)", g, hot=True)
    return jnp.where(valid, g, 0.0)


def _check_budget_shape(budget, groups: tuple[int, ...]) -> None:
    try:
        ok = np.broadcast_shapes(jnp.shape(budget), groups) == groups
    except ValueError:
        ok = False
    if not ok:
        raise CheckError(f"budget must be a scalar or broadcast to the query groups [*G] = {list(groups)}, got shape "
                         f"{list(jnp.shape(budget))}")


def _prepare(g, budget, bracket):
    """Validated importance, budgets broadcast to the groups, and the bracket of the log water line.

    The default bracket spans from ``4^-4.5`` below the smallest positive importance (every channel at
    full depth) to 4x the largest (nothing read), so it always contains the water line.
    """
    g = _check_importance(g)
    _check_budget(budget, g.shape[-1])
    _check_budget_shape(budget, g.shape[:-1])
    budget = jnp.broadcast_to(jnp.asarray(budget, jnp.float32), g.shape[:-1])
    if bracket is None:
        positive = g > 0
        log_max = jnp.log(jnp.max(jnp.where(positive, g, 1.0), axis=-1))
        log_min = jnp.log(jnp.min(jnp.where(positive, g, jnp.inf), axis=-1))
        log_min = jnp.where(jnp.isfinite(log_min), log_min, 0.0)
        log_lo = log_min - (N_PLANES + 0.5) * _LOG4
        log_hi = log_max + _LOG4
    else:
        if not 0 < bracket[0] < bracket[1] < math.inf:
            raise ValueError(f"bracket must be (theta_lo, theta_hi) with 0 < theta_lo < theta_hi < inf, got {bracket}")
        log_lo = jnp.full(g.shape[:-1], math.log(bracket[0]), jnp.float32)
        log_hi = jnp.full(g.shape[:-1], math.log(bracket[1]), jnp.float32)
    return g, budget, log_lo, log_hi


def bisection_trace(
    g: Float[Array, "*G D"],
    budget: Int[Array, "*G"] | int,
    *,
    bracket: tuple[float, float] | None = None,
    steps: int = BISECTION_STEPS,
) -> tuple[ReadPlan, Float[Array, "steps *G"], Int[Array, "steps *G"]]:
    """Bisection on ``log theta``, returning the plan and every trial's ``theta`` and bit sum.

    Each trial is the geometric mean of the bracket; a trial whose depths overflow the budget becomes
    the new lower end, otherwise the new upper end, and the plan is read at the final upper end.
    """
    g, budget, log_lo, log_hi = _prepare(g, budget, bracket)
    thresholds = water_line_thresholds(g)

    def step(carry, _):
        lo, hi, accepted = carry
        mid = 0.5 * (lo + hi)
        depths = _depths_from(thresholds, mid)
        used = jnp.sum(depths, axis=-1)
        over = used.astype(jnp.float32) > budget
        accepted = jnp.where(over[..., None], accepted, depths)
        return (jnp.where(over, mid, lo), jnp.where(over, hi, mid), accepted), (jnp.exp(mid), used)

    # The plan is the depths of the last trial that fit (all zero at the initial upper end: nothing read), not
    # depths re-evaluated at the final water line: the line converges onto a breakpoint where log4(g / theta)
    # is a half-integer to within float rounding, and a second evaluation there can round the other way
    # (seen on SmolLM2: 33 code bits at a budget of 32 in ~1% of groups).
    init = (log_lo, log_hi, jnp.zeros(g.shape, jnp.int32))
    (_, log_hi, depths), (trials, sums) = jax.lax.scan(step, init, None, length=steps, unroll=True)
    return make_plan(depths, jnp.exp(log_hi)), trials, sums


def plan_bisection(
    g: Float[Array, "*G D"],
    budget: Int[Array, "*G"] | int,
    *,
    bracket: tuple[float, float] | None = None,
    steps: int = BISECTION_STEPS,
    implementation: backend.Implementation | None = None,
) -> ReadPlan:
    """The paper's planner: depths at the water line found by ``steps`` bisection steps on log theta.

    ``implementation="triton"`` runs the bisection as one kernel launch (:mod:`pallas_kernels.water_line`);
    ``"xla"`` as an XLA loop. Both give the same plan bit for bit (and equal :func:`bisection_trace`).
    """
    g, budget, log_lo, log_hi = _prepare(g, budget, bracket)
    batch, d = g.shape[:-1], g.shape[-1]
    n = math.prod(batch)
    thresholds = jnp.moveaxis(water_line_thresholds(g).reshape(n, N_PLANES, d), 1, 0)
    bracket = (log_lo.reshape(n), log_hi.reshape(n))
    depths, log_hi = water_line_lib.water_line(thresholds, budget.reshape(n), bracket,
                                               spec=water_line_lib.WaterLineSpec(steps), implementation=implementation)
    return make_plan(depths.reshape(g.shape), jnp.exp(log_hi).reshape(batch))


def plan_exact(g: Float[Array, "*G D"], budget: Int[Array, "*G"] | int) -> ReadPlan:
    """Exact integer allocation: the ``budget`` largest marginal gains ``g_j 4^-t`` (t = 0..3).

    Marginal gains fall by 4x per plane within a channel, so taking the largest ones overall gives every
    channel a prefix of its planes; zero-importance channels are never read.
    """
    g = _check_importance(g)
    d = g.shape[-1]
    _check_budget(budget, d)
    _check_budget_shape(budget, g.shape[:-1])
    budget = jnp.broadcast_to(jnp.asarray(budget, jnp.int32), g.shape[:-1])
    gains = g[..., :, None] * (0.25 ** jnp.arange(N_PLANES, dtype=jnp.float32))  # [*G, D, 4]
    flat = gains.reshape(*g.shape[:-1], d * N_PLANES)
    order = jnp.argsort(-flat, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    taken = (rank < budget[..., None]) & (flat > 0)
    depths = jnp.sum(taken.reshape(*g.shape[:-1], d, N_PLANES), axis=-1)
    smallest = jnp.min(jnp.where(taken, flat, jnp.inf), axis=-1)
    return make_plan(depths, jnp.where(jnp.isfinite(smallest), smallest, 0.0))


def plan(
    g: Float[Array, "*G D"],
    budget: Int[Array, "*G"] | int,
    *,
    method: str = "bisection",
    implementation: backend.Implementation | None = None,
) -> ReadPlan:
    """Plan read depths with ``method`` = ``"bisection"`` (the paper's) or ``"exact"``."""
    if method == "bisection":
        return plan_bisection(g, budget, implementation=implementation)
    if method == "exact":
        return plan_exact(g, budget)
    raise ValueError(f"method must be 'bisection' or 'exact', got {method!r}")


def greedy_layer_budgets(
    errors: Float[Array, "L K"] | np.ndarray,
    grid: Int[Array, "K"] | np.ndarray,
    target_mean: float,
) -> np.ndarray:
    """The per-layer plan of section 3.3: budgets ``B_l`` from ``grid`` at a mean of ``target_mean``.

    ``errors[l, i]`` is layer l's calibration error at budget ``grid[i]``. Every layer starts at the
    smallest budget; each step moves the layer with the largest error drop per extra bit one grid step
    up, as long as the mean budget stays within ``target_mean``. Runs once, offline, on host numbers.
    """
    errors = np.asarray(errors, np.float64)
    grid = np.asarray(grid)
    if errors.ndim != 2 or errors.shape[1] != grid.shape[0]:
        raise ValueError(f"errors must be [layers, len(grid)] = [L, {grid.shape[0]}], got {errors.shape}")
    if np.any(np.diff(grid) <= 0):
        raise ValueError(f"grid must be strictly increasing, got {grid}")
    if not grid[0] <= target_mean <= grid[-1]:
        raise ValueError(f"target_mean must lie in [{grid[0]}, {grid[-1]}], got {target_mean}")
    n_layers = errors.shape[0]
    level = np.zeros(n_layers, np.int64)
    total_cap = target_mean * n_layers
    while True:
        best, best_gain = -1, -np.inf
        for layer in range(n_layers):
            i = level[layer]
            if i + 1 >= grid.shape[0]:
                continue
            cost = grid[i + 1] - grid[i]
            if grid[level].sum() + cost > total_cap + 1e-9:
                continue
            gain = (errors[layer, i] - errors[layer, i + 1]) / cost
            if gain > best_gain:
                best, best_gain = layer, gain
        if best < 0:
            break
        level[best] += 1
    return grid[level]
