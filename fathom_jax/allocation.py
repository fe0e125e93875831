"""Read depths that pay for what they read: the fp16 block scale of a channel in the plan, any error model.

The paper's planner spends a budget of *code* bits (``sum_j t_j <= B``) and pays 16 bits per 64 tokens for
the scale of every channel it opens after the fact, so its bits as read (:func:`~fathom_jax.format.
bits_per_token`) vary with the number of channels the water line happens to open. Here the budget is in
bits as read: depth ``t`` of a channel costs ``c(t) = t + 1/4 [t > 0]`` bits per token (:func:`depth_bits`),
so the water line weighs one more channel (1.25 bits for its first plane) against one more plane of a
channel already open (1 bit).

The error model is a table ``E[j, t]``, the score error left by reading channel j to depth t (t = 0..4),
for the G query heads of one KV group: ``sum_h q_j^2 e_j(t)`` (:func:`error_table`) with ``e_j(t) =
Var(k_j) 4^-t`` (Eq. 3's model, :func:`variance_errors`) or the variance of ``k_j - k_hat_j(t)`` the
store's own quantizer leaves on calibration keys (:func:`plane_errors`: block absmax scales make it about
twice Eq. 3's at t >= 1 on SmolLM2, by a factor that varies 4x between channels). Minimize
``sum_j E[j, t_j]`` subject to ``sum_j c(t_j) <= B``:

* :func:`plan_bits_exact`: the exact integer optimum, by dynamic programming over channels in quarter bits
  (every cost is a multiple of 1/4);
* :func:`plan_bits_bisection`: its Lagrangian form, the water line. At multiplier ``lambda`` channel j
  reads ``argmin_t E[j, t] + lambda c(t)``, which is depth >= t exactly when ``lambda <= lambda*_t =
  max_{s >= t} min_{u < t} (E[j, u] - E[j, s]) / (c(s) - c(u))`` (the lower convex hull of the channel's
  (cost, error) points; for a convex table, the gain per bit of plane t). Bisection on ``log lambda`` with
  the planes priced ``(1.25, 1, 1, 1)`` (:mod:`pallas_kernels.water_line`). Each plan it returns is optimal
  among all plans costing no more than it does (the Lagrangian property); it may leave up to about one plane
  of the budget unspent where the exact plan does not.

With zero scale cost and Eq. 3's table the hull thresholds are the paper's ``log g_j - (t + 1/2) log 4`` up
to one constant, i.e. the same water-filling.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from fathom_jax import format as fmt
from fathom_jax import planner as planner_lib
from fathom_jax import store as store_lib
from fathom_jax.checks import fail_if, is_traced
from fathom_jax.format import N_PLANES
from pallas_kernels import backend
from pallas_kernels import water_line as water_line_lib

DEPTHS = N_PLANES + 1  # depths 0..4
QUARTERS = tuple(4 * t + (t > 0) * int(4 * fmt.SCALE_BITS_PER_TOKEN) for t in range(DEPTHS))  # c(t) in 1/4 bits
PLANE_COST = tuple((QUARTERS[t + 1] - QUARTERS[t]) / 4 for t in range(N_PLANES))  # (1.25, 1, 1, 1)
PLANNERS = ("bisection", "exact")


def depth_bits() -> np.ndarray:
    """``c(t)``, bits per token of one channel read to depth t = 0..4: ``t + 1/4`` for t > 0 (code + scale)."""
    return np.asarray(QUARTERS, np.float32) / 4


def max_bits(head_dim: int) -> float:
    """Bits per token of every channel at full depth (the largest budget that means anything)."""
    return QUARTERS[-1] * head_dim / 4


def variance_errors(variance: Float[Array, "*G D"]) -> Float[Array, "*G D 5"]:
    """Eq. 3's model: ``Var(k_j) 4^-t`` left at depth t."""
    return jnp.asarray(variance, jnp.float32)[..., None] * (0.25 ** jnp.arange(DEPTHS, dtype=jnp.float32))


def error_table(q: Float[Array, "*G H D"], errors: Float[Array, "*G D 5"]) -> Float[Array, "*G D 5"]:
    """``E[j, t] = sum_h q_j^2 e_j(t)`` over the query heads of the group (axis -2 of ``q``)."""
    q = jnp.asarray(q, jnp.float32)
    return jnp.sum(q * q, axis=-2)[..., None] * jnp.asarray(errors, jnp.float32)


