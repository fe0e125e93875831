"""The error-versus-bits study: every scan method on one captured window, under one protocol.

Calibrate on one text, evaluate on a disjoint one. For each method: mean relative L2 error of the
attention output (sink 4 + local 32 + top-(k - 36) per query head, against dense attention) over the
last ``positions`` decode positions of the evaluation window, every layer and head, at several k, and
the bits per token it read. Rows:

* Fathom (raw planes) at flat budgets, the KLT store at a subset, the per-layer plan (section 3.3,
  calibrated on the calibration capture), session calibration (statistics from the evaluation
  window's own prefill keys, paper B5), and the exact integer planner for comparison;
* every baseline at the paper's settings as fractions of D (SparQ r = D/8, D/4 and the per-head
  union, Double Sparsity c = D/4, Loki r = D/4, D/2, the 2-bit thumbnail, the 8-token landmark, the
  full 4-bit scan) and the exact top-k oracle, whose own error is the floor every scan sits on.

The results are plain JSON; :func:`render_markdown` and :func:`plot` rebuild the table and figure
from it, so every number in a report can be traced to the file.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from fathom_jax import calibrate as cal
from fathom_jax import planner as planner_lib
from fathom_jax.eval import fidelity as fid
from fathom_jax.eval.report import headline, plot, render_markdown, write_report  # noqa: F401  (re-exported)
from fathom_jax.methods import (
    DoubleSparsity,
    Exact,
    Fathom,
    FathomKLT,
    Full4,
    Landmark,
    Loki,
    ScanMethod,
    SparQ,
    SparQUnion,
    Thumbnail,
)

DEFAULT_BUDGETS = (16, 24, 28, 32, 40, 48, 64, 80, 128)
DEFAULT_KLT_BUDGETS = (16, 32, 48, 64)
LAYER_PLAN_GRID = (16, 24, 32, 40, 48, 64, 80, 96, 128)


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    context: int = 4096
    ks: tuple[int, ...] = ()  # default: 128, 256 and 2% of the context
    positions: int = 128
    calib_positions: int = 64
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    klt_budgets: tuple[int, ...] = DEFAULT_KLT_BUDGETS
    layer_plan_means: tuple[int, ...] = (48, 64)
    layer_plan_grid: tuple[int, ...] = LAYER_PLAN_GRID
    session_budgets: tuple[int, ...] = (32, 48)
    exact_planner_budgets: tuple[int, ...] = (32, 48)

    def selection_sizes(self) -> tuple[int, ...]:
        if self.ks:
            return tuple(self.ks)
        return (128, 256, max(40, round(0.02 * self.context)))


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the study: a method, the calibration it uses, and per-layer budgets if any."""

    name: str
    family: str
    method: ScanMethod | None  # None: per-layer plan (methods per layer)
    calibration: str = "corpus"  # "corpus" | "session" | "none"
    layer_budgets: tuple[int, ...] | None = None


def _describe(bar: Any, text: str) -> None:
    """Name the evaluation an overall progress bar is on (no-op without one)."""
    if bar and bar is not True:
        bar.set_postfix_str(text, refresh=False)


