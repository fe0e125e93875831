"""Reports of the downstream sweeps (RULER-style tasks, step agreement): markdown tables and figures rebuilt
from the results JSON alone, so every number in a report traces to the file."""

from __future__ import annotations

import numpy as np

from fathom_jax.eval.agreement import step_agreement
from fathom_jax.eval.downstream import branch_key, mean_se, paired
from fathom_jax.eval.report import save_report

_ORDER = {"dense": 0, "exact": 1}


def _sorted(entries):
    return sorted(entries, key=lambda e: (_ORDER.get(e["kind"], 2), e["bits"], e["label"]))


def _is_oracle(e: dict) -> bool:
    """The exact top-k oracle with the model's rows: the reference of every comparison."""
    return e["kind"] == "exact" and not e.get("rows")


def _pm(mean: float, se: float, digits: int = 3) -> str:
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def _signed(d: dict, digits: int = 3) -> str:
    return f"{d['mean']:+.{digits}f} ± {d['se']:.{digits}f}"


def _provenance(meta: dict) -> list[str]:
    cfg = meta["config"]
    lines = [f"- {meta['date']}, {meta['machine']}, JAX {meta['jax']}, commit {meta.get('commit')}; "
             f"wall time {meta['wall_s']:.0f} s (prefill {meta['prefill_s']:.0f} s, decoding {meta['decode_s']:.0f} s)"]
    if meta.get("command"):
        lines.append(f"- command: `{meta['command']}`")
    forced = ", ".join(f"k = {k}: {s} sink + {l} local" for k, (s, l) in meta["forced_tokens"].items())
    lines.append(f"- selection per query head: sink + local + the top-(k - forced) by the scan's score ({forced}); "
                 f"the same k for every method; decoding in f32 with the jnp reference scan")
    lines.append(f"- calibration: {cfg['calibration']} (corpus: {meta['calib_text']['tokens']} tokens of "
                 f"{meta['calib_text']['kind']}); bits per token per KV head per layer, measured on that text "
                 f"(code bits + 16 bits per 64 tokens per channel read)")
    return lines


# ----------------------------------------------------------------------------------------------
# RULER


def _repeats(haystack: dict, prompt_tokens: int) -> str:
    """Where the prompt is longer than one pass over the text, how often the haystack goes round it."""
    tokens = haystack.get("tokens")
    if not tokens or prompt_tokens <= tokens:
        return ""
    return f" ({tokens} tokens, repeated to fill the prompt as RULER repeats its essays: {prompt_tokens / tokens:.2f} passes)"


def ruler_summary(results: dict) -> dict:
    """Per branch: pooled mean ± s.e., per-task means, paired difference against the oracle at its k."""
    tasks = [s["task"] for s in results["samples"]]
    names = list(dict.fromkeys(tasks))
    by_key = {e["key"]: e for e in results["branches"]}
    out = {}
    for e in results["branches"]:
        s = np.asarray(e["scores"])
        row = {"mean_se": mean_se(s),
               "tasks": {t: mean_se(s[[i for i, x in enumerate(tasks) if x == t]]) for t in names}}
        ks = [e["k"]] if e["k"] is not None else sorted({b["k"] for b in results["branches"] if b["k"] is not None})
        row["vs_oracle"] = {str(k): paired(s, by_key[f"exact@{k}"]["scores"]) for k in ks}
        out[e["key"]] = row
    return out