def plane_errors(keys: Float[Array, "*B n D"], *, skip_tokens: int = 16) -> Float[Array, "*B D 5"]:
    """Variance over tokens of ``k_j - k_hat_j(t)`` for t = 0..4 as the store quantizes ``keys`` (its 64-token
    blocks and fp16 absmax scales; ``k_hat(0) = 0``, so t = 0 is ``Var(k_j)``), leaving out the first
    ``skip_tokens`` tokens (the sinks' outlier keys) as :func:`~fathom_jax.calibrate.calibrate` does.

    Variance, not mean square: a constant error shifts every score of a query alike and changes no ranking.
    """
    keys = jnp.asarray(keys, jnp.float32)
    n = keys.shape[-2]
    if n - skip_tokens < 2:
        raise ValueError(f"keys: need at least skip_tokens + 2 = {skip_tokens + 2} tokens, got n = {n}")
    return _plane_errors(keys, skip_tokens)


@functools.partial(jax.jit, static_argnums=1)  # one program: eagerly, the store's build ran op by op (8x the CPU)
def _plane_errors(keys, skip_tokens: int):
    n = keys.shape[-2]
    store = store_lib.build_store(keys)
    errors = [keys] + [keys - store_lib.dequantize(store, t)[..., :n, :] for t in range(1, DEPTHS)]
    return jnp.stack([jnp.var(e[..., skip_tokens:, :], axis=-2) for e in errors], axis=-1)


def _check_table(table) -> jax.Array:
    table = jnp.asarray(table, jnp.float32)
    if table.ndim < 2 or table.shape[-1] != DEPTHS:
        raise ValueError(f"error table must be [..., D, {DEPTHS}] (error left at depths 0..4), got shape {table.shape}")
    if not is_traced(table):
        arr = np.asarray(table)
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise ValueError("error table must be finite and non-negative (squared query weights x error variances)")
    return table


def _check_budget(budget, d: int) -> jax.Array:
    """Budgets in [0, 4.25 D] bits as read: eagerly, or at run time when traced (a host call only on failure)."""
    top = max_bits(d)
    b = jnp.asarray(budget, jnp.float32) if is_traced(budget) else np.asarray(budget, np.float64)
    bad = ~((b >= 0) & (b <= top))  # NaN fails both comparisons
    fail_if(bad, lambda got: f"budget must lie in [0, {top:g}] bits per token as read (4.25 x D at D = {d}), got "
                             f"{got[~((got >= 0) & (got <= top))].ravel()[:4].tolist()}", b)
    return jnp.asarray(budget, jnp.float32)


def hull_thresholds(table: Float[Array, "*G D 5"]) -> Float[Array, "*G 4 D"]:
    """``log lambda*_t`` for t = 1..4 (rows 0..3): channel j reads depth >= t at log multiplier x iff
    ``x <= thresholds[t - 1, j]``; NaN where no multiplier makes plane t worth its bits (no error removed)."""
    table = jnp.asarray(table, jnp.float32)
    cost = jnp.asarray(depth_bits())
    gain = table[..., :, None] - table[..., None, :]  # [.., D, u, s]: error removed going from u to s
    span = cost[None, :] - cost[:, None]  # [u, s]
    rate = jnp.where(span > 0, gain / jnp.where(span > 0, span, 1.0), jnp.inf)
    lows = []
    for t in range(1, DEPTHS):
        worst_start = jnp.min(rate[..., :t, t:], axis=-2)  # [.., D, s >= t]: min over u < t
        lows.append(jnp.max(worst_start, axis=-1))
    best = jnp.stack(lows, axis=-2)  # [.., 4, D]
    return jnp.where(best > 0, jnp.log(jnp.where(best > 0, best, 1.0)), jnp.nan)


def _bracket(thresholds):
    """A log multiplier above every threshold (nothing read) and one below them all (everything read)."""
    finite = jnp.isfinite(thresholds)
    top = jnp.max(jnp.where(finite, thresholds, -jnp.inf), axis=(-2, -1))
    bottom = jnp.min(jnp.where(finite, thresholds, jnp.inf), axis=(-2, -1))
    none = ~jnp.isfinite(top)
    return jnp.where(none, 0.0, bottom - 1.0), jnp.where(none, 1.0, top + 1.0)


