"""Reports of the error-vs-bits study: the markdown table, the headline comparison and the figure,
rebuilt from the results JSON alone (every number in a report traces to the file)."""

from __future__ import annotations

import json
import os


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


def plot_ks(results: dict) -> list[str]:
    """The selection sizes of a results file, ascending (the panels' order)."""
    return sorted((str(k) for k in results["meta"]["ks"]), key=int)


def figure(results: dict):
    """The error-vs-bits figure: one panel per k (ascending), log-log axes with plain-number ticks, the
    legend in its own column right of the panels so that no point hides behind it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    meta = results["meta"]
    ks = plot_ks(results)
    fig, axes = plt.subplots(1, len(ks), figsize=(4.6 * len(ks) + 2.2, 4.2), squeeze=False)
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
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle(f"{meta.get('model', '')}: {meta['context']} tokens, {meta['date']}")
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / fig.get_figwidth(), 1))
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1 - 1.95 / fig.get_figwidth(), 0.5), fontsize=7,
               frameon=False)
    return fig


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
