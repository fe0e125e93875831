"""Reports of the error-vs-bits study: the markdown table, the headline comparison and the figure,
rebuilt from the results JSON alone (every number in a report traces to the file)."""

from __future__ import annotations

import json
import math
import os

import numpy as np

FLAT = "Fathom"  # the family of flat Fathom budgets: every "vs flat" number compares with it
# Rows compared with flat Fathom at equal bits in their own section (the allocations beyond the paper's).
ALLOCATION_FAMILIES = ("Fathom per-layer", "Fathom bits as read", "Fathom observed errors", "Fathom observed, exact plan",
                       "Fathom tuned", "Fathom session-tuned")
SE_BLOCK = 8  # consecutive decode positions per block of the standard errors (neighbours share their context)


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


def flat_excess(results: dict, bits: float, k: str) -> float | None:
    """Flat Fathom's excess error at ``bits`` bits per token: log-log interpolation between its two budgets
    around ``bits`` (None outside their range or without an oracle)."""
    flat = sorted((r for r in results["rows"] if r["family"] == FLAT and "excess" in r), key=lambda r: r["bits"])
    xs = [r["bits"] for r in flat]
    if len(flat) < 2 or not xs[0] <= bits <= xs[-1]:
        return None
    ys = [r["excess"][k] for r in flat]
    if min(ys) <= 0:
        return float(np.interp(bits, xs, ys))
    return float(math.exp(np.interp(math.log(bits), np.log(xs), np.log(ys))))


def _block_means(x: np.ndarray) -> np.ndarray:
    n = len(x) // SE_BLOCK * SE_BLOCK
    return x[:n].reshape(-1, SE_BLOCK).mean(axis=1) if n >= 2 * SE_BLOCK else x


def paired(results: dict, row: dict, flat: dict, k: str) -> dict:
    """``row`` against the flat Fathom row ``flat`` at selection size k: both excess errors, their ratio and the
    error gap ``flat - row``, with standard errors over blocks of :data:`SE_BLOCK` decode positions (the ratio's
    by the delta method). No standard errors without per-position errors in the file."""
    oracle = next(r for r in results["rows"] if r["kind"] == "exact")
    out = {"row": row["excess"][k], "flat": flat["excess"][k]}
    out["ratio"] = out["row"] / out["flat"] if out["flat"] > 0 else float("nan")
    out["gap"] = flat["error"][k] - row["error"][k]
    if all("error_per_position" in r for r in (row, flat, oracle)):
        e = {name: np.asarray(r["error_per_position"][k], np.float64) for name, r in
             (("row", row), ("flat", flat), ("oracle", oracle))}
        a, b = e["row"] - e["oracle"], e["flat"] - e["oracle"]
        blocks = len(_block_means(a))
        out["ratio_se"] = float(np.std(_block_means(a - out["ratio"] * b), ddof=1) / math.sqrt(blocks) / b.mean())
        out["gap_se"] = float(np.std(_block_means(e["flat"] - e["row"]), ddof=1) / math.sqrt(blocks))
    return out


def equal_bits(meta: dict) -> float:
    """How far apart two rows' bits may be and still count as equal: 1 bit per 64 channels of the head (1 bit at
    SmolLM2's D = 64, 4 at Gemma 3's D = 256), the same share of a budget scaled with D."""
    return max(1.0, meta.get("head_dim", 64) / 64)


def allocation_lines(results: dict) -> list[str]:
    """Every allocation row against the flat Fathom row nearest in bits (within :func:`equal_bits`), at every k."""
    flat = [r for r in results["rows"] if r["family"] == FLAT]
    tolerance = equal_bits(results["meta"])
    has_oracle = any(r["kind"] == "exact" for r in results["rows"])
    lines = []
    for row in sorted((r for r in results["rows"] if r["family"] in ALLOCATION_FAMILIES), key=lambda r: r["bits"]):
        near = min(flat, key=lambda f: abs(f["bits"] - row["bits"]), default=None)
        if near is None or abs(near["bits"] - row["bits"]) > tolerance or not has_oracle:
            continue
        parts = []
        for k in (str(k) for k in results["meta"]["ks"]):
            p = paired(results, row, near, k)
            se = f" ± {p['ratio_se']:.2f}" if "ratio_se" in p else ""
            gap_se = f" ± {p['gap_se']:.4f}" if "gap_se" in p else ""
            parts.append(f"k={k}: excess {p['row']:.4f} vs {p['flat']:.4f}, ratio {p['ratio']:.2f}{se} "
                         f"(error gap {p['gap']:+.4f}{gap_se})")
        lines.append(f"{row['name']} ({row['bits']:.1f} bits) vs {near['name']} ({near['bits']:.1f} bits): "
                     + "; ".join(parts))
    return lines
