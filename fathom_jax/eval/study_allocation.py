"""The study's allocation rows: budgets in bits as read, observed error models, budgets tuned per (layer,
KV head) on the calibration capture.

* ``fathom_bits:B`` (Eq. 3's errors, the scale priced in the plan) and ``fathom_bits:B:observed`` (the
  calibration keys' own quantization errors), at budgets just under flat Fathom's bits as read;
* ``fathom_bits:B:exact:observed``: the exact integer optimum of the same model;
* ``fathom_tuned:observed`` at mean budgets: each (layer, KV head)'s budget chosen by
  :func:`~fathom_jax.eval.tuning.optimize_budgets` from the attention error measured on the calibration
  capture at a grid of budgets (:func:`~fathom_jax.eval.tuning.error_tables`, positions spread over its
  second half), and how the surrogate tracks the error measured on the evaluation text at the tuned budgets
  (against ``fathom_bits:MEAN:observed``, the same plan at the uniform budget);
* the same tuned on the session (paper B5's protocol for statistics, here for budgets): the tables measured
  on the evaluation window's own positions just before the evaluated ones (the prompt a decode would start
  from; no evaluated position or later key enters).

Every row reads a calibration state by key (:data:`OBSERVED`, :func:`tuned_state`): the corpus
statistics with the plane errors (and the budgets tuned on the calibration capture or the session).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import allocation
from fathom_jax import calibrate as cal
from fathom_jax.eval import tuning
from fathom_jax.methods import FathomBits, FathomTuned

OBSERVED = "observed"  # the state key of the corpus calibration with plane errors
FAMILIES = ("Fathom bits as read", "Fathom observed errors", "Fathom observed, exact plan", "Fathom tuned",
            "Fathom session-tuned")
SOURCES = ("calibration", "session")  # where budgets are tuned: the calibration capture, the evaluated window's prompt


def tuned_state(mean: float, source: str = "calibration") -> str:
    return f"tuned {mean:g}" if source == "calibration" else f"tuned {mean:g} ({source})"


def tuned_means(config, source: str) -> tuple[int, ...]:
    return config.tuned_means if source == "calibration" else config.session_tuned_means


def fixed_rows(head_dim: int, config, row_type) -> list:
    """The ``fathom_bits`` rows of ``config`` (budgets above ``4.25 D`` left out)."""
    cap = allocation.max_bits(head_dim)
    specs = [(b, "bisection", "variance", FAMILIES[0]) for b in config.bits_budgets]
    specs += [(b, "bisection", "observed", FAMILIES[1]) for b in config.observed_budgets]
    specs += [(b, "exact", "observed", FAMILIES[2]) for b in config.exact_bits_budgets]
    rows = []
    for budget, planner, importance, family in specs:
        if budget <= cap:
            m = FathomBits(budget, planner, importance)
            rows.append(row_type(m.label, family, m, "corpus", state="corpus" if importance == "variance" else OBSERVED))
    return rows


def tuned_rows(config, row_type) -> list:
    m = FathomTuned(importance="observed")
    rows = [row_type(f"Fathom tuned, mean {mean:g} bits (per layer and KV head)", FAMILIES[3], m, "corpus",
                     state=tuned_state(mean)) for mean in config.tuned_means]
    return rows + [row_type(f"Fathom tuned on the session, mean {mean:g} bits", FAMILIES[4], m, "session",
                            state=tuned_state(mean, "session")) for mean in config.session_tuned_means]


def grid_budgets(head_dim: int, config) -> tuple[int, ...]:
    cap = allocation.max_bits(head_dim)
    return tuple(b for b in config.tuning_grid if b <= cap)


def state_shapes(calib, n_layers: int, n_kv: int, head_dim: int, config) -> dict[str, Any]:
    """Shape structs of the states the rows read (for compiling ahead), from the corpus calibration's."""
    f32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32)  # noqa: E731
    fields = {f.name: getattr(calib, f.name) for f in dataclasses.fields(cal.Calibration)}
    observed = cal.TunedCalibration(**fields, plane_error=f32(n_layers, n_kv, head_dim, allocation.DEPTHS))
    tuned = dataclasses.replace(observed, budget=f32(n_layers, n_kv))
    return {OBSERVED: observed, **{tuned_state(m, src): tuned for src in SOURCES for m in tuned_means(config, src)}}


def observed_state(corpus: cal.Calibration, plane_error) -> cal.TunedCalibration:
    return cal.tuned(corpus, plane_error=plane_error)


def needs_tuning(config) -> bool:
    return bool(config.tuned_means or config.session_tuned_means)


def session_positions(first_evaluated: int, count: int) -> np.ndarray:
    """The ``count`` positions just before the first evaluated one: the session's tuning positions."""
    if first_evaluated < count + 2:
        raise ValueError(f"session tuning needs {count} positions before the first evaluated one "
                         f"({first_evaluated}); evaluate fewer positions or tune on fewer")
    return np.arange(first_evaluated - count, first_evaluated, dtype=np.int32)


def tune(observed: cal.TunedCalibration, tables: tuning.Tables, means: Sequence[int], source: str) -> tuple[dict, dict]:
    """Budgets for every mean of ``means`` from ``tables``: the states the tuned rows read, and what the optimizer
    did (``{mean: {"budgets", "optimizer"}}``)."""
    states, report = {}, {}
    for mean in means:
        budgets, info = tuning.optimize_budgets(tables, float(mean))
        states[tuned_state(mean, source)] = cal.tuned(observed, budget=budgets)
        report[f"{mean:g}"] = {"budgets": budgets.tolist(), "optimizer": info}
    return states, report


def check_surrogates(report: dict, tables: dict, rows: Sequence, measured: Sequence, k_index: int = 0) -> None:
    """Add to every tuned mean of ``report`` (``{source: {"means": ...}}``) :func:`~fathom_jax.eval.tuning.
    surrogate_check` on the evaluation text: the tuned row's errors per (layer, KV head) against the uniform
    row's at the same mean (``fathom_bits:MEAN:observed``), where the study has that row."""
    by_state = {row.state: err for row, (err, _) in zip(rows, measured) if row.state}
    uniform = {row.method.budget: err for row, (err, _) in zip(rows, measured)
               if isinstance(row.method, FathomBits) and not isinstance(row.method, FathomTuned)
               and row.method.importance == "observed" and row.method.planner == "bisection"}
    for source, entry in report.items():
        for mean, tuned in entry["means"].items():
            err, flat = by_state.get(tuned_state(float(mean), source)), uniform.get(int(float(mean)))
            if err is None or flat is None:
                continue
            per_group = lambda e: e[k_index].mean(axis=(1, 3))  # noqa: E731  [K, L, P, Hkv, G] -> [L, Hkv]
            tuned["surrogate"] = tuning.surrogate_check(tables[source], np.asarray(tuned["budgets"]), float(mean),
                                                        per_group(err), per_group(flat))


def tables_report(tables: tuning.Tables) -> dict:
    return {"grid": list(tables.grid), "k": tables.k, "errors": np.round(tables.errors, 6).tolist(),
            "bits": np.round(tables.bits, 4).tolist()}