def plan_bits_bisection(
    table: Float[Array, "*G D 5"],
    budget: Float[Array, "*G"] | float,
    *,
    steps: int = planner_lib.BISECTION_STEPS,
    implementation: backend.Implementation | None = None,
) -> planner_lib.ReadPlan:
    """The water line with the scale in it: ``steps`` bisection steps on the log multiplier, bits as read
    ``<= budget``. ``theta`` is the final multiplier (error removed per bit at the line)."""
    table = _check_table(table)
    batch, d = table.shape[:-2], table.shape[-2]
    budget = jnp.broadcast_to(_check_budget(budget, d), batch)
    thresholds = hull_thresholds(table)
    log_lo, log_hi = _bracket(thresholds)
    n = math.prod(batch)
    depths, log_hi = water_line_lib.water_line(
        jnp.moveaxis(thresholds.reshape(n, N_PLANES, d), 1, 0), budget.reshape(n), (log_lo.reshape(n), log_hi.reshape(n)),
        spec=water_line_lib.WaterLineSpec(steps, PLANE_COST), implementation=implementation)
    return planner_lib.make_plan(depths.reshape(*batch, d), jnp.exp(log_hi).reshape(batch))


def plan_bits_exact(table: Float[Array, "*G D 5"], budget: Float[Array, "*G"] | float) -> planner_lib.ReadPlan:
    """The exact optimum: ``min sum_j E[j, t_j]`` subject to ``sum_j c(t_j) <= budget``, by dynamic programming
    over the channels in quarter bits (``value[b]``: the most error removed within ``b`` quarters by the channels
    so far), then back through the choices. Ties go to the shallower depth. ``theta``: the smallest gain per
    bit of a last plane read. ``O(D B)`` work per group (a ``4 B + 1`` budget axis, ``17 D + 1`` for traced budgets):
    an offline or study tool.
    """
    table = _check_table(table)
    batch, d = table.shape[:-2], table.shape[-2]
    quarters = jnp.floor(4 * jnp.broadcast_to(_check_budget(budget, d), batch)).astype(jnp.int32)
    top = QUARTERS[-1] * d
    if not is_traced(budget):  # a known budget bounds the table: 4 B + 1 quarters instead of 17 D + 1
        top = min(top, int(np.floor(4 * np.max(np.asarray(budget, np.float64)))))
    n, size = math.prod(batch), top + 1
    gains = jnp.moveaxis((table[..., :1] - table).reshape(n, d, DEPTHS), 1, 0)  # [D, n, 5]

    def add_channel(value, gain):  # value [n, size]
        shifted = [jnp.pad(value, ((0, 0), (q, 0)), constant_values=-jnp.inf)[:, :size] + gain[:, t, None]
                   for t, q in enumerate(QUARTERS)]
        options = jnp.stack(shifted)
        return jnp.max(options, axis=0), jnp.argmax(options, axis=0).astype(jnp.int8)

    _, choices = jax.lax.scan(add_channel, jnp.zeros((n, size), jnp.float32), gains)  # [D, n, size]
    cost = jnp.asarray(QUARTERS, jnp.int32)

    def back(left, choice):
        depth = jnp.take_along_axis(choice, left[:, None], axis=1)[:, 0].astype(jnp.int32)
        return left - cost[depth], depth

    _, depths = jax.lax.scan(back, jnp.clip(quarters.reshape(n), 0, size - 1), choices, reverse=True)
    depths = jnp.moveaxis(depths, 0, 1).reshape(*batch, d)
    flat = table.reshape(*batch, d, DEPTHS)
    prev = jnp.take_along_axis(flat, jnp.maximum(depths - 1, 0)[..., None], axis=-1)[..., 0]
    last = jnp.take_along_axis(flat, depths[..., None], axis=-1)[..., 0]
    rate = (prev - last) / jnp.where(depths == 1, PLANE_COST[0], 1.0)
    smallest = jnp.min(jnp.where(depths > 0, rate, jnp.inf), axis=-1)
    return planner_lib.make_plan(depths, jnp.where(jnp.isfinite(smallest), smallest, 0.0))


def plan_bits(
    table: Float[Array, "*G D 5"],
    budget: Float[Array, "*G"] | float,
    *,
    method: str = "bisection",
    implementation: backend.Implementation | None = None,
) -> planner_lib.ReadPlan:
    """Depths within ``budget`` bits as read, by ``method`` = ``"bisection"`` or ``"exact"``."""
    if method == "bisection":
        return plan_bits_bisection(table, budget, implementation=implementation)
    if method == "exact":
        return plan_bits_exact(table, budget)
    raise ValueError(f"method must be one of {PLANNERS}, got {method!r}")


def plan_error(table: Float[Array, "*G D 5"], depths) -> Float[Array, "*G"]:
    """The model's error of a plan: ``sum_j E[j, t_j]``."""
    table = jnp.asarray(table, jnp.float32)
    return jnp.sum(jnp.take_along_axis(table, jnp.asarray(depths, jnp.int32)[..., None], axis=-1)[..., 0], axis=-1)
