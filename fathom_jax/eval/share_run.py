"""One study of shared selection on a model's captures: every rule, ranking and budget against per-layer selection.

:func:`run_share_study` measures (:mod:`~fathom_jax.eval.share_study`) the evaluation capture under the scan method
and the exact oracle, picks selection layers on the calibration capture, and returns plain JSON: per rule its error
(overall and per layer), its ratio to per-layer selection at the same k, the rows it fetches per KV head and the
bits it reads per step, and per-layer selection given the same rows and the same bits, interpolated over measured
grids (a k grid; a budget grid). :mod:`~fathom_jax.eval.share_report` renders it.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import time
from collections.abc import Sequence

import jax
import numpy as np

from fathom_jax.eval import fidelity as fid
from fathom_jax.eval import share_study as ss
from fathom_jax.eval.report import _block_means
from fathom_jax.methods import Fathom, parse
from fathom_jax.methods.sharing import SharedSelection, parse_option

BF16_ROW_BYTES_PER_D = 4  # a K and a V row of D bf16 values: 4 D bytes per KV head
ONE_M = 1 << 20


def _per_layer(methods, capture, calib, ks, positions, refs):
    """Per-layer selection through the study's own machinery: per method ``(errors [K, L, P] mean over heads,
    bits [L] mean over positions and KV heads)``."""
    evaluations = [fid.Evaluation(fid.method_score_fn(m), calib if m.needs_calibration else None, m.label)
                   for m in methods]
    out = fid.attention_errors_many(evaluations, capture, ks, positions=positions, references=refs)
    return [(err.mean(axis=(3, 4)), bits.mean(axis=(1, 2))) for err, bits in out]


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """``y`` at ``x`` on the measured curve, linear in ``log x``; None outside the measured range."""
    order = np.argsort(xs)
    xs, ys = np.log(np.asarray(xs, float)[order]), np.asarray(ys, float)[order]
    lx = np.log(x)
    if lx < xs[0] - 1e-9 or lx > xs[-1] + 1e-9:
        return None
    return float(np.interp(lx, xs, ys))


def _rule_plans(config: ss.ShareConfig, n_layers: int, scanning: tuple[int, ...]):
    """``{rule text: SharingPlan}`` for the config's rules that this model can run (Gemma 3: global layers only),
    and ``{rule text: why not}`` for the others (and for a rule selecting an earlier rule's layers)."""
    plans, skipped = {}, {}
    for rule in config.rules:
        try:
            plan = parse_option(f"share={rule}@budget={max(config.budgets)}").plan_layers(n_layers, scanning)
        except ValueError as err:
            skipped[rule] = str(err)
            continue
        same = next((name for name, other in plans.items() if other.selects == plan.selects), None)
        if same is None:
            plans[rule] = plan
        else:
            skipped[rule] = f"selects the layers of {same!r}"
    return plans, skipped


def run_share_study(eval_capture: fid.Capture, calib_capture: fid.Capture, calib, config: ss.ShareConfig, *,
                    n_layers: int, scanning_layers: Sequence[int], meta: dict | None = None, log=print) -> dict:
    """Every rule of ``config`` (and the calibration's chosen layer sets) on ``eval_capture``, calibrated by
    ``calib`` (from ``calib_capture``, where the layer sets are chosen). ``scanning_layers``: the model layers the
    captures hold, in order (Gemma 3: its global layers) of a model of ``n_layers``."""
    t0 = time.time()
    scanning = tuple(int(s) for s in scanning_layers)
    method = parse(config.method)
    reference = parse(config.reference) if config.reference else None
    n_scan, _, n_tokens, d = eval_capture.q.shape
    n_kv = eval_capture.k.shape[1]
    if len(scanning) != n_scan:
        raise ValueError(f"scanning_layers {scanning} do not match the capture's {n_scan} layers")
    plans, skipped = _rule_plans(config, n_layers, scanning)
    positions = fid.default_positions(n_tokens, config.positions)
    refs = fid.dense_references(eval_capture, positions)
    k_index = config.row_ks.index(config.k)

    log(f"[share] per-layer selection: {method.label} at k = {config.row_ks}, its budgets {config.bits_budgets()}")
    [(grid_err, bits)] = _per_layer([method], eval_capture, calib, config.row_ks, positions, refs)
    grid_methods = [Fathom(b) for b in config.bits_budgets()] + ([reference] if reference else [])
    at_k = _per_layer(grid_methods, eval_capture, calib, (config.k,), positions, refs)
    sel = ss.measure(method, eval_capture, calib, positions, refs, config, row_ks=config.row_ks, log=log)
    ref_sel = (ss.measure(reference, eval_capture, None, positions, refs, config, row_ks=(config.k,), log=log)
               if reference else None)

    log("[share] the calibration capture: choosing selection layers")
    calib_positions = fid.default_positions(calib_capture.q.shape[2], config.calib_positions)
    calib_refs = fid.dense_references(calib_capture, calib_positions)
    [(calib_own, _)] = _per_layer([method], calib_capture, calib, (config.k,), calib_positions, calib_refs)
    calib_sel = ss.measure(method, calib_capture, calib, calib_positions, calib_refs, config, log=log)
    counts = [c for c in config.chosen_counts if c < n_scan]
    chosen = {(r, b, c): ss.choose_layers(calib_own[0].mean(-1), calib_sel.pair[r, b].mean(-1), c)
              for r in range(len(config.rankings)) for b in range(len(config.budgets)) for c in counts}

    own = grid_err[k_index]  # [L, P]
    rows_grid = sel.union_rows.mean(axis=(2, 3))  # [K, L]
    baseline = {
        "method": method.label, "spec": method.spec, "k": config.k,
        "error": float(own.mean()), "error_per_layer": own.mean(-1).tolist(), "bits": float(bits.mean()),
        "bits_per_layer": bits.tolist(), "rows": float(rows_grid[k_index].mean()),
        "rows_per_layer": rows_grid[k_index].tolist(),
        **_links(bits, rows_grid[k_index], n_tokens, n_kv, d),
        "row_grid": [{"k": k, "rows": float(rows_grid[i].mean()), "error": float(grid_err[i].mean()),
                      **_links(bits, rows_grid[i], n_tokens, n_kv, d)} for i, k in enumerate(config.row_ks)],
        "bits_grid": [{"budget": m.budget, "bits": float(b.mean()), "error": float(e[0].mean()),
                       **_links(b, rows_grid[k_index], n_tokens, n_kv, d)}
                      for m, (e, b) in zip(grid_methods, at_k) if isinstance(m, Fathom)]
                     + [{"budget": method.budget, "bits": float(bits.mean()), "error": float(own.mean()),
                         **_links(bits, rows_grid[k_index], n_tokens, n_kv, d)}],
    }
    rows = []
    scans = [(method, sel, own, bits, rows_grid[k_index])]
    if reference:
        ref_err, ref_bits = at_k[-1]
        scans.append((reference, ref_sel, ref_err[0], ref_bits, ref_sel.union_rows[0].mean(axis=(1, 2))))
        baseline["reference"] = {"method": reference.label, "error": float(ref_err[0].mean()),
                                 "error_per_layer": ref_err[0].mean(-1).tolist()}
    for scan, measured, own_err, scan_bits, union_rows in scans:
        for r, ranking in enumerate(config.rankings):
            for b, budget in enumerate(config.budgets):
                rules = dict(plans)
                if scan is method:
                    rules.update({f"chosen {c}": SharedSelection(tuple(scanning[i] for i in chosen[(r, b, c)]),
                                                                 budget).plan_layers(n_layers, scanning)
                                  for c in counts})
                for name, plan in rules.items():
                    rows.append(_rule_row(name, plan, scan, ranking, budget, own_err, measured.pair[r, b],
                                          scan_bits, union_rows, baseline, n_tokens, n_kv, d,
                                          main=scan is method))
        log(f"[share] {scan.label}: {len(rows)} rule rows")
    exact_topk = ref_sel.topk if ref_sel is not None else None
    overlap = {}
    for budget in config.budgets:
        found = ss.overlaps(sel, exact_topk, positions, budget)
        found["in_shared"] = dict(zip(config.rankings, found["in_shared"]))
        overlap[str(budget)] = found
    return {
        "meta": {"machine": f"{platform.node()} ({platform.machine()}, {jax.devices()[0].platform})", **(meta or {}),
                 "date": datetime.date.today().isoformat(), "jax": jax.__version__, "context": n_tokens,
                 "head_dim": d, "kv_heads": n_kv,
                 "heads": eval_capture.q.shape[1], "model_layers": n_layers, "scanning_layers": list(scanning),
                 "positions": [int(positions[0]), int(positions[-1])], "config": dataclasses.asdict(config),
                 "skipped_rules": skipped, "wall_seconds": round(time.time() - t0, 1)},
        "baseline": baseline,
        "rules": rows,
        # [s][l]: layer l's mean error attending layer s's set (None where l <= s)
        "pair": {ranking: {str(budget): [[None if np.isnan(x) else float(x) for x in row]
                                         for row in sel.pair[r, b].mean(-1)]
                           for b, budget in enumerate(config.budgets)} for r, ranking in enumerate(config.rankings)},
        "overlap": overlap,
    }


def _link_mb(bits: np.ndarray, rows: np.ndarray, n_tokens: int, n_kv: int, d: int) -> float:
    """MB one step moves at ``n_tokens`` positions: every layer's planes (``bits [L]`` per token and KV head) and
    its rows (``rows [L]`` per KV head, bf16 K and V). At 1M (``ONE_M``) the same bits per token and rows: a
    projection, not a measurement (rows and bits were measured at the study's context)."""
    return float(n_kv * (np.sum(bits) * n_tokens / 8 + np.sum(rows) * BF16_ROW_BYTES_PER_D * d) / 1e6)


def _links(bits: np.ndarray, rows: np.ndarray, n_tokens: int, n_kv: int, d: int) -> dict[str, float]:
    return {"link_mb": _link_mb(bits, rows, n_tokens, n_kv, d), "link_mb_1m": _link_mb(bits, rows, ONE_M, n_kv, d)}


def _rule_row(name, plan, scan, ranking, budget, own, pair, scan_bits, union_rows, baseline, n_tokens, n_kv, d,
              *, main: bool) -> dict:
    err = ss.rule_errors(plan.selects, own, pair)  # [L, P]
    selects = np.asarray(plan.selects)
    bits = np.where(selects, scan_bits, 0.0)
    rows = np.where(selects, union_rows, budget)  # a sharing layer fetches its budget's rows per KV head
    per_pos, base_pos = err.mean(0), own.mean(0)
    ratio = float(per_pos.mean() / base_pos.mean())
    # The ratio's standard error (delta method) over blocks of consecutive positions, as the study's (neighbours
    # share their context).
    diff = _block_means(per_pos - ratio * base_pos)
    out = {"scan": scan.label, "ranking": ranking, "budget": budget, "rule": name,
           "layers": list(plan.selecting), "selecting": int(selects.sum()),
           "error": float(err.mean()), "error_per_layer": err.mean(-1).tolist(), "ratio": ratio,
           "ratio_se": float(diff.std(ddof=1) / np.sqrt(len(diff)) / base_pos.mean()),
           "bits": float(bits.mean()), "rows": float(rows.mean()), **_links(bits, rows, n_tokens, n_kv, d)}
    if main:
        grid = baseline["row_grid"]
        same_rows = _interp(out["rows"], [g["rows"] for g in grid], [g["error"] for g in grid])
        grid = baseline["bits_grid"]
        same_bits = _interp(out["bits"], [g["bits"] for g in grid], [g["error"] for g in grid])
        out |= {"equal_rows_error": same_rows,
                "equal_rows_ratio": None if same_rows is None else out["error"] / same_rows,
                "equal_bits_error": same_bits,
                "equal_bits_ratio": None if same_bits is None else out["error"] / same_bits}
    return out