def render_ruler(results: dict) -> str:
    meta, cfg = results["meta"], results["meta"]["config"]
    summary = ruler_summary(results)
    tasks = list(dict.fromkeys(s["task"] for s in results["samples"]))
    n = len(results["samples"])
    ks = sorted({e["k"] for e in results["branches"] if e["k"] is not None})
    dense = next(e for e in results["branches"] if e["kind"] == "dense")
    out = [
        f"# RULER-style tasks: {meta['model']}, {cfg['context']} tokens",
        "",
        f"- {len(tasks)} tasks x {cfg['per_task']} samples = {n} prompts of {cfg['context'] - 64} tokens "
        f"(plain completions with RULER's templates, no chat template), needles at random depths in "
        f"[0.05, 0.95] of a haystack of {meta['haystack']['kind']}{_repeats(meta['haystack'], cfg['context'] - 64)}; "
        f"greedy generation of "
        f"12 / 40 / 24 tokens; score = fraction of gold strings in the generation",
        "- one dense prefill per sample, then greedy decoding branched per method from the same KV cache, "
        "sparse attention on every generated token",
        *_provenance(meta),
        "- mean ± s.e. over the pooled per-sample scores; Δ oracle: paired difference against the exact top-k "
        "oracle at the same k (mean ± s.e. over samples)",
        "",
    ]
    head = "| method | bits | mean ± s.e. | Δ oracle | " + " | ".join(tasks) + " |"
    rule = "|---|---:|---:|---:|" + "---:|" * len(tasks)
    for k in ks:
        out += [f"## k = {k}", "", head, rule]
        rows = [dense] + _sorted([e for e in results["branches"] if e["k"] == k])
        for e in rows:
            s = summary[e["key"]]
            bits = "-" if e["kind"] in ("dense", "exact") else f"{e['bits']:.1f}"
            delta = "-" if _is_oracle(e) else _signed(s["vs_oracle"][str(k)])
            per_task = " | ".join(f"{s['tasks'][t][0]:.3f}" for t in tasks)
            out.append(f"| {e['label']} | {bits} | {_pm(*s['mean_se'])} | {delta} | {per_task} |")
        out.append("")
    out += ["## What the model solves and what separates the methods", ""]
    out += ["- dense attention per task: " + ", ".join(f"{t} {summary[dense['key']]['tasks'][t][0]:.3f}"
                                                       for t in tasks)]
    for k in ks:
        scans = [e for e in results["branches"] if e["k"] == k and e["kind"] not in ("exact", "landmark")]
        if scans:  # a run of dense attention and the oracle alone has no scans to range over
            ranges = (f"{t} {min(m):.3f}-{max(m):.3f}" for t in tasks
                      for m in [[summary[e["key"]]["tasks"][t][0] for e in scans]])
            out.append(f"- k = {k}, range of the per-token scans' task means: " + ", ".join(ranges))
        sep = [e for e in results["branches"] if e["k"] == k and not _is_oracle(e)
               and abs(summary[e["key"]]["vs_oracle"][str(k)]["mean"]) > 2 * summary[e["key"]]["vs_oracle"][str(k)]["se"]
               and summary[e["key"]]["vs_oracle"][str(k)]["se"] > 0]
        out.append(f"- k = {k}, methods more than 2 s.e. from the oracle (paired): "
                   + (", ".join(f"{e['label']} {_signed(summary[e['key']]['vs_oracle'][str(k)])}" for e in sep)
                      or "none"))
    return "\n".join(out) + "\n"


