"""The error-versus-bits study: every scan method on one captured window, under one protocol.

Calibrate on one text, evaluate on a disjoint one. For each method: mean relative L2 error of the
attention output (sink 4 + local 32 + top-(k - 36) per query head, against dense attention) over the
last ``positions`` decode positions of the evaluation window, every layer and head, at several k, and
the bits per token it read. Rows:

* Fathom (raw planes) at flat budgets, the KLT store at a subset, the per-layer plan (section 3.3,
  calibrated on the calibration capture), session calibration (statistics from the evaluation
  window's own prefill keys, paper B5), and the exact integer planner for comparison;
* allocations that know their costs (:mod:`~fathom_jax.eval.study_allocation`): budgets in bits as read,
  the calibration keys' observed quantization errors, budgets tuned per (layer, KV head) on the
  calibration capture with optax;
* every baseline at the paper's settings as fractions of D (SparQ r = D/8, D/4 and the per-head
  union, Double Sparsity c = D/4, Loki r = D/4, D/2, the 2-bit thumbnail, the 8-token landmark, Quest's
  page bounds at 16- and 8-token pages, the full 4-bit scan) and the exact top-k oracle, whose own error is
  the floor every scan sits on.

The results are plain JSON; :func:`render_markdown` and :func:`plot` rebuild the table and figure
from it, so every number in a report can be traced to the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import platform
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import allocation
from fathom_jax import calibrate as cal
from fathom_jax import planner as planner_lib
from fathom_jax.checks import reraise
from fathom_jax.eval import fidelity as fid
from fathom_jax.eval import study_allocation as alloc
from fathom_jax.eval import tuning
from fathom_jax.eval.fidelity_run import compiles_pending
from fathom_jax.eval.progress import Progress
from fathom_jax.eval.report import headline, plot, render_markdown, write_report  # noqa: F401  (re-exported)
from fathom_jax.methods import Fathom, FathomKLT, ScanMethod, SparQUnion, fathom_budgets, paper_methods

# The study's Fathom budgets, code bits per token at the paper's D = 128; a study at head_dim D runs them scaled to D
# as methods.fathom_budgets scales the paper's (D = 64, SmolLM2: 16 ... 128; D = 256, Gemma 3: 64 ... 512), so that
# they sit at the same fractions of D as the baselines' settings (SparQ r = D/8 and D/4, ...).
DEFAULT_BUDGETS = (32, 48, 56, 64, 80, 96, 128, 160, 256)
DEFAULT_KLT_BUDGETS = (32, 64, 96, 128)
LAYER_PLAN_MEANS = (96, 128)
LAYER_PLAN_GRID = (32, 48, 64, 80, 96, 128, 160, 192, 256)
SESSION_BUDGETS = (64, 96)
EXACT_PLANNER_BUDGETS = (64, 96)
BASIS_BUDGETS = (96, 128)  # the basis rule's budgets (section 3.5)
# The allocations beyond the paper's, in bits as read (code + scale) at D = 128: just under flat Fathom 64, 96 and
# 128's as-read bits (at SmolLM2's D = 64: 37, 55, 73 against flat Fathom 32, 48 and 64's 37.1, 55.2, 73.1).
BITS_BUDGETS = (74, 110)
OBSERVED_BUDGETS = (74, 110, 146)
EXACT_BITS_BUDGETS = (110,)
TUNED_MEANS = (74, 110)
_BUDGET_FIELDS = {"budgets": DEFAULT_BUDGETS, "klt_budgets": DEFAULT_KLT_BUDGETS, "layer_plan_means": LAYER_PLAN_MEANS,
                  "layer_plan_grid": LAYER_PLAN_GRID, "session_budgets": SESSION_BUDGETS,
                  "exact_planner_budgets": EXACT_PLANNER_BUDGETS, "basis_budgets": BASIS_BUDGETS,
                  "bits_budgets": BITS_BUDGETS, "observed_budgets": OBSERVED_BUDGETS,
                  "exact_bits_budgets": EXACT_BITS_BUDGETS, "tuned_means": TUNED_MEANS,
                  "session_tuned_means": TUNED_MEANS, "tuning_grid": tuning.GRID_AT_128}


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """What one study runs. Budget fields are code bits per token at the model's own head_dim; None (the default):
    the study's grid above, scaled to the head_dim of the capture (:meth:`at_head_dim`)."""

    context: int = 4096
    ks: tuple[int, ...] = ()  # default: 128, 256 and 2% of the context
    positions: int = 128
    calib_positions: int = 64
    budgets: tuple[int, ...] | None = None
    klt_budgets: tuple[int, ...] | None = None
    layer_plan_means: tuple[int, ...] | None = None
    layer_plan_grid: tuple[int, ...] | None = None
    session_budgets: tuple[int, ...] | None = None
    exact_planner_budgets: tuple[int, ...] | None = None
    basis_budgets: tuple[int, ...] | None = None
    # Allocations in bits as read (code + scale).
    bits_budgets: tuple[int, ...] | None = None
    observed_budgets: tuple[int, ...] | None = None
    exact_bits_budgets: tuple[int, ...] | None = None
    tuned_means: tuple[int, ...] | None = None  # budgets tuned on the calibration capture
    tuning_positions: int | None = None  # spread over the calibration window's second half; None: positions
    session_tuned_means: tuple[int, ...] | None = None  # tuned on the session: positions before the evaluated ones
    session_tuning_positions: int = 64
    tuning_grid: tuple[int, ...] | None = None

    def selection_sizes(self) -> tuple[int, ...]:
        if self.ks:
            return tuple(self.ks)
        return (128, 256, max(40, round(0.02 * self.context)))

    def at_head_dim(self, head_dim: int) -> "StudyConfig":
        """This config with every budget left None set to the study's grid at ``head_dim``."""
        return dataclasses.replace(self, **{
            name: fathom_budgets(head_dim, at_128) for name, at_128 in _BUDGET_FIELDS.items()
            if getattr(self, name) is None})

    def recorded(self, head_dim: int) -> dict:
        """What a results file records of this config (``meta.config``): every budget resolved at ``head_dim``, so
        that a fresh config (budgets still None) and the one a finished study ran compare equal (``--resume``)."""
        return dataclasses.asdict(self.at_head_dim(head_dim))


