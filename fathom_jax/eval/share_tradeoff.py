"""Selection shared across layers, fidelity beside speed: what a shared selection costs in attention error on the real
models (:mod:`~fathom_jax.eval.share_run`'s studies) next to what it saves in step time and link bytes (the offload
benchmark's rows of per-layer Fathom and a shared selection measured in one run).

The two sides are measured apart: the speed on the benchmark's model shape at long contexts, the error on the small
real models at the studies' windows. They are joined by the shape of the sharing: the same rule and the same budget
relative to k (the benchmark's 2048 positions at k = 512 is the studies' 512 at k = 128)."""

from __future__ import annotations

import glob
import json
import os
import time

import numpy as np

from fathom_jax.eval.share_report import TARGET


def study_points(studies: list[dict], rules: tuple[str, ...], budget_per_k: int, ranking: str) -> list[dict]:
    """Each study's error ratio for the first of ``rules`` it ran at budget ``budget_per_k x k`` with ``ranking``, with
    the ratio given the same rows and the same bits."""
    out = []
    for res in studies:
        base, meta = res["baseline"], res["meta"]
        budget = budget_per_k * base["k"]
        found = {r["rule"]: r for r in res["rules"]
                 if r["scan"] == base["method"] and r["ranking"] == ranking and r["budget"] == budget}
        rule = next((found[name] for name in rules if name in found), None)
        if rule is None:
            continue
        out.append({"model": meta["model"].split(" (")[0], "context": meta["context"], "scan": base["method"],
                    "k": base["k"], "budget": budget, "rule": rule["rule"], "layers": rule["layers"],
                    "ratio": rule["ratio"], "ratio_se": rule["ratio_se"],
                    "equal_rows_ratio": rule.get("equal_rows_ratio"), "equal_bits_ratio": rule.get("equal_bits_ratio"),
                    "bits": rule["bits"], "bits_per_layer": base["bits"]})
    return out


def step_pairs(bench: dict, per_layer: str, shared: str) -> list[dict]:
    """The benchmark run's attention rows of ``per_layer`` and ``shared`` measured under the same placement, paired:
    step time, plane bytes over the link and the rows' upper bound, and their ratios."""
    key = ("context", "batch", "resident_planes", "warm_planes", "rows", "inputs")
    rows = [r for r in bench["rows"] if r["kind"] == "attention"]
    out = []
    for a in (r for r in rows if r["method"] == per_layer):
        b = next((r for r in rows if r["method"] == shared and all(r[f] == a[f] for f in key)), None)
        if b is None:
            continue
        sides = {}
        for name, r in (("per_layer", a), ("shared", b)):
            sides[name] = {"ms": r["median_ms"], "min_ms": r["min_ms"], "max_ms": r["max_ms"],
                           "plane_mb": r["link_scan_bytes"] / 1e6, "row_mb": r["row_bytes_max"] / 1e6,
                           "bits_per_token": r["bits_per_token"], "launches": r.get("launches")}
        out.append({**{f: a[f] for f in key}, "machine": bench["machine"]["device"], "commit": bench["machine"]["commit"],
                    "command": bench.get("command"), **sides,
                    "time_ratio": b["median_ms"] / a["median_ms"],
                    # None where neither moves a plane (every plane read resident or warm)
                    "plane_ratio": b["link_scan_bytes"] / a["link_scan_bytes"] if a["link_scan_bytes"] else None})
    return out


def build(benches: list[dict], studies: list[dict], *, per_layer: str, shared: str, spec: str,
          rules: tuple[str, ...] = ("0,2,mid", "first,mid"), meta: dict | None = None) -> dict:
    """The trade-off's results: every benchmark run's pairs of ``per_layer`` and ``shared`` (whose method spec is
    ``spec``) rows, and the studies' error for the first of ``rules`` each ran at the same budget relative to k and
    the spec's ranking."""
    from fathom_jax.methods.sharing import parse_spec

    sharing = parse_spec(spec)[1]
    budget = sharing.budget
    ks = {b["config"]["k"] for b in benches}
    if len(ks) != 1 or budget % next(iter(ks)):
        raise ValueError(f"benches: one k that divides the shared budget {budget} expected, got k = {sorted(ks)}")
    budget_per_k = budget // ks.pop()
    return {"meta": {**(meta or {}), "per_layer": per_layer, "shared": shared, "shared_spec": spec,
                     "rules": list(rules), "budget_per_k": budget_per_k},
            "steps": [p for b in benches for p in step_pairs(b, per_layer, shared)],
            "errors": study_points(studies, rules, budget_per_k, sharing.ranking)}


def write(bench_paths: list[str], out: str, *, meta: dict, **names) -> list[str]:
    """:func:`build` from the offload benchmark's result files (``offload_<machine>_<tag>.json``, one machine) and
    every shared-selection study in ``out``; writes ``out/share_tradeoff_<machine>.{json,md,png}``, returns the
    paths."""
    from fathom_jax.eval.report import save_report

    machines = {os.path.basename(p).split("_")[1] for p in bench_paths}
    if len(machines) != 1:
        raise ValueError(f"bench_paths: runs of one machine expected, got {sorted(machines)}")
    studies = sorted(glob.glob(os.path.join(out, "share_fidelity_*.json")))

    def load(path):
        with open(path) as f:
            return json.load(f)

    meta = {"date": time.strftime("%Y-%m-%d"), **meta, "sources": [*bench_paths, *studies]}
    res = build([load(p) for p in bench_paths], [load(p) for p in studies], meta=meta, **names)
    return save_report(res, os.path.join(out, f"share_tradeoff_{machines.pop()}"), render_markdown(res), plot)