def plot_ruler(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = results["meta"]
    summary = ruler_summary(results)
    ks = sorted({e["k"] for e in results["branches"] if e["k"] is not None})
    dense = next(e for e in results["branches"] if e["kind"] == "dense")
    fig, axes = plt.subplots(1, len(ks), figsize=(6.2 * len(ks), 4.4), squeeze=False)
    for ax, k in zip(axes[0], ks):
        rows = [e for e in _sorted(results["branches"]) if e["k"] == k and e["kind"] != "exact"]
        oracle = next(e for e in results["branches"] if e["key"] == f"exact@{k}")
        x = np.arange(len(rows))
        m = [summary[e["key"]]["mean_se"][0] for e in rows]
        se = [summary[e["key"]]["mean_se"][1] for e in rows]
        ax.errorbar(x, m, yerr=se, fmt="o", capsize=3, color="tab:blue")
        ax.axhline(summary[dense["key"]]["mean_se"][0], ls="--", color="k", lw=1, label="dense")
        ax.axhline(summary[oracle["key"]]["mean_se"][0], ls=":", color="tab:red", lw=1.5, label="exact top-k oracle")
        ax.set_xticks(x, [f"{e['label']} ({e['bits']:.0f})" for e in rows], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("mean RULER-style score")
        ax.set_title(f"k = {k}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{meta['model']}: RULER-style tasks at {meta['config']['context']} tokens "
                 f"({len(results['samples'])} prompts), bits in parentheses")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Step agreement


def _with_dense(results: dict) -> dict[str, list[float]]:
    """Per branch: its step's agreement with the dense step, session by session (empty without a dense branch)."""
    dense = next((e for e in results["branches"] if e["kind"] == "dense"), None)
    if dense is None:
        return {}
    return {e["key"]: [step_agreement(step, ref) for step, ref in zip(e["generations"], dense["generations"],
                                                                        strict=True)]
            for e in results["branches"]}


def agreement_summary(results: dict) -> dict:
    """Per branch and k: agreement with the exact top-k step (mean ± s.e.), the paired difference against
    the baseline, and agreement with the real next span; where the run decoded dense attention, agreement with the
    dense step and its paired difference against the baseline (``vs_dense``, ``dense_vs_baseline``)."""
    cfg = results["meta"]["config"]
    by_key = {e["key"]: e for e in results["branches"]}
    with_dense = _with_dense(results)
    out = {}
    for e in results["branches"]:
        row = {"real": mean_se(e["real"]), "agreement": {}, "vs_baseline": {}}
        base_key = None
        for k, values in e["agreement"].items():
            row["agreement"][k] = mean_se(values)
            base = by_key.get(branch_key(cfg["baseline"], k, e.get("rows")))
            if base is not None:
                row["vs_baseline"][k] = paired(values, base["agreement"][k])
                base_key = base["key"]
        if with_dense:
            row["vs_dense"] = mean_se(with_dense[e["key"]])
            if base_key is not None and e["k"] is not None:
                row["dense_vs_baseline"] = paired(with_dense[e["key"]], with_dense[base_key])
        out[e["key"]] = row
    return out


def _dense_reference(results: dict, summary: dict, base: dict) -> list[str]:
    """The table of agreement with the dense step: the exact top-k step is the reference of the main table, but a
    method attending more than k positions per head (a selection shared across layers attends its whole budget)
    leans from it toward dense attention, the model as trained."""
    if "dense" not in summary or "vs_dense" not in summary["dense"]:
        return []
    out = ["", "## Agreement with the dense step", "",
           ("The same steps compared with the dense step instead of the exact top-k step: the reference for a method "
            f"that attends more positions than k per head. Δ: paired against {base['label']} at the same k "
            "(sessions better / equal / worse)."), "",
           f"| method | bits | agreement with dense | Δ {base['label']} |", "|---|---:|---:|---:|"]
    for e in _sorted(results["branches"]):
        if e["kind"] == "dense":
            continue
        s = summary[e["key"]]
        v = s.get("dense_vs_baseline")
        delta = "-" if v is None or e["spec"] == results["meta"]["config"]["baseline"] else \
            f"{_signed(v, 2)} ({v['wins']}/{v['ties']}/{v['losses']})"
        bits = "-" if e["kind"] == "exact" else f"{e['bits']:.1f}"
        out.append(f"| {e['label']}, k={e['k']} | {bits} | {_pm(*s['vs_dense'], 2)} | {delta} |")
    return out


def render_agreement(results: dict) -> str:
    meta, cfg = results["meta"], results["meta"]["config"]
    summary = agreement_summary(results)
    ks = [str(k) for k in meta["ks"]]
    base = next(e for e in results["branches"] if e["spec"] == cfg["baseline"])
    rows = sorted({e.get("rows") or "" for e in results["branches"] if e["kind"] != "dense"})
    rows_note = ([f"- K/V rows: {', '.join(r or 'the model dtype' for r in rows)}; a branch in a compressed format is "
                  "compared with the exact top-k step on the model's rows, its Δ with the baseline in the same format"]
                 if rows != [""] else [])
    packages = meta["sessions"]["packages"]
    out = [
        f"# Step agreement on code sessions: {meta['model']}, {cfg['context']} tokens",
        "",
        f"- {len(results['samples'])} sessions of {cfg['context'] - cfg['steps']} tokens, each a window of one "
        f"standard-library package's modules concatenated in order ({len(packages)} packages, at most "
        f"{meta['sessions']['max_per_package']} windows each, Python {meta['sessions']['python']}); every method "
        f"greedily decodes the next {cfg['steps']} tokens from the same prefill",
        "- step agreement: word-level sequence-match ratio (difflib) between a method's step and the exact "
        "top-k step at the same k; mean ± s.e. over sessions; Δ: paired difference against "
        f"{base['label']} (mean ± s.e., sessions better / equal / worse); real: ratio against the real next span",
        *rows_note,
        *_provenance(meta),
        "",
        "| method | bits | " + " | ".join(f"k={k} ({int(k) / cfg['context']:.1%}) | Δ {base['label']} k={k}"
                                          for k in ks) + " | real next span |",
        "|---|---:|" + "---:|---:|" * len(ks) + "---:|",
    ]
    dense = [e["key"] for e in results["branches"] if e["kind"] == "dense"]  # first, when the run has it
    for key in dense + [e["key"] for e in _sorted(results["branches"]) if e["kind"] != "dense"]:
        e = next(b for b in results["branches"] if b["key"] == key)
        s = summary[key]
        cells = []
        for k in ks:
            if k not in s["agreement"]:
                cells += ["", ""]
                continue
            v = s["vs_baseline"].get(k)
            delta = "-" if v is None or e["spec"] == cfg["baseline"] or e["kind"] == "dense" else \
                f"{_signed(v, 2)} ({v['wins']}/{v['ties']}/{v['losses']})"
            cells += [_pm(*s["agreement"][k], 2), delta]
        label = e["label"] if e["k"] is None else f"{e['label']}, k={e['k']}"
        bits = "-" if e["kind"] in ("dense", "exact") else f"{e['bits']:.1f}"
        out.append(f"| {label} | {bits} | " + " | ".join(cells) + f" | {_pm(*s['real'], 2)} |")
    out += ["", f"Each Fathom branch against {base['label']} (paired over sessions):", ""]
    fathoms = [e for e in results["branches"] if e["kind"] == "fathom"]
    by_key = {e["key"]: e for e in results["branches"]}
    for k in ks:
        for e in sorted((f for f in fathoms if str(f["k"]) == k), key=lambda f: (f["bits"], f.get("rows") or "")):
            other = by_key.get(branch_key(cfg["baseline"], k, e.get("rows")))  # the baseline in the same rows
            if other is None:
                continue
            v = summary[e["key"]]["vs_baseline"][k]
            out.append(f"- k={k}: {e['label']} ({e['bits']:.1f} bits) {_pm(*summary[e['key']]['agreement'][k], 2)} vs "
                       f"{other['label']} ({other['bits']:.1f} bits) "
                       f"{_pm(*summary[other['key']]['agreement'][k], 2)}: paired {_signed(v, 2)} "
                       f"({v['wins']} better, {v['ties']} equal, {v['losses']} worse)")
    out += _dense_reference(results, summary, base)
    return "\n".join(out) + "\n"


def plot_agreement(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = results["meta"]
    summary = agreement_summary(results)
    ks = [str(k) for k in meta["ks"]]
    fig, axes = plt.subplots(1, len(ks), figsize=(6 * len(ks), 4.4), squeeze=False)
    colors = {"fathom": "tab:blue", "sparq": "tab:orange", "double_sparsity": "tab:green", "loki": "tab:purple",
              "thumbnail": "tab:brown", "landmark": "tab:gray"}
    for ax, k in zip(axes[0], ks):
        for e in results["branches"]:
            if str(e["k"]) != k or e["kind"] in ("exact", "dense"):
                continue
            m, se = summary[e["key"]]["agreement"][k]
            ax.errorbar([e["bits"]], [m], yerr=[se], fmt="o", capsize=3, color=colors.get(e["kind"], "k"))
            ax.annotate(e["label"], (e["bits"], m), fontsize=6, xytext=(3, 3), textcoords="offset points")
        dense = summary["dense"]["agreement"].get(k) if "dense" in summary else None
        if dense:
            ax.axhline(dense[0], ls="--", color="k", lw=1, label="dense vs exact top-k")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("scan bits per token (per KV head, per layer)")
        ax.set_ylabel("step agreement with exact top-k")
        ax.set_title(f"k = {k} ({int(k) / meta['config']['context']:.1%} of the context)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{meta['model']}: {len(results['samples'])} code sessions of {meta['config']['context']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render_markdown(results: dict) -> str:
    return render_ruler(results) if results["kind"] == "ruler" else render_agreement(results)


def plot(results: dict, path: str) -> None:
    (plot_ruler if results["kind"] == "ruler" else plot_agreement)(results, path)


def write_report(results: dict, prefix: str) -> list[str]:
    """Write ``prefix.json``, ``prefix.md`` and ``prefix.png``; return the paths."""
    return save_report(results, prefix, render_markdown(results), plot)