def captured_layers(model_config) -> tuple[int, ...]:
    """The model layers whose q/k/v ``capture_qkv`` returns, in order: Gemma 3's global layers (the only ones that
    hold the whole context; the local layers keep a window), every layer of a Llama-family model."""
    return tuple(getattr(model_config, "global_layers", range(model_config.n_layers)))


def layer_meta(model_config) -> dict:
    """What a results file records of the layers a study scanned (:func:`captured_layers`) and the model's depth."""
    window = getattr(model_config, "sliding_window", None)
    return {"captured_layers": list(captured_layers(model_config)), "model_layers": model_config.n_layers,
            **({"sliding_window": window} if window else {})}


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the study: a method, the calibration it uses, and per-layer budgets if any."""

    name: str
    family: str
    method: ScanMethod | None  # None: per-layer plan (methods per layer)
    calibration: str = "corpus"  # "corpus" | "session" | "none"
    layer_budgets: tuple[int, ...] | None = None
    state: str | None = None  # the calibration state read, when not the one named by ``calibration``


FAMILIES = {"sparq": "SparQ", "sparq_union": "SparQ union", "double_sparsity": "Double Sparsity", "loki": "Loki",
            "thumbnail": "thumbnail", "landmark": "landmark", "quest": "Quest", "full4": "full 4-bit",
            "exact": "oracle"}


def baseline_rows(head_dim: int) -> list[Row]:
    """The paper's baselines (:data:`fathom_jax.methods.PAPER_METHODS` less dense attention, which the study's error is
    measured against), with SparQ's union read at r = D/8 after the SparQ rows."""
    methods = [m for m in paper_methods(head_dim, budgets=()) if m.name != "dense"]
    after_sparq = max(i for i, m in enumerate(methods) if m.name == "sparq") + 1
    methods.insert(after_sparq, SparQUnion(head_dim // 8))
    return [Row(m.label, FAMILIES[m.name], m, "corpus" if m.needs_calibration else "none") for m in methods]


def fathom_rows(head_dim: int, config: StudyConfig) -> list[Row]:
    config = config.at_head_dim(head_dim)
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


def _basis_methods(grid: Sequence[int], basis_budgets: Sequence[int]) -> list[tuple[str, int, ScanMethod]]:
    """The basis rule's (basis, budget, method) still to measure: raw budgets in the grid are in the table."""
    return [(name, b, make(b)) for name, make in (("raw", Fathom), ("klt", FathomKLT)) for b in basis_budgets
            if not (name == "raw" and b in grid)]


def _calibration_evaluations(calib, grid, basis) -> list[fid.Evaluation]:
    evaluations = [fid.Evaluation(fid.method_score_fn(Fathom(b)), calib, f"layer plan: Fathom {b}") for b in grid]
    return evaluations + [fid.Evaluation(fid.method_score_fn(m), calib, f"basis rule: {m.label}") for _, _, m in basis]


def _row_evaluations(rows: Sequence[Row], calibs: dict[str, Any]) -> list[fid.Evaluation]:
    evaluations = []
    for row in rows:
        if row.layer_budgets is not None:
            fns = [fid.method_score_fn(Fathom(b)) for b in row.layer_budgets]
        else:
            fns = fid.method_score_fn(row.method)
        evaluations.append(fid.Evaluation(fns, calibs[row.state or row.calibration], row.name))
    return evaluations


@contextlib.contextmanager
def compiling_ahead(configs: Sequence[StudyConfig], model_config):
    """Compile every config's programs (:func:`compile_ahead`) in the background while the body runs (loading
    the model, capturing); if the body fails, the compiles not yet started are dropped so the process can exit."""
    for config in configs:
        compile_ahead(config, len(captured_layers(model_config)), model_config.n_heads, model_config.n_kv_heads,
                      model_config.head_dim)
    try:
        yield
    except BaseException:
        fid.cancel_compiles()
        raise


def compile_ahead(config: StudyConfig, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """Start compiling, in the background, what :func:`run_study` (default rows) will run on captures of
    ``config.context`` tokens of a model of this shape; returns at once. Called before the model loads, the
    compiles overlap loading and capturing instead of holding up the study."""
    config = config.at_head_dim(head_dim)
    ks = config.selection_sizes()
    keys = jax.ShapeDtypeStruct((n_layers, n_kv_heads, config.context, head_dim), jnp.float32)
    queries = jax.ShapeDtypeStruct((n_layers, n_heads, config.context, head_dim), jnp.float32)
    calib = jax.eval_shape(cal.calibrate, keys, queries)  # corpus and session statistics have the same shapes
    states = alloc.state_shapes(calib, n_layers, n_kv_heads, head_dim, config)
    shape = (n_layers, n_heads, n_kv_heads, config.context, head_dim)
    grid = config.layer_plan_grid if config.layer_plan_means else ()
    fid.compile_ahead(_calibration_evaluations(calib, grid, _basis_methods(grid, config.basis_budgets)), shape, ks[:1],
                      config.calib_positions)
    if alloc.needs_tuning(config):
        evaluations = tuning.grid_evaluations(states[alloc.OBSERVED], alloc.grid_budgets(head_dim, config))
        for count in {config.tuning_positions or config.positions, config.session_tuning_positions}:
            fid.compile_ahead(evaluations, shape, ks[:1], count)
    rows = default_rows(head_dim, config)
    fid.compile_ahead(_row_evaluations(rows, {"corpus": calib, "session": calib, "none": None, **states}), shape, ks,
                      config.positions)


def _count_down(bar: Progress, futures: list) -> None:
    """The bar's phase while the statistics and dense references compute: how many of them are done."""
    pending = set(futures)
    while pending:
        bar.phase(f"calibration statistics and dense attention, {len(futures) - len(pending)} of {len(futures)} done")
        _, pending = wait(pending, return_when=FIRST_COMPLETED)
    bar.phase("calibration statistics and dense attention, done")


def _compiling() -> str:
    """What the study's bar says it waits for: its first units wait for their programs to compile."""
    n = compiles_pending()
    return f"{n} program{'s' * (n != 1)} to compile" if n else ""


def default_rows(head_dim: int, config: StudyConfig) -> list[Row]:
    """Every row of the study but the per-layer plans (which the calibration capture decides)."""
    config = config.at_head_dim(head_dim)
    return (fathom_rows(head_dim, config) + alloc.fixed_rows(head_dim, config, Row) + alloc.tuned_rows(config, Row)
            + baseline_rows(head_dim))


def calibration_studies(
    capture: fid.Capture, calib: cal.Calibration, *, grid: Sequence[int] = (), basis_budgets: Sequence[int] = (),
    k: int = 128, positions: int = 64, progress: bool | Any = False, references: fid.References | None = None,
) -> tuple[np.ndarray | None, dict[str, Any] | None]:
    """What the calibration capture decides, evaluated together: the per-layer error table of Fathom (raw)
    at each budget of ``grid`` (``[L, len(grid)]``, None without a grid) and the basis rule of section 3.5
    (raw and KLT planes at ``basis_budgets``; None without budgets).

    The basis rule is ``{"basis": "raw" | "klt", "raw": [errors], "klt": [errors], "budgets": [...], "k": k}``,
    the choice by mean error over the budgets; raw budgets in the grid reuse the table's numbers.
    """
    pos = fid.default_positions(capture.q.shape[2], positions)
    basis = _basis_methods(grid, basis_budgets)
    errors = [err[0] for err, _ in fid.attention_errors_many(_calibration_evaluations(calib, grid, basis), capture,
                                                             (k,), positions=pos, progress=progress,
                                                             references=references)]
    table = np.stack([e.mean(axis=(1, 2, 3)) for e in errors[: len(grid)]], axis=1) if grid else None  # [L, grid]
    if not basis_budgets:
        return table, None
    measured = {(name, b): float(np.mean(e)) for (name, b, _), e in zip(basis, errors[len(grid):])}
    measured.update({("raw", b): float(table[:, i].mean()) for i, b in enumerate(grid)})
    rule: dict[str, Any] = {"budgets": list(basis_budgets), "k": k}
    for name in ("raw", "klt"):
        rule[name] = [measured[(name, b)] for b in basis_budgets]
    rule["basis"] = "klt" if np.mean(rule["klt"]) < np.mean(rule["raw"]) else "raw"
    return table, rule


@reraise()  # a run-time check that fires reads as its CheckError
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
    config = config.at_head_dim(d)
    ks = config.selection_sizes()
    positions = fid.default_positions(n_tokens, config.positions)
    prefill = int(positions[0])  # the session's own keys: everything before the first decode position
    defaults = rows is None
    rows = default_rows(d, config) if defaults else list(rows)
    with_plans = defaults and bool(config.layer_plan_means)
    tuned = {src: any(row.state in {alloc.tuned_state(m, src) for m in alloc.tuned_means(config, src)} for row in rows)
             for src in alloc.SOURCES}
    tuning_grid = alloc.grid_budgets(d, config) if tuned["calibration"] else ()
    session_grid = alloc.grid_budgets(d, config) if tuned["session"] else ()
    observed = any(tuned.values()) or any(row.state == alloc.OBSERVED for row in rows)
    basis_budgets = config.basis_budgets if defaults else ()
    grid = config.layer_plan_grid if with_plans else ()
    # One bar over every (evaluation, layer) of the study, so progress shows from the first minute.
    calls = len(rows) + len(grid) + len(_basis_methods(grid, basis_budgets)) + len(config.layer_plan_means) * with_plans
    calls += len(tuning_grid) + len(session_grid)
    # Its ETA starts at the first finished (evaluation, layer): programs compile on a background thread meanwhile.
    bar = Progress(calls * n_layers, f"study @ {n_tokens} tokens", unit="layer", sequential=False,
                   status=_compiling) if progress else False

    calib_positions = fid.default_positions(calib_capture.q.shape[2], config.calib_positions)
    calibrating = defaults
    tunings = []  # (source, capture, grid, positions, dense references there)
    # Statistics and dense attention (every row's target), each computed once, side by side.
    if bar:
        bar.phase("calibration statistics and dense attention")
    with ThreadPoolExecutor(4) as pool:
        corpus = pool.submit(cal.calibrate, calib_capture.k, calib_capture.q)
        plane_error = pool.submit(allocation.plane_errors, calib_capture.k, skip_tokens=cal.SKIP_TOKENS) if observed else None
        session = pool.submit(cal.calibrate_session, eval_capture.k[:, :, :prefill])
        eval_refs = pool.submit(fid.dense_references, eval_capture, positions)
        calib_refs = pool.submit(fid.dense_references, calib_capture, calib_positions) if calibrating else None
        if tuning_grid:
            pos = tuning.spread_positions(calib_capture.q.shape[2], config.tuning_positions or config.positions)
            tunings.append(("calibration", calib_capture, tuning_grid, pos,
                            pool.submit(fid.dense_references, calib_capture, pos)))
        if session_grid:
            pos = alloc.session_positions(prefill, config.session_tuning_positions)
            tunings.append(("session", eval_capture, session_grid, pos, pool.submit(fid.dense_references, eval_capture, pos)))
        if bar:  # a minute or two on 2 CPU cores before the first layer: say how far it is
            _count_down(bar, [f for f in (corpus, plane_error, session, eval_refs, calib_refs) if f is not None]
                        + [t[-1] for t in tunings])
        corpus, session, eval_refs = corpus.result(), session.result(), eval_refs.result()
        calib_refs = calib_refs and calib_refs.result()
    if bar:
        bar.phase("")  # the units from here on: the bar names the last one, and the programs still compiling
    calibs = {"corpus": corpus, "session": session, "none": None}
    if observed:
        calibs[alloc.OBSERVED] = alloc.observed_state(corpus, plane_error.result())

    layer_plans, basis_rule, tuning_report = {}, None, {}
    if calibrating:
        table, basis_rule = calibration_studies(calib_capture, corpus, grid=grid, basis_budgets=basis_budgets, k=ks[0],
                                                positions=config.calib_positions, progress=bar, references=calib_refs)
        for mean in config.layer_plan_means if with_plans else ():
            budgets = planner_lib.greedy_layer_budgets(table, np.asarray(grid), mean)
            layer_plans[mean] = [int(b) for b in budgets]
            rows.append(Row(f"Fathom per-layer {mean}", "Fathom per-layer", None, "corpus", tuple(layer_plans[mean])))
    tables = {}
    for source, capture, grid_b, pos, refs in tunings:
        tables[source] = tuning.error_tables(capture, calibs[alloc.OBSERVED], grid_b, k=ks[0], positions=pos,
                                             references=refs.result(), progress=bar)
        states, means = alloc.tune(calibs[alloc.OBSERVED], tables[source], alloc.tuned_means(config, source), source)
        calibs.update(states)
        tuning_report[source] = {"tables": alloc.tables_report(tables[source]), "means": means,
                                 "positions": [int(pos[0]), int(pos[-1]), len(pos)]}

    measured = fid.attention_errors_many(_row_evaluations(rows, calibs), eval_capture, ks, positions=positions,
                                         progress=bar, references=eval_refs)
    alloc.check_surrogates(tuning_report, tables, rows, measured)
    results = []
    for row, (err, bits) in zip(rows, measured):
        results.append({
            "name": row.name,
            "family": row.family,
            "kind": "fathom" if row.method is None else row.method.kind,
            "spec": None if row.method is None else row.method.spec,
            "calibration": row.calibration,
            "layer_budgets": list(row.layer_budgets) if row.layer_budgets else None,
            "bits": float(bits.mean()),
            "error": {str(k): float(err[i].mean()) for i, k in enumerate(ks)},
            "error_per_layer": {str(k): err[i].mean(axis=(1, 2, 3)).tolist() for i, k in enumerate(ks)},
            # Per decode position (mean over layers and heads): the standard errors of the report's comparisons.
            "error_per_position": {str(k): err[i].mean(axis=(0, 2, 3)).tolist() for i, k in enumerate(ks)},
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
            "config": config.recorded(d),
        },
        "layer_plans": {str(m): b for m, b in layer_plans.items()},
        "basis_rule": basis_rule,
        "tuning": tuning_report or None,
        "rows": results,
    }