def _layers(meta: dict) -> str:
    """The layers the study scanned: every layer, or (Gemma 3) the global layers, named."""
    ids, of = meta.get("captured_layers"), meta.get("model_layers")
    if ids is None or of is None or len(ids) == of:
        return f"{meta['layers']} layers"
    window = meta.get("sliding_window")
    rest = f"; the other {of - len(ids)} attend a {window}-token window and hold no long cache" if window else ""
    return (f"{meta['layers']} layers (the model's global layers: layers {', '.join(map(str, ids))} of {of}, counted "
            f"from 0{rest})")


def render_markdown(results: dict) -> str:
    meta = results["meta"]
    ks = [str(k) for k in meta["ks"]]
    out = [
        f"# Attention-output error vs scan bits: {meta.get('model', 'model')}",
        "",
        f"- context {meta['context']} tokens, last {meta['positions']} positions, {_layers(meta)}, "
        f"D = {meta['head_dim']}; selection: 4 sink + 32 local + top-(k-36) per query head; k = {', '.join(ks)}",
        f"- calibration text: {meta.get('calib_text', {}).get('kind', '?')}; evaluation text: "
        f"{meta.get('eval_text', {}).get('kind', '?')} (disjoint)",
        f"- {meta['date']}, {meta['machine']}, JAX {meta['jax']}",
        f"- D = {meta['head_dim']}, not the paper's 128: the paper's settings run as the same fractions of D "
        f"(SparQ r = D/8 and D/4, Double Sparsity c = D/4, Loki r = D/4 and D/2; Fathom budgets in code bits, "
        f"the study's grid at D = 128 scaled to D).",
        "- bits: per token per KV head per layer (code bits + 16 bits per 64 tokens per channel read); "
        "excess: error minus the exact top-k oracle's; vs flat: excess over flat Fathom's at the same bits "
        "(log-log interpolation between its budgets).",
        "",
        "| method | calib | bits | " + " | ".join(f"err k={k}" for k in ks) + " | " + " | ".join(f"excess k={k}" for k in ks)
        + " | " + " | ".join(f"vs flat k={k}" for k in ks) + " |",
        "|---|---|---:|" + "---:|" * (3 * len(ks)),
    ]
    for r in sorted(results["rows"], key=lambda r: (r["family"] != "oracle", r["bits"])):
        errs = " | ".join(f"{r['error'][k]:.4f}" for k in ks)
        exc = " | ".join(f"{r.get('excess', {}).get(k, float('nan')):+.4f}" for k in ks)
        ref = [flat_excess(results, r["bits"], k) if "excess" in r else None for k in ks]
        vs = " | ".join("" if f is None or f <= 0 else f"{r['excess'][k] / f:.2f}" for k, f in zip(ks, ref))
        out.append(f"| {r['name']} | {r['calibration']} | {r['bits']:.1f} | {errs} | {exc} | {vs} |")
    if results.get("layer_plans"):
        out += ["", "Per-layer budgets (greedy plan on the calibration capture):", ""]
        for mean, b in results["layer_plans"].items():
            out.append(f"- mean {mean}: {b}")
    if results.get("basis_rule"):
        br = results["basis_rule"]
        out += ["", f"Basis rule (calibration text, k={br['k']}, budgets {br['budgets']}): raw {['%.4f' % e for e in br['raw']]}, "
                f"KLT {['%.4f' % e for e in br['klt']]} -> **{br['basis']}**"]
    for source, tuned in (results.get("tuning") or {}).items():
        first, last, count = tuned["positions"]
        where = (f"the calibration capture ({count} positions {first}-{last})" if source == "calibration" else
                 f"the session ({count} evaluation-window positions {first}-{last}, before the evaluated ones)")
        out += ["", f"Budgets tuned with optax on {where}, k={tuned['tables']['k']}, grid {tuned['tables']['grid']}. "
                "The surrogate (the error measured there, interpolated between grid budgets) against the error "
                "measured on the evaluation text at the tuned budgets, over (layer, KV head): its level, and the "
                "change from the uniform budget (fathom_bits:MEAN:observed):", ""]
        for mean, t in tuned["means"].items():
            b = np.asarray(t["budgets"])
            line = f"- mean {mean}: budgets {b.min():g}-{b.max():g} bits (mean {b.mean():.2f})"
            if "surrogate" in t:
                sur = t["surrogate"]
                line += (f"; Pearson r = {sur['pearson']:.3f} (level), {sur['pearson_change']:.3f} (change); mean "
                         f"change predicted {sur['predicted_change']:+.4f}, measured {sur['measured_change']:+.4f}")
            out.append(line)
    lines = allocation_lines(results)
    if lines:
        tolerance = equal_bits(meta)
        within = f"{tolerance:g} bit" + ("s" if tolerance != 1 else "")
        out += ["", f"Allocations vs flat Fathom at equal bits (within {within}; excess ratio and error gap ± standard "
                f"error over blocks of {SE_BLOCK} decode positions):", ""] + [f"- {line}" for line in lines]
    lines = headline(results)
    if lines:
        out += ["", "Fathom vs SparQ at equal or fewer bits:", ""] + [f"- {line}" for line in lines]
    return "\n".join(out) + "\n"