def _size(tokens: int) -> str:
    return f"{tokens >> 20}M" if tokens % (1 << 20) == 0 else f"{tokens >> 10}k"


def render_markdown(res: dict) -> str:
    meta = res["meta"]
    lines = ["# Selection shared across layers: error against step time and link bytes", "",
             f"{meta['date']}, commit {meta['commit']}; command `{meta['command']}`. {meta['per_layer']} against "
             f"{meta['shared']} (`{meta['shared_spec']}`): the speed rows from the offload benchmark (one run per "
             "file, both methods side by side), the error from the shared-selection studies on the real models for "
             f"the same sharing ({' or '.join(meta['rules'])}, a budget of {meta['budget_per_k']} k).", "",
             "## Speed (attention only, index in host memory)", "",
             "Plane MB: planes one step moves over the link; row MB: the selected K/V rows' upper bound (a per-layer "
             "union of the group's heads, or the shared budget); ratio: shared over per-layer.", "",
             "| machine | context x batch | rows | resident planes | per-layer ms | shared ms | time ratio | "
             "per-layer plane MB | shared plane MB | plane ratio | row MB (both) |", "|---|" + "---|" * 10]
    for p in res["steps"]:
        a, b = p["per_layer"], p["shared"]
        planes = "n/a" if p["plane_ratio"] is None else f"1/{1 / p['plane_ratio']:.1f}"
        lines.append(f"| {p['machine']} | {_size(p['context'])} x {p['batch']} | {p['rows']} | {_placement(p)} "
                     f"| {a['ms']:.2f} [{a['min_ms']:.2f}, {a['max_ms']:.2f}] | {b['ms']:.2f} [{b['min_ms']:.2f}, "
                     f"{b['max_ms']:.2f}] | {p['time_ratio']:.2f} | {a['plane_mb']:.0f} | {b['plane_mb']:.0f} | "
                     f"{planes} | {a['row_mb']:.0f} / {b['row_mb']:.0f} |")
    lines += ["", "## Error (the studies' protocol, against per-layer selection at the same k)", "",
              "| model, context | scan, k | rule (layers) | budget | error ratio | given the same rows | given the same "
              "bits | bits / token (per-layer) |", "|---|" + "---|" * 7]
    for e in res["errors"]:
        ratio = f"{e['ratio']:.3f} ± {e['ratio_se']:.3f}"
        ratio = f"**{ratio}**" if e["ratio"] <= TARGET else ratio
        lines.append(f"| {e['model']}, {_size(e['context'])} | {e['scan']}, {e['k']} | {e['rule']} "
                     f"({','.join(map(str, e['layers']))}) | {e['budget']} | {ratio} | "
                     f"{_cell(e['equal_rows_ratio'])} | {_cell(e['equal_bits_ratio'])} | {e['bits']:.1f} "
                     f"({e['bits_per_layer']:.1f}) |")
    lines += ["", "Bold: within the issue's +15%.", ""]
    return "\n".join(lines) + "\n"


def _placement(p: dict) -> str:
    """Planes in HBM: ``p`` resident, and warm planes per layer and group where there are any."""
    warm = p.get("warm_planes") or 0
    return f"{p['resident_planes']}" + (f" + {warm} warm" if warm else "")


def _cell(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def plot(res: dict, path: str) -> None:
    """Error ratio against step time and against the bytes one step moves over the link: per-layer selection at 1,
    each study's shared selection at its ratio (± s.e.), one arrow per measured placement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    ratios = [e["ratio"] for e in res["errors"]] or [1.0]
    mean, spread = float(np.mean(ratios)), (min(ratios), max(ratios))
    for ax, (x_of, label) in zip(axes, ((lambda s: s["ms"], "step ms (attention only)"),
                                        (lambda s: s["plane_mb"] + s["row_mb"], "MB over the link per step "
                                                                                "(planes + rows, upper bound)"))):
        for p in res["steps"]:
            x0, x1 = x_of(p["per_layer"]), x_of(p["shared"])
            name = f"{p['machine'].split()[1] if ' ' in p['machine'] else p['machine']} {_size(p['context'])} x " \
                   f"{p['batch']}, {p['rows']}, p = {_placement(p)}"
            ax.annotate("", (x1, mean), (x0, 1.0), arrowprops={"arrowstyle": "->", "color": "0.6"})
            ax.plot([x0], [1.0], "ko", ms=5)
            ax.errorbar([x1], [mean], yerr=[[mean - spread[0]], [spread[1] - mean]], fmt="s", ms=5, capsize=3,
                        label=name)
        ax.axhline(TARGET, color="r", ls=":", lw=1, label="+15%")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel(label)
        ax.set_ylabel("error / per-layer's (shared: mean, range of the studies)")
        ax.legend(fontsize=7)
    studies = ", ".join(f"{e['model']} {_size(e['context'])} {e['ratio']:.2f}" for e in res["errors"])
    fig.suptitle(f"{res['meta']['per_layer']} (circles) against {res['meta']['shared']} (squares)\nerror ratios: "
                 f"{studies}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
