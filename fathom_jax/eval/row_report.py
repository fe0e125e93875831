"""The row-format study's report: tables and the bytes-versus-added-error figure, from the results JSON alone.

Added error of a format = its attention error minus the bf16 rows' (today's rows), for the same method, k and
context; relative: divided by the bf16 rows' error. The target (issue 32): at most +10% on Fathom 48 at
k = 128 at every context, at most 340 host bytes per token per layer and KV head at Dh = 128.
"""

from __future__ import annotations

import json
import os
from typing import Any

TARGET_METHOD = "Fathom 48"
ORACLE = "exact top-k oracle"
SHORT = {TARGET_METHOD: "F48", ORACLE: "oracle"}
TARGET_K = "128"
TARGET_RELATIVE = 0.10
TARGET_BYTES_DH128 = 340.0
BASE = "bf16"


def relative_added(run: dict, method: str, spec: str, k: str) -> float:
    base = run["error"][method][BASE][k]
    return run["error"][method][spec][k] / base - 1.0


def meets_target(results: dict, spec: str) -> bool:
    runs = results["runs"]
    f = runs[0]["formats"][spec]
    if any(TARGET_METHOD not in run["error"] for run in runs):
        return False
    if f["bytes_per_token_dh128"] is None or f["bytes_per_token_dh128"] > TARGET_BYTES_DH128:
        return False
    return all(relative_added(run, TARGET_METHOD, spec, TARGET_K) <= TARGET_RELATIVE for run in runs)


def _specs(run: dict) -> list[str]:
    return [s for s in run["formats"] if s != "f32"]


def _method_mean(run: dict, spec: str, k: str) -> float:
    """Mean over the run's methods of the relative added error (how a format treats every selection)."""
    vals = [relative_added(run, m["name"], spec, k) for m in run["methods"]]
    return sum(vals) / len(vals)