def plot_ks(results: dict) -> list[str]:
    """The selection sizes of a results file, ascending (the panels' order)."""
    return sorted((str(k) for k in results["meta"]["ks"]), key=int)


def figure(results: dict):
    """The error-vs-bits figure: one panel per k (ascending), log-log axes with plain-number ticks, the
    legend in its own column right of the panels so that no point hides behind it; below each, the excess
    error of every row over flat Fathom's at the same bits (:func:`flat_excess`; 1 is flat Fathom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    meta = results["meta"]
    ks = plot_ks(results)
    fig, axes = plt.subplots(2, len(ks), figsize=(4.6 * len(ks) + 2.2, 7.6), squeeze=False,
                             gridspec_kw={"height_ratios": (4.2, 3.0)})
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
        # Plain numbers on both log axes: powers of two for bits, 1-2-3-5 steps for the error.
        ax.xaxis.set_major_locator(ticker.LogLocator(base=2))
        ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%.2g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("scan bits per token (per KV head, per layer)")
        ax.set_ylabel("attention-output relative L2 error")
        ax.set_title(f"k = {k}")
        ax.grid(True, which="both", alpha=0.3)
    for ax, k in zip(axes[1], ks):
        _ratio_panel(ax, results, families, k, colors, markers)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle(f"{meta.get('model', '')}: {meta['context']} tokens, {meta['date']}")
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / fig.get_figwidth(), 1))
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1 - 1.95 / fig.get_figwidth(), 0.5), fontsize=7,
               frameon=False)
    return fig


def _ratio_panel(ax, results, families, k, colors, markers) -> None:
    """Excess error over flat Fathom's at the same bits, for every row in flat Fathom's range of bits."""
    from matplotlib import ticker

    for i, (fam, rows) in enumerate(families.items()):
        if fam in ("oracle", FLAT):
            continue
        points = sorted((r["bits"], r["excess"][k] / f) for r in rows if "excess" in r
                        for f in [flat_excess(results, r["bits"], k)] if f is not None and f > 0)
        if points:
            line = "-" if fam.startswith("Fathom") and len(points) > 1 else ""
            ax.plot(*zip(*points), line + markers[i % len(markers)], color=colors[(2 * i) % 20 + (i // 10) % 2], ms=5)
    ax.axhline(1.0, color="k", lw=1, label="flat Fathom")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(ticker.LogLocator(base=2))
    ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.set_xlabel("scan bits per token (per KV head, per layer)")
    ax.set_ylabel("excess error / flat Fathom's at equal bits")
    ax.set_title(f"k = {k}: vs flat Fathom")
    ax.grid(True, which="both", alpha=0.3)


def plot(results: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_report(results: dict, prefix: str, markdown: str, draw) -> list[str]:
    """Write ``prefix.json`` (the results), ``prefix.md`` (``markdown``) and ``prefix.png`` (``draw(results,
    path)``); return the paths. Every evaluation's report is written this way."""
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    paths = [prefix + ".json", prefix + ".md", prefix + ".png"]
    with open(paths[0], "w") as f:
        json.dump(results, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown)
    draw(results, paths[2])
    return paths


def write_report(results: dict, prefix: str) -> list[str]:
    """Write the study's ``prefix.json``, ``prefix.md`` and ``prefix.png``; return the paths."""
    return save_report(results, prefix, render_markdown(results), plot)
