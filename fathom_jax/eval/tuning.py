"""Per-(layer, KV head) budgets in bits as read, tuned with optax on a calibration capture.

    tables = error_tables(calib_capture, tuned_calib, GRID)        # measured: attention error at every budget
    budgets, info = optimize_budgets(tables, target=55.0)           # optax: min error at a mean of 55 bits
    calib = cal.tuned(tuned_calib, budget=budgets)                  # fathom_tuned reads calib.budget
    cal.save_calibration("tuned_55", calib)                         # orbax, like every calibration

The objective is the measured attention-output error itself (the paper's metric at one k on the
calibration capture), as a function of each group's budget: :func:`error_tables` runs
``fathom_bits:B`` at every budget of a grid and keeps each (layer, KV head)'s mean error, and the
surrogate the optimizer differentiates is its piecewise-linear interpolation between grid budgets
(``jnp.interp``). :func:`optimize_budgets` keeps the mean budget over the model at the target exactly
(budgets ``lo + N (target - lo) softmax(x)``) and runs Adam on ``x``. How well the surrogate tracks the
error measured at the tuned budgets is :func:`surrogate_check`'s correlation, which the study records for
the evaluation text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Float

from fathom_jax import calibrate as cal
from fathom_jax.eval import fidelity as fid
from fathom_jax.methods import FathomBits, fathom_budgets

# Budgets (bits as read) the error is measured at, stated at D = 128 like the study's other budgets; GRID is
# SmolLM2's (D = 64): 8, 16, 26, 37, 55, 80, 120.
GRID_AT_128 = (16, 32, 52, 74, 110, 160, 240)
GRID = fathom_budgets(64, GRID_AT_128)
QUARTER = 0.25  # budgets are whole quarter bits (the planners' unit)


@dataclasses.dataclass(frozen=True)
class Tables:
    """Measured on a calibration capture: mean attention error ``[L, Hkv, len(grid)]`` of ``fathom_bits`` at
    each budget of ``grid`` (one k), and the bits per token it read there."""

    grid: tuple[float, ...]
    errors: np.ndarray
    bits: np.ndarray
    k: int


def spread_positions(n_tokens: int, count: int) -> np.ndarray:
    """``count`` positions evenly spaced over the second half of a window, ending at its last token: the
    calibration capture's tuning positions. Spread, they sample more of the text than its last ``count`` (which
    are one passage): on SmolLM2 at 8k, tables over 256 spread positions carried over to code far better than
    over the last 64."""
    stride = max(1, (n_tokens - n_tokens // 2) // count)
    return (n_tokens - 1 - stride * np.arange(count)[::-1]).astype(np.int32)


def grid_methods(grid: Sequence[int], planner: str = "bisection", importance: str = "observed") -> list[FathomBits]:
    return [FathomBits(int(b), planner, importance) for b in grid]


def grid_evaluations(calib, grid: Sequence[int], planner: str = "bisection", importance: str = "observed"):
    """The evaluations :func:`error_tables` runs (one per budget), to run together with other calibration rows."""
    return [fid.Evaluation(fid.method_score_fn(m), calib, f"tuning grid: {m.label}")
            for m in grid_methods(grid, planner, importance)]


def tables_from(measured, grid: Sequence[int], k: int, k_index: int = 0) -> Tables:
    """:class:`Tables` from :func:`~fathom_jax.eval.fidelity.attention_errors_many`'s results of
    :func:`grid_evaluations` (errors ``[K, L, P, Hkv, G]``, bits ``[L, P, Hkv]``)."""
    errors = np.stack([err[k_index].mean(axis=(1, 3)) for err, _ in measured], axis=-1)  # [L, Hkv, grid]
    bits = np.stack([b.mean(axis=1) for _, b in measured], axis=-1)
    return Tables(tuple(float(b) for b in grid), errors, bits, k)


def error_tables(capture: fid.Capture, calib: cal.TunedCalibration, grid: Sequence[int] = GRID, *, k: int = 128,
                 positions: int | np.ndarray = 64, references: fid.References | None = None,
                 progress: bool | Any = False) -> Tables:
    """Each (layer, KV head)'s attention error at every budget of ``grid`` (:func:`grid_evaluations`' plans) on
    ``capture`` at ``positions`` (a count: the last ones; or the positions), selection size ``k``."""
    pos = (fid.default_positions(capture.q.shape[2], positions) if np.ndim(positions) == 0
           else np.asarray(positions, np.int32))
    measured = fid.attention_errors_many(grid_evaluations(calib, grid), capture, (k,),
                                         positions=pos, references=references, progress=progress)
    return tables_from(measured, grid, k)


def surrogate(budgets: Float[jax.Array, "L Hkv"], grid, errors) -> Float[jax.Array, "L Hkv"]:
    """The interpolated error of every group at ``budgets`` (flat beyond the grid's ends)."""
    interp = jax.vmap(jnp.interp, in_axes=(0, None, 0))
    flat = interp(budgets.reshape(-1), jnp.asarray(grid, jnp.float32), errors.reshape(-1, errors.shape[-1]))
    return flat.reshape(budgets.shape)


def _check_target(tables: Tables, target: float, floor: float) -> None:
    lo, hi = tables.grid[0], tables.grid[-1]
    if not lo <= floor < target <= hi:
        raise ValueError(f"target must lie in ({floor}, {hi}] bits (the grid spans [{lo}, {hi}], floor {floor}), "
                         f"got {target}")


def optimize_budgets(tables: Tables, target: float, *, floor: float | None = None, steps: int = 400,
                     learning_rate: float = 0.1) -> tuple[np.ndarray, dict]:
    """Budgets ``[L, Hkv]`` (whole quarter bits, at least ``floor``, default the grid's first budget) whose
    mean is ``target`` (to within a quarter bit, never above), minimizing the summed interpolated error.

    Adam on ``x``, budgets ``floor + N (target - floor) softmax(x)``: the mean is the target at every step.
    The continuous optimum is rounded down to quarter bits, and the quarters that frees go back one at a
    time to the groups whose interpolated error drops most for them. Returns the budgets and what the
    optimizer saw (objective at the start, the end, after rounding).
    """
    floor = tables.grid[0] if floor is None else float(floor)
    _check_target(tables, target, floor)
    errors = jnp.asarray(tables.errors, jnp.float32)
    shape, n = errors.shape[:2], int(np.prod(errors.shape[:2]))
    scale = float(jnp.sum(surrogate(jnp.full(shape, target, jnp.float32), tables.grid, errors)))
    spread = n * (target - floor)

    def budgets_of(x):
        return floor + spread * jax.nn.softmax(x.reshape(-1)).reshape(shape)

    def loss(x):
        return jnp.sum(surrogate(budgets_of(x), tables.grid, errors)) / scale

    opt = optax.adam(learning_rate)

    @jax.jit
    def run(x):
        def step(carry, _):
            x, state = carry
            value, grad = jax.value_and_grad(loss)(x)
            updates, state = opt.update(grad, state, x)
            return (optax.apply_updates(x, updates), state), value
        (x, _), trace = jax.lax.scan(step, (x, opt.init(x)), None, length=steps)
        return x, trace

    x, trace = run(jnp.zeros(shape, jnp.float32))
    budgets = _round_down(np.asarray(budgets_of(x), np.float64), target, tables)
    final = float(jnp.sum(surrogate(jnp.asarray(budgets, jnp.float32), tables.grid, errors)) / scale)
    return budgets, {"target": target, "floor": floor, "steps": steps, "learning_rate": learning_rate,
                     "objective_start": float(trace[0]), "objective_end": float(trace[-1]), "objective_rounded": final}


def _round_down(budgets: np.ndarray, target: float, tables: Tables) -> np.ndarray:
    """Quarter-bit budgets with mean <= target: rounded down, then the freed quarters one at a time to the
    group whose interpolated error falls most for one more quarter."""
    out = np.floor(budgets / QUARTER) * QUARTER
    spare = int(round((target * out.size - out.sum()) / QUARTER))
    grid, errors = np.asarray(tables.grid), tables.errors
    for _ in range(max(spare, 0)):
        now = np.vectorize(lambda b, l, h: np.interp(b, grid, errors[l, h]))
        l_idx, h_idx = np.indices(out.shape)
        drop = now(out, l_idx, h_idx) - now(out + QUARTER, l_idx, h_idx)
        l, h = np.unravel_index(np.argmax(drop), out.shape)
        out[l, h] += QUARTER
    return out


def surrogate_check(tables: Tables, budgets: np.ndarray, target: float, measured: np.ndarray,
                    measured_uniform: np.ndarray) -> dict:
    """How the surrogate tracks the error measured at the tuned budgets ``[L, Hkv]`` (wherever it is measured:
    the study measures on the evaluation text, which the tables never saw).

    ``measured`` is each group's error at its tuned budget, ``measured_uniform`` at the uniform budget
    ``target``. Returns the Pearson correlation of predicted and measured errors over groups (``pearson``:
    mostly how much the groups' errors differ), and of the *changes* the tuning makes, predicted
    ``surrogate(b) - surrogate(target)`` against measured ``measured - measured_uniform`` (``pearson_change``:
    whether the surrogate knows which groups gain and lose), with the mean change of each.
    """
    errors = jnp.asarray(tables.errors)
    predicted = np.asarray(surrogate(jnp.asarray(budgets, jnp.float32), tables.grid, errors))
    base = np.asarray(surrogate(jnp.full(budgets.shape, target, jnp.float32), tables.grid, errors))
    change, measured_change = predicted - base, measured - measured_uniform
    return {"pearson": float(np.corrcoef(predicted.ravel(), measured.ravel())[0, 1]),
            "pearson_change": float(np.corrcoef(change.ravel(), measured_change.ravel())[0, 1]),
            "predicted_change": float(change.mean()), "measured_change": float(measured_change.mean()),
            "predicted_mean": float(predicted.mean()), "measured_mean": float(measured.mean())}


def tune_calibration(capture: fid.Capture, means: Sequence[float], *, grid: Sequence[int] = GRID, k: int = 128,
                     positions: int = 128, progress: bool | Any = False) -> tuple[dict[float, cal.TunedCalibration], Tables]:
    """The whole tuning from one calibration capture: corpus statistics, the plane errors of its keys, the
    error tables at ``grid`` (at ``positions`` positions spread over its second half, :func:`spread_positions`;
    selection size ``k``) and, for every mean of
    ``means``, a :class:`~fathom_jax.calibrate.TunedCalibration` with the tuned budgets (``fathom_tuned:observed``
    reads it; :func:`~fathom_jax.calibrate.save_calibration` writes it)."""
    from fathom_jax import allocation

    observed = cal.tuned(cal.calibrate(capture.k, capture.q),
                         plane_error=allocation.plane_errors(capture.k, skip_tokens=cal.SKIP_TOKENS))
    pos = spread_positions(capture.q.shape[2], positions)
    tables = error_tables(capture, observed, grid, k=k, positions=pos, progress=progress)
    return {mean: cal.tuned(observed, budget=optimize_budgets(tables, float(mean))[0]) for mean in means}, tables