def render_markdown(results: dict) -> str:
    meta, runs = results["meta"], results["runs"]
    d = runs[0]["head_dim"]
    out = [
        f"# K/V row formats: host bytes per token vs attention error ({meta.get('model', 'model')})",
        "",
        f"- {meta['date']}, {meta['machine']}, JAX {meta['jax']}, commit {meta.get('commit')}",
        f"- command: `{meta.get('command', '?')}`",
        f"- protocol of `fathom sweep`: calibration text {meta.get('calib_text', {}).get('kind', '?')}, evaluation "
        f"text {meta.get('eval_text', {}).get('kind', '?')}; last {runs[0]['positions']} positions, every layer "
        "and head; each method selects 4 sink + 32 local + top-(k-36) from the keys as captured; attention runs "
        "over the selected rows as each format decodes them, against dense attention over the captured f32 rows.",
        f"- bytes: host bytes per token per layer and KV head: the row, K block scales, and the key index's planes "
        f"and scales (4 Dh/8 + 2 Dh/64). SmolLM2 has Dh = {d}; `B@128` is the same format at Dh = 128 "
        "(bf16 rows: 580). `f32`: the captured rows (the study's own numbers); `bf16`: today's rows.",
        f"- added: relative to the bf16 rows' error, same method, k and context. Target: <= "
        f"+{TARGET_RELATIVE:.0%} on {TARGET_METHOD} at k = {TARGET_K} at every context, <= "
        f"{TARGET_BYTES_DH128:.0f} B@128.",
        "",
    ]
    for run in runs:
        ks = [str(k) for k in run["ks"]]
        ctx = run["context"]
        out += [f"## {ctx} tokens ({run['wall_seconds']:.0f} s)", "",
                f"{TARGET_METHOD} and the exact top-k oracle at every k (error, and added error); `all methods`: the mean relative added "
                f"error over the {len(run['methods'])} methods at k = {TARGET_K}.", ""]
        shown = [m for m in (TARGET_METHOD, ORACLE) if m in run["error"]]
        head = [f"{SHORT[m]} {what}k={k}" for m in shown for what in ("", "added ") for k in ks]
        out += ["| format | row B | B/token | B@128 | " + " | ".join(head) + " | all methods |",
                "|---|---:|---:|---:|" + "---:|" * (len(head) + 1)]
        for spec in ["f32"] + sorted(_specs(run), key=lambda s: -run["formats"][s]["bytes_per_token_dh128"]):
            f = run["formats"][spec]
            sizes = ("-", "-", "-") if f["row_bytes"] is None else (
                f["row_bytes"], f"{f['bytes_per_token']:.0f}", f"{f['bytes_per_token_dh128']:.0f}")
            cells = []
            for m in shown:
                cells += [f"{run['error'][m][spec][k]:.4f}" for k in ks]
                cells += [f"{relative_added(run, m, spec, k):+.1%}" for k in ks]
            every = f"{_method_mean(run, spec, TARGET_K):+.1%}"
            out.append(f"| {spec} | {sizes[0]} | {sizes[1]} | {sizes[2]} | " + " | ".join(cells) + f" | {every} |")
        out += ["", f"Every method at k = {TARGET_K} (error; formats within the byte target and bf16):", ""]
        cols = [BASE] + [s for s in _specs(run) if s != BASE and
                         run["formats"][s]["bytes_per_token_dh128"] <= TARGET_BYTES_DH128]
        out += ["| method | f32 | " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) + 1)]
        for m in run["methods"]:
            e = run["error"][m["name"]]
            out.append(f"| {m['name']} | {e['f32'][TARGET_K]:.4f} | "
                       + " | ".join(f"{e[s][TARGET_K]:.4f}" for s in cols) + " |")
        out.append("")
    passing = [s for s in _specs(runs[0]) if s != BASE and meets_target(results, s)]
    out += ["## Target", "",
            "Formats within the target at every context: " + (", ".join(
                f"`{s}` ({runs[0]['formats'][s]['bytes_per_token_dh128']:.0f} B@128, "
                + ", ".join(f"{relative_added(r, TARGET_METHOD, s, TARGET_K):+.1%} at {r['context']}" for r in runs)
                + ")" for s in passing) or "none") + ".", ""]
    if results.get("recommendation"):
        out += [results["recommendation"], ""]
    return "\n".join(out)


def plot(results: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    markers = "os^D"
    for i, run in enumerate(results["runs"]):
        specs = [s for s in _specs(run) if s != BASE]
        x = [run["formats"][s]["bytes_per_token_dh128"] for s in specs]
        method = TARGET_METHOD if TARGET_METHOD in run["error"] else run["methods"][0]["name"]
        y = [100 * relative_added(run, method, s, TARGET_K) for s in specs]
        ax.scatter(x, y, marker=markers[i % len(markers)], label=f"{run['context']} tokens", alpha=0.8)
        if i == 0:
            for s, xi, yi in zip(specs, x, y):
                ax.annotate(s, (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axvline(TARGET_BYTES_DH128, color="gray", ls="--", lw=1)
    ax.axhline(100 * TARGET_RELATIVE, color="gray", ls="--", lw=1)
    ax.axvline(results["runs"][0]["formats"][BASE]["bytes_per_token_dh128"], color="gray", ls=":", lw=1)
    ax.set_yscale("symlog", linthresh=10)
    ax.set_xlabel("host bytes per token per layer and KV head at Dh = 128 (index included; bf16 rows: 580)")
    ax.set_ylabel(f"added attention error, % of bf16 rows ({TARGET_METHOD}, k = {TARGET_K})")
    ax.set_title(f"K/V row formats on {results['meta'].get('model', 'SmolLM2')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(results: dict, prefix: str) -> list[str]:
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(prefix + ".md", "w") as f:
        f.write(render_markdown(results))
    return [prefix + ".json", prefix + ".md", plot(results, prefix + ".png")]


def load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)