def baseline_rows(head_dim: int) -> list[Row]:
    d = head_dim
    methods = [
        ("SparQ", SparQ(d // 8)),
        ("SparQ", SparQ(d // 4)),
        ("SparQ union", SparQUnion(d // 8)),
        ("Double Sparsity", DoubleSparsity(d // 4)),
        ("Loki", Loki(d // 4)),
        ("Loki", Loki(d // 2)),
        ("thumbnail", Thumbnail(2)),
        ("landmark", Landmark()),
        ("full 4-bit", Full4()),
        ("oracle", Exact()),
    ]
    return [Row(m.label, fam, m, "corpus" if m.needs_calibration else "none") for fam, m in methods]


def fathom_rows(head_dim: int, config: StudyConfig) -> list[Row]:
    cap = 4 * head_dim
    rows = [Row(Fathom(b).label, "Fathom", Fathom(b)) for b in config.budgets if b <= cap]
    rows += [Row(FathomKLT(b).label, "Fathom KLT", FathomKLT(b)) for b in config.klt_budgets if b <= cap]
    rows += [
        Row(f"Fathom {b} (session calib)", "Fathom session", Fathom(b), "session")
        for b in config.session_budgets if b <= cap
    ]
    rows += [
        Row(f"Fathom KLT {b} (session calib)", "Fathom KLT session", FathomKLT(b), "session")
        for b in config.session_budgets if b <= cap
    ]
    rows += [
        Row(Fathom(b, planner="exact").label, "Fathom exact plan", Fathom(b, planner="exact"))
        for b in config.exact_planner_budgets if b <= cap
    ]
    return rows


def layer_error_table(
    capture: fid.Capture, calib: cal.Calibration, grid: Sequence[int], k: int, positions: int,
    progress: bool | Any = False, references: fid.References | None = None,
) -> np.ndarray:
    """Per-layer mean error of Fathom (raw) at each budget of ``grid`` on the calibration capture."""
    pos = fid.default_positions(capture.q.shape[2], positions)
    table = []
    for b in grid:
        _describe(progress, f"layer plan: Fathom {b}")
        err, _ = fid.attention_errors(
            fid.method_score_fn(Fathom(b)), capture, k, positions=pos, layer_states=calib,
            progress=progress, desc=f"layer plan: Fathom {b}", references=references,
        )
        table.append(err.mean(axis=(1, 2, 3)))  # [L]
    return np.stack(table, axis=1)  # [L, len(grid)]


def choose_basis(
    capture: fid.Capture, calib: cal.Calibration, *, budgets: Sequence[int] = (48, 64), k: int = 128,
    positions: int = 64, progress: bool | Any = False, known: dict[tuple[str, int], float] | None = None,
    references: fid.References | None = None,
) -> dict[str, Any]:
    """The basis rule of section 3.5: evaluate raw and KLT planes on calibration text, keep the better.

    Returns ``{"basis": "raw" | "klt", "raw": [errors], "klt": [errors], "budgets": [...]}`` where
    the choice is by mean error over ``budgets``. ``known[(basis, budget)]`` supplies errors already
    measured under the same protocol (e.g. from :func:`layer_error_table`) instead of re-running them.
    """
    pos = fid.default_positions(capture.q.shape[2], positions)
    known = known or {}
    out: dict[str, Any] = {"budgets": list(budgets), "k": k}
    for name, make in (("raw", Fathom), ("klt", FathomKLT)):
        errs = []
        for b in budgets:
            if (name, b) in known:
                errs.append(known[(name, b)])
                continue
            _describe(progress, f"basis rule: {make(b).label}")
            e, _ = fid.mean_attention_error(
                fid.method_score_fn(make(b)), capture, k, positions=pos, layer_states=calib,
                progress=progress, desc=f"basis rule: {make(b).label}", references=references,
            )
            errs.append(e)
        out[name] = errs
    out["basis"] = "klt" if np.mean(out["klt"]) < np.mean(out["raw"]) else "raw"
    return out


def run_study(
    eval_capture: fid.Capture,
    calib_capture: fid.Capture,
    config: StudyConfig = StudyConfig(),
    *,
    meta: dict | None = None,
    progress: bool = True,
    rows: Sequence[Row] | None = None,
) -> dict[str, Any]:
    """Run every row on ``eval_capture`` (calibrated on ``calib_capture``) and return the results dict."""
    n_layers, _, n_tokens, d = eval_capture.q.shape
    ks = config.selection_sizes()
    positions = fid.default_positions(n_tokens, config.positions)
    prefill = int(positions[0])  # the session's own keys: everything before the first decode position
    corpus = cal.calibrate(calib_capture.k, calib_capture.q)
    session = cal.calibrate_session(eval_capture.k[:, :, :prefill])
    calibs = {"corpus": corpus, "session": session, "none": None}

    default_rows = rows is None
    rows = fathom_rows(d, config) + baseline_rows(d) if default_rows else list(rows)
    with_plans = default_rows and bool(config.layer_plan_means)
    basis_budgets = (48, 64)
    # One bar over every (evaluation, layer) of the study, so progress shows from the first minute.
    calls = len(rows) + len(config.layer_plan_means) * with_plans
    if default_rows:
        known = set(config.layer_plan_grid) if with_plans else set()
        calls += len(config.layer_plan_grid) * with_plans + sum(b not in known for b in basis_budgets) + len(basis_budgets)
    bar = False
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=calls * n_layers, desc=f"study @ {n_tokens} tokens", unit="layer", smoothing=0.05)
    # Dense attention is every row's target: computed once per capture.
    eval_refs = fid.dense_references(eval_capture, positions)
    calib_refs = None
    if default_rows:
        calib_refs = fid.dense_references(calib_capture, fid.default_positions(calib_capture.q.shape[2],
                                                                              config.calib_positions))
    layer_plans = {}
    basis_rule = table = None
    if with_plans:
        table = layer_error_table(calib_capture, corpus, config.layer_plan_grid, ks[0], config.calib_positions, bar,
                                  references=calib_refs)
        for mean in config.layer_plan_means:
            budgets = planner_lib.greedy_layer_budgets(table, np.asarray(config.layer_plan_grid), mean)
            layer_plans[mean] = [int(b) for b in budgets]
            rows.append(Row(f"Fathom per-layer {mean}", "Fathom per-layer", None, "corpus", tuple(layer_plans[mean])))

    if default_rows:
        # The layer-plan table already holds raw Fathom on the calibration capture (same k and positions).
        known = {} if table is None else {("raw", b): float(table[:, i].mean()) for i, b in enumerate(config.layer_plan_grid)}
        basis_rule = choose_basis(calib_capture, corpus, budgets=basis_budgets, k=ks[0],
                                  positions=config.calib_positions, progress=bar, known=known, references=calib_refs)

    results = []
    for row in rows:
        _describe(bar, row.name)
        if row.layer_budgets is not None:
            fns = [fid.method_score_fn(Fathom(b)) for b in row.layer_budgets]
        else:
            fns = fid.method_score_fn(row.method)
        err, bits = fid.attention_errors(
            fns, eval_capture, ks, positions=positions, layer_states=calibs[row.calibration],
            progress=bar, desc=row.name, references=eval_refs,
        )
        results.append({
            "name": row.name,
            "family": row.family,
            "kind": "fathom" if row.method is None else row.method.kind,
            "calibration": row.calibration,
            "layer_budgets": list(row.layer_budgets) if row.layer_budgets else None,
            "bits": float(bits.mean()),
            "error": {str(k): float(err[i].mean()) for i, k in enumerate(ks)},
            "error_per_layer": {str(k): err[i].mean(axis=(1, 2, 3)).tolist() for i, k in enumerate(ks)},
        })
    if bar:
        bar.close()
    oracle = next((r for r in results if r["kind"] == "exact"), None)
    for r in results:
        if oracle is not None:
            r["excess"] = {k: r["error"][k] - oracle["error"][k] for k in r["error"]}

    return {
        "meta": {
            **(meta or {}),
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.node()} ({platform.machine()}, {jax.devices()[0].platform})",
            "jax": jax.__version__,
            "layers": n_layers,
            "head_dim": d,
            "context": n_tokens,
            "ks": list(ks),
            "positions": config.positions,
            "config": dataclasses.asdict(config),
        },
        "layer_plans": {str(m): b for m, b in layer_plans.items()},
        "basis_rule": basis_rule,
        "rows": results,
    }


