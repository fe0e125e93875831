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
import json
import os
import platform
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from fathom_jax import calibrate as cal
from fathom_jax import fidelity as fid
from fathom_jax import planner as planner_lib
from fathom_jax.scorers import ScanMethod

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


def baseline_rows(head_dim: int) -> list[Row]:
    d = head_dim
    methods = [
        ("SparQ", ScanMethod.sparq(d // 8)),
        ("SparQ", ScanMethod.sparq(d // 4)),
        ("SparQ union", ScanMethod.sparq_union(d // 8)),
        ("Double Sparsity", ScanMethod.double_sparsity(d // 4)),
        ("Loki", ScanMethod.loki(d // 4)),
        ("Loki", ScanMethod.loki(d // 2)),
        ("thumbnail", ScanMethod.thumbnail(2)),
        ("landmark", ScanMethod.landmark()),
        ("full 4-bit", ScanMethod.full4()),
        ("oracle", ScanMethod.exact()),
    ]
    uses_calib = {"double_sparsity", "loki"}
    return [Row(m.label, fam, m, "corpus" if m.kind in uses_calib else "none") for fam, m in methods]


def fathom_rows(head_dim: int, config: StudyConfig) -> list[Row]:
    cap = 4 * head_dim
    rows = [Row(ScanMethod.fathom(b).label, "Fathom", ScanMethod.fathom(b)) for b in config.budgets if b <= cap]
    rows += [Row(ScanMethod.fathom_klt(b).label, "Fathom KLT", ScanMethod.fathom_klt(b)) for b in config.klt_budgets if b <= cap]
    rows += [
        Row(f"Fathom {b} (session calib)", "Fathom session", ScanMethod.fathom(b), "session")
        for b in config.session_budgets if b <= cap
    ]
    rows += [
        Row(f"Fathom KLT {b} (session calib)", "Fathom KLT session", ScanMethod.fathom_klt(b), "session")
        for b in config.session_budgets if b <= cap
    ]
    rows += [
        Row(ScanMethod.fathom(b, planner="exact").label, "Fathom exact plan", ScanMethod.fathom(b, planner="exact"))
        for b in config.exact_planner_budgets if b <= cap
    ]
    return rows


def layer_error_table(
    capture: fid.Capture, calib: cal.Calibration, grid: Sequence[int], k: int, positions: int, progress: bool = False
) -> np.ndarray:
    """Per-layer mean error of Fathom (raw) at each budget of ``grid`` on the calibration capture."""
    pos = fid.default_positions(capture.q.shape[2], positions)
    table = []
    for b in grid:
        err, _ = fid.attention_errors(
            fid.method_score_fn(ScanMethod.fathom(b)), capture, k, positions=pos, layer_states=calib,
            progress=progress, desc=f"layer plan: Fathom {b}",
        )
        table.append(err.mean(axis=(1, 2, 3)))  # [L]
    return np.stack(table, axis=1)  # [L, len(grid)]


def choose_basis(
    capture: fid.Capture, calib: cal.Calibration, *, budgets: Sequence[int] = (48, 64), k: int = 128,
    positions: int = 64, progress: bool = False, known: dict[tuple[str, int], float] | None = None,
) -> dict[str, Any]:
    """The basis rule of section 3.5: evaluate raw and KLT planes on calibration text, keep the better.

    Returns ``{"basis": "raw" | "klt", "raw": [errors], "klt": [errors], "budgets": [...]}`` where
    the choice is by mean error over ``budgets``. ``known[(basis, budget)]`` supplies errors already
    measured under the same protocol (e.g. from :func:`layer_error_table`) instead of re-running them.
    """
    pos = fid.default_positions(capture.q.shape[2], positions)
    known = known or {}
    out: dict[str, Any] = {"budgets": list(budgets), "k": k}
    for name, make in (("raw", ScanMethod.fathom), ("klt", ScanMethod.fathom_klt)):
        errs = []
        for b in budgets:
            if (name, b) in known:
                errs.append(known[(name, b)])
                continue
            e, _ = fid.mean_attention_error(
                fid.method_score_fn(make(b)), capture, k, positions=pos, layer_states=calib,
                progress=progress, desc=f"basis rule: {make(b).label}",
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
    layer_plans = {}
    basis_rule = table = None
    if default_rows and config.layer_plan_means:
        table = layer_error_table(calib_capture, corpus, config.layer_plan_grid, ks[0], config.calib_positions, progress)
        for mean in config.layer_plan_means:
            budgets = planner_lib.greedy_layer_budgets(table, np.asarray(config.layer_plan_grid), mean)
            layer_plans[mean] = [int(b) for b in budgets]
            rows.append(Row(f"Fathom per-layer {mean}", "Fathom per-layer", None, "corpus", tuple(layer_plans[mean])))

    if default_rows:
        # The layer-plan table already holds raw Fathom on the calibration capture (same k and positions).
        known = {} if table is None else {("raw", b): float(table[:, i].mean()) for i, b in enumerate(config.layer_plan_grid)}
        basis_rule = choose_basis(calib_capture, corpus, k=ks[0], positions=config.calib_positions,
                                  progress=progress, known=known)

    results = []
    iterator = rows
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(rows, desc=f"methods @ {n_tokens} tokens")
    fn_cache: dict[ScanMethod, Any] = {}
    for row in iterator:
        if row.layer_budgets is not None:
            fns = [fn_cache.setdefault(ScanMethod.fathom(b), fid.method_score_fn(ScanMethod.fathom(b)))
                   for b in row.layer_budgets]
        else:
            fns = fid.method_score_fn(row.method)
        err, bits = fid.attention_errors(
            fns, eval_capture, ks, positions=positions, layer_states=calibs[row.calibration],
            progress=progress, desc=row.name,
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


# ----------------------------------------------------------------------------------------------
# Reports


def headline(results: dict) -> list[str]:
    """Fathom against SparQ at equal or fewer bits, per k (the issue's question, answered from data)."""
    rows = results["rows"]
    lines = []
    sparqs = [r for r in rows if r["kind"] == "sparq"]
    fathoms = [r for r in rows if r["family"] == "Fathom"]
    for s in sorted(sparqs, key=lambda r: r["bits"]):
        cheaper = [f for f in fathoms if f["bits"] <= s["bits"] + 1e-9]
        if not cheaper:
            continue
        best = max(cheaper, key=lambda f: f["bits"])
        for k in s["error"]:
            ratio = s["error"][k] / best["error"][k] if best["error"][k] > 0 else float("nan")
            verdict = "matches" if abs(ratio - 1) < 0.01 else ("beats" if ratio > 1 else "does not beat")
            excess = ""
            if "excess" in s:
                excess = f"; excess over the oracle {best['excess'][k]:.4f} vs {s['excess'][k]:.4f}"
            lines.append(
                f"k={k}: {best['name']} ({best['bits']:.1f} bits) {verdict} {s['name']} ({s['bits']:.1f} bits): "
                f"error {best['error'][k]:.4f} vs {s['error'][k]:.4f} (SparQ / Fathom = {ratio:.2f}){excess}"
            )
    return lines


def render_markdown(results: dict) -> str:
    meta = results["meta"]
    ks = [str(k) for k in meta["ks"]]
    out = [
        f"# Attention-output error vs scan bits: {meta.get('model', 'model')}",
        "",
        f"- context {meta['context']} tokens, last {meta['positions']} positions, {meta['layers']} layers, "
        f"D = {meta['head_dim']}; selection: 4 sink + 32 local + top-(k-36) per query head; k = {', '.join(ks)}",
        f"- calibration text: {meta.get('calib_text', {}).get('kind', '?')}; evaluation text: "
        f"{meta.get('eval_text', {}).get('kind', '?')} (disjoint)",
        f"- {meta['date']}, {meta['machine']}, JAX {meta['jax']}",
        f"- D = {meta['head_dim']}, not the paper's 128: the paper's settings run as the same fractions of D "
        f"(SparQ r = D/8 and D/4, Double Sparsity c = D/4, Loki r = D/4 and D/2, Fathom budgets in code bits).",
        "- bits: per token per KV head per layer (code bits + 16 bits per 64 tokens per channel read); "
        "excess: error minus the exact top-k oracle's.",
        "",
        "| method | calib | bits | " + " | ".join(f"err k={k}" for k in ks) + " | " + " | ".join(f"excess k={k}" for k in ks) + " |",
        "|---|---|---:|" + "---:|" * (2 * len(ks)),
    ]
    for r in sorted(results["rows"], key=lambda r: (r["family"] != "oracle", r["bits"])):
        errs = " | ".join(f"{r['error'][k]:.4f}" for k in ks)
        exc = " | ".join(f"{r.get('excess', {}).get(k, float('nan')):+.4f}" for k in ks)
        out.append(f"| {r['name']} | {r['calibration']} | {r['bits']:.1f} | {errs} | {exc} |")
    if results.get("layer_plans"):
        out += ["", "Per-layer budgets (greedy plan on the calibration capture):", ""]
        for mean, b in results["layer_plans"].items():
            out.append(f"- mean {mean}: {b}")
    if results.get("basis_rule"):
        br = results["basis_rule"]
        out += ["", f"Basis rule (calibration text, k={br['k']}, budgets {br['budgets']}): raw {['%.4f' % e for e in br['raw']]}, "
                f"KLT {['%.4f' % e for e in br['klt']]} -> **{br['basis']}**"]
    lines = headline(results)
    if lines:
        out += ["", "Fathom vs SparQ at equal or fewer bits:", ""] + [f"- {line}" for line in lines]
    return "\n".join(out) + "\n"


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = results["meta"]
    ks = [str(k) for k in meta["ks"]]
    fig, axes = plt.subplots(1, len(ks), figsize=(5.2 * len(ks), 4.2), squeeze=False)
    families: dict[str, list[dict]] = {}
    for r in results["rows"]:
        families.setdefault(r["family"], []).append(r)
    colors = plt.get_cmap("tab20").colors
    markers = "osD^v<>ph*Xd8"
    for ax, k in zip(axes[0], ks):
        for i, (fam, rows) in enumerate(families.items()):
            rows = sorted(rows, key=lambda r: r["bits"])
            x = [r["bits"] for r in rows]
            y = [max(r["error"][k], 1e-6) for r in rows]
            if fam == "oracle":
                ax.axhline(y[0], color="k", ls="--", lw=1, label="exact top-k oracle")
                continue
            line = "-" if fam.startswith("Fathom") and len(rows) > 1 else ""
            ax.plot(x, y, line + markers[i % len(markers)], color=colors[(2 * i) % 20 + (i // 10) % 2], ms=5,
                    label=fam)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("scan bits per token (per KV head, per layer)")
        ax.set_ylabel("attention-output relative L2 error")
        ax.set_title(f"k = {k}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{meta.get('model', '')}: {meta['context']} tokens, {meta['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: dict, prefix: str) -> list[str]:
    """Write ``prefix.json``, ``prefix.md`` and ``prefix.png``; return the paths."""
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    paths = [prefix + ".json", prefix + ".md", prefix + ".png"]
    with open(paths[0], "w") as f:
        json.dump(results, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(render_markdown(results))
    plot(results, paths[2])
    return paths
