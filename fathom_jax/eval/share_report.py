"""Reports of the shared-selection study (:mod:`~fathom_jax.eval.share_run`): markdown tables and the figure, rebuilt
from the results JSON alone."""

from __future__ import annotations

import numpy as np

TARGET = 1.15  # the target: within +15% of per-layer selection's error at the same k


def _f(x, fmt="{:.3f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def best_ranking(res: dict) -> str:
    """The ranking whose rules err least: geometric mean of the scan's ratios over every rule and budget."""
    scan = res["baseline"]["method"]
    means = {}
    for r in res["rules"]:
        if r["scan"] == scan:
            means.setdefault(r["ranking"], []).append(np.log(r["ratio"]))
    return min(means, key=lambda name: np.mean(means[name]))


def _rows(res: dict, scan: str, ranking: str) -> list[dict]:
    return sorted((r for r in res["rules"] if r["scan"] == scan and r["ranking"] == ranking),
                  key=lambda r: (r["budget"], r["bits"], r["rule"]))


def render_markdown(res: dict) -> str:
    meta, base = res["meta"], res["baseline"]
    m = meta["machine"]
    where = f"{m['host']} ({m['backend']}, {m['cpus']} cores), commit {m['commit']}" if isinstance(m, dict) else m
    cfg = meta["config"]
    best = best_ranking(res)
    topk = ("; each sharing head attends only its own top-k of the set by exact score (`attend=topk`)"
            if cfg.get("attending", "all") == "topk" else "")
    lines = [f"# Selection shared across layers: {meta['model'].split(' (')[0]}, {meta['context']} tokens", "",
             f"{meta['date']}, {where}, JAX {meta['jax']}; command `{meta.get('command')}`; "
             f"{meta.get('wall_seconds_with_captures', meta['wall_seconds'])} s with the captures. "
             f"{meta['model']}: scanning layers {meta['scanning_layers']} of {meta['model_layers']}, "
             f"{meta['heads']} heads / {meta['kv_heads']} KV heads, D = {meta['head_dim']}. The error study's "
             f"protocol: {meta['context']} tokens of standard-library code, positions {meta['positions'][0]}-"
             f"{meta['positions'][1]}, calibrated on as many tokens of pydoc prose; each layer's own captured "
             "queries (no error carried between layers); error = mean over positions, scanning layers and heads of "
             "||o - o_dense|| / ||o_dense||.", "",
             f"Rules: selection layers scan with {base['method']} and attend their own top-k = {base['k']} per head "
             "(sink 4 + local 32 included); every layer after one, up to the next, attends that layer's shared set "
             "with every head: the union of its heads' choices ranked and cut to the budget (positions, sink and "
             f"local included){topk}. `chosen N`: the N selection layers with the least error on the calibration capture "
             f"({cfg['calib_positions']} positions; a dynamic program over the pair errors). Rows: rows fetched per KV "
             "head per step (mean over layers); bits: scan bits per token per KV head per step (mean over layers; "
             "a sharing layer reads none); link MB: planes and bf16 rows one step moves at this context, every "
             "layer and KV head (at 1M: the same bits per token and rows at 2^20 positions, a projection). Ratios "
             "are the rule's error over per-layer selection's (± standard error over blocks of 8 positions); "
             f"`same rows` / `same bits`: over per-layer {base['method']} given the rule's rows (its k raised) or the "
             "rule's bits (its budget lowered), interpolated over measured grids (n/a: outside them).", "",
             "## Per-layer selection (the baseline)", "",
             f"{base['method']} at k = {base['k']}: error {base['error']:.4f}, {base['bits']:.1f} bits per token per "
             f"layer, {base['rows']:.0f} rows per KV head per layer, {base['link_mb']:.2f} MB per step "
             f"({base['link_mb_1m']:.0f} at 1M). "
             f"Grids: k = " + ", ".join(f"{g['k']} ({g['rows']:.0f} rows, {g['error']:.4f})" for g in base["row_grid"])
             + "; budgets " + ", ".join(f"{g['budget']} ({g['bits']:.1f} bits, {g['error']:.4f})"
                                        for g in sorted(base["bits_grid"], key=lambda g: g["bits"])) + ".", ""]
    if "reference" in base:
        lines += [f"The exact top-k oracle per layer: error {base['reference']['error']:.4f}.", ""]
    if meta.get("skipped_rules"):
        lines += ["Rules not run: " + "; ".join(f"`{rule}` ({why})" for rule, why in meta["skipped_rules"].items())
                  + ".", ""]
    lines += ["## Rankings of the shared set", "",
              "Geometric mean of the ratio to per-layer selection over every rule, per budget:", "",
              "| ranking | " + " | ".join(f"budget {b}" for b in cfg["budgets"]) + " | all |",
              "|---|" + "---|" * (len(cfg["budgets"]) + 1)]
    for ranking in cfg["rankings"]:
        cells = []
        for budget in (*cfg["budgets"], None):
            ratios = [r["ratio"] for r in res["rules"] if r["scan"] == base["method"] and r["ranking"] == ranking
                      and (budget is None or r["budget"] == budget)]
            cells.append(f"{np.exp(np.mean(np.log(ratios))):.3f}")
        lines.append(f"| {ranking}{' (best)' if ranking == best else ''} | " + " | ".join(cells) + " |")
    lines += ["", f"## Every rule ({base['method']}, ranking `{best}`)", "",
              "| budget | rule | selection layers | error | ratio (same k) | rows / KV head | bits / step | link MB | "
              "link MB at 1M | ratio (same rows) | ratio (same bits) |", "|---|" + "---|" * 10]
    for r in _rows(res, base["method"], best):
        ratio = f"{r['ratio']:.3f} ± {r['ratio_se']:.3f}"
        ratio = f"**{ratio}**" if r["ratio"] <= TARGET else ratio
        lines.append(f"| {r['budget']} | {r['rule']} | {_layers(r['layers'])} | {r['error']:.4f} | {ratio} | "
                     f"{r['rows']:.0f} | "
                     f"{r['bits']:.1f} | {r['link_mb']:.2f} | {r['link_mb_1m']:.0f} | "
                     f"{_f(r.get('equal_rows_ratio'))} | "
                     f"{_f(r.get('equal_bits_ratio'))} |")
    lines += ["", "Bold: within the issue's +15% of per-layer selection at the same k.", ""]
    ref_rows = [r for r in res["rules"] if r["scan"] != base["method"] and r["ranking"] == best]
    if ref_rows:
        lines += [f"## The oracle's scores shared ({ref_rows[0]['scan']}, ranking `{best}`)", "",
                  "What sharing costs with no scan error: the exact top-k at selection layers, its shared set at the "
                  "others, against the per-layer oracle.", "", "| budget | rule | error | ratio (same k) | rows |",
                  "|---|---|---|---|---|"]
        for r in sorted(ref_rows, key=lambda r: (r["budget"], r["bits"], r["rule"])):
            lines.append(f"| {r['budget']} | {r['rule']} | {r['error']:.4f} | {r['ratio']:.3f} ± {r['ratio_se']:.3f} "
                         f"| {r['rows']:.0f} |")
        lines.append("")
    lines += _per_layer_table(res, best) + _overlap_table(res, best)
    return "\n".join(lines) + "\n"


def _layers(layers: list[int]) -> str:
    return ",".join(map(str, layers)) if len(layers) <= 8 else f"{len(layers)} layers"


def _per_layer_table(res: dict, best: str) -> list[str]:
    base = res["baseline"]
    budgets = res["meta"]["config"]["budgets"]
    budget = budgets[len(budgets) // 2]
    rules = [r for r in _rows(res, base["method"], best) if r["budget"] == budget]
    lines = [f"## Per layer (ranking `{best}`, budget {budget}): error / per-layer selection's", "",
             "| layer | per-layer error | " + " | ".join(r["rule"] for r in rules) + " |",
             "|---|---|" + "---|" * len(rules)]
    for i, layer in enumerate(res["meta"]["scanning_layers"]):
        own = base["error_per_layer"][i]
        cells = [("**" if layer in r["layers"] else "") + f"{r['error_per_layer'][i] / own:.2f}"
                 + ("**" if layer in r["layers"] else "") for r in rules]
        lines.append(f"| {layer} | {own:.4f} | " + " | ".join(cells) + " |")
    return lines + ["", "Bold: the rule's selection layers (their own selection: 1.00).", ""]


def _overlap_table(res: dict, best: str) -> list[str]:
    budgets = list(res["overlap"])
    first = res["overlap"][budgets[0]]
    shared = {b: res["overlap"][b]["in_shared"].get(best) for b in budgets}
    lines = ["## What consecutive layers choose alike", "",
             "Per layer l, of its middle tokens (past the sink, before the local window): `same head` the share of a "
             "head's top-k inside the same-numbered head's top-k of layer l - 1; `union` the share of the layer's "
             "union (every head) inside layer l - 1's union; `in shared (B)` the share of each head's exact top-k "
             f"(what it needs) inside layer l - 1's shared set of B positions (ranking `{best}`).",
             "", "| layer | same head | union | " + " | ".join(f"in shared ({b})" for b in budgets) + " |",
             "|---|---|---|" + "---|" * len(budgets)]
    for i, layer in enumerate(res["meta"]["scanning_layers"][1:]):
        cells = [f"{shared[b][i]:.2f}" if shared[b] else "n/a" for b in budgets]
        lines.append(f"| {layer} | {first['same_head'][i]:.2f} | {first['union'][i]:.2f} | " + " | ".join(cells)
                     + " |")
    means = [f"{np.mean(shared[b]):.2f}" if shared[b] else "n/a" for b in budgets]
    lines.append(f"| mean | {np.mean(first['same_head']):.2f} | {np.mean(first['union']):.2f} | "
                 + " | ".join(means) + " |")
    return lines + [""]


def plot(res: dict, path: str) -> None:
    """Error against bits read per step and against link bytes per step, at this context and projected to 1M
    (per-layer selection's curves, the rules' points by budget, the middle budget's named); each layer's error under
    the best cheap rules; the consecutive layers' overlap; every (selection, sharing) pair's error ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    base, best = res["baseline"], best_ranking(res)
    rows = _rows(res, base["method"], best)
    budgets = res["meta"]["config"]["budgets"]
    middle = budgets[len(budgets) // 2]
    colors = dict(zip(budgets, plt.get_cmap("viridis")(np.linspace(0.1, 0.8, len(budgets)))))
    fig, axes = plt.subplots(2, 3, figsize=(19, 10))
    bits_grid = sorted(base["bits_grid"], key=lambda g: g["bits"])
    for ax, x_key, label in ((axes[0, 0], "bits", "scan bits per token per KV head, mean over layers"),
                             (axes[0, 1], "link_mb", "MB one step moves at this context (planes + bf16 rows)"),
                             (axes[0, 2], "link_mb_1m", "MB at 1M: the same bits per token and rows (projection)")):
        ax.plot([g[x_key] for g in bits_grid], [g["error"] for g in bits_grid], "k-o", ms=4,
                label=f"per-layer, budgets {bits_grid[0]['budget']}-{bits_grid[-1]['budget']} (k = {base['k']})")
        if x_key != "bits":
            ax.plot([g[x_key] for g in base["row_grid"]], [g["error"] for g in base["row_grid"]], "k--s", ms=4,
                    label=f"per-layer {base['method']}, k = {base['row_grid'][0]['k']}-{base['row_grid'][-1]['k']}")
        for budget in budgets:
            pts = [r for r in rows if r["budget"] == budget]
            ax.scatter([r[x_key] for r in pts], [r["error"] for r in pts], color=colors[budget], s=22, zorder=3,
                       label=f"shared, budget {budget}")
            for r in pts if budget == middle else ():
                ax.annotate(r["rule"], (r[x_key], r["error"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
        ax.axhline(TARGET * base["error"], color="r", ls=":", lw=1, label=f"+15% of per-layer {base['method']}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis, subs in ((ax.xaxis, (1.0, 2.0, 5.0)), (ax.yaxis, (1.0, 1.5, 2.0, 3.0, 5.0, 7.0))):
            axis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
            axis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            axis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel(label)
        ax.set_ylabel("attention-output error")
        ax.legend(fontsize=7)
    ax = axes[1, 0]
    layers = res["meta"]["scanning_layers"]
    ax.plot(layers, base["error_per_layer"], "k-o", ms=3, label=f"per-layer {base['method']}")
    cheap = [r for r in rows if r["budget"] == middle and r["selecting"] <= 4]
    for r in sorted(cheap, key=lambda r: r["ratio"])[:4]:
        ax.plot(layers, r["error_per_layer"], "-", marker=".", label=f"{r['rule']} ({_layers(r['layers'])})")
    ax.set_xlabel("layer")
    ax.set_ylabel("error")
    ax.set_title(f"per layer: the best rules of at most 4 selection layers, budget {middle}", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1, 1]
    ov = res["overlap"]
    ax.plot(layers[1:], ov[str(budgets[0])]["same_head"], "-o", ms=3, label="same head in layer l-1's head")
    ax.plot(layers[1:], ov[str(budgets[0])]["union"], "-o", ms=3, label="union in layer l-1's union")
    for b in budgets:
        if ov[str(b)]["in_shared"].get(best):
            ax.plot(layers[1:], ov[str(b)]["in_shared"][best], "--", color=colors[b],
                    label=f"exact top-k in layer l-1's shared set ({b})")
    ax.set_ylim(0, 1)
    ax.set_xlabel("layer l")
    ax.set_ylabel("share of middle tokens")
    ax.legend(fontsize=7)
    ax = axes[1, 2]
    pair = np.array([[np.nan if x is None else x for x in row] for row in res["pair"][best][str(middle)]])
    image = ax.imshow(np.log2(pair / np.asarray(base["error_per_layer"])[None, :]), cmap="RdBu_r", vmin=-2, vmax=2,
                      origin="lower")
    ticks = range(0, len(layers), max(1, len(layers) // 8))
    ax.set_xticks(list(ticks), [layers[i] for i in ticks])
    ax.set_yticks(list(ticks), [layers[i] for i in ticks])
    ax.set_xlabel("sharing layer l")
    ax.set_ylabel("selection layer s")
    ax.set_title(f"log2(error of l attending s's set / l's own), budget {middle}", fontsize=9)
    fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(f"Selection shared across layers: {res['meta']['model'].split(' (')[0]}, {res['meta']['context']} "
                 f"tokens, ranking {best}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
