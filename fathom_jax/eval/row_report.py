"""The row-format study's report: tables and the bytes-versus-added-error figure, from the results JSON alone.

Added error of a format = its attention error minus the bf16 rows' (today's rows), for the same method, k and
context; relative: divided by the bf16 rows' error. The target (issue 32): at most +10% on Fathom 48 at
k = 128 at every context, at most 340 host bytes per token per layer and KV head at Dh = 128.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from fathom_jax.rows import formats as row_formats

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
    return all(TARGET_K in run["error"][TARGET_METHOD][spec]
               and relative_added(run, TARGET_METHOD, spec, TARGET_K) <= TARGET_RELATIVE for run in runs)


def recommend(results: dict) -> str | None:
    """The format to make the default compressed one: of those within the target at every context, the one whose
    worst added error on the target method is least (fewer bytes breaks a tie); None if none is within it."""
    runs = results["runs"]
    passing = [s for s in _specs(runs[0]) if s != BASE and meets_target(results, s)]
    worst = lambda s: max(relative_added(r, TARGET_METHOD, s, TARGET_K) for r in runs)  # noqa: E731
    return min(passing, key=lambda s: (round(worst(s), 4), runs[0]["formats"][s]["bytes_per_token_dh128"]),
               default=None)


def fetch_bytes(spec: str, head_dim: int = 128) -> str:
    f = row_formats.parse(spec)
    if f.key.store:
        return "-"
    extra = f" +{f.key.scale_count * head_dim * 2}" if f.block else ""
    return f"{f.row_bytes(head_dim)}{extra}"


def _main_k(run: dict) -> str:
    """The k the summaries use: the target's, or the run's first when it did not measure that one."""
    ks = [str(k) for k in run["ks"]]
    return TARGET_K if TARGET_K in ks else ks[0]


def _specs(run: dict) -> list[str]:
    return [s for s in run["formats"] if s != "f32"]


def _method_mean(run: dict, spec: str, k: str) -> float:
    """Mean over the run's methods of the relative added error (how a format treats every selection)."""
    vals = [relative_added(run, m["name"], spec, k) for m in run["methods"]]
    return sum(vals) / len(vals)


def _joined(value, code: bool = False) -> str:
    items = value if isinstance(value, list) else [value]
    return "; ".join(f"`{v}`" if code else str(v) for v in items)


def render_markdown(results: dict) -> str:
    meta, runs = results["meta"], results["runs"]
    d = runs[0]["head_dim"]
    out = [
        f"# K/V row formats: host bytes per token vs attention error ({meta.get('model', 'model')})",
        "",
        f"- {_joined(meta['date'])}, {meta['machine']}, JAX {meta['jax']}, commit {_joined(meta.get('commit'))}",
        "- command: " + _joined(meta.get("command", "?"), code=True),
        f"- protocol of `fathom sweep`: calibration text {meta.get('calib_text', {}).get('kind', '?')}, evaluation "
        f"text {meta.get('eval_text', {}).get('kind', '?')}; last {runs[0]['positions']} positions, every layer "
        "and head; each method selects 4 sink + 32 local + top-(k-36) from the keys as captured; attention runs "
        "over the selected rows as each format decodes them, against dense attention over the captured f32 rows.",
        f"- bytes: host bytes per token per layer and KV head: the row, K block scales, and the key index's planes "
        f"and scales (4 Dh/8 + 2 Dh/64). SmolLM2 has Dh = {d}; `B@128` is the same format at Dh = 128 "
        "(bf16 rows: 580). `f32`: the captured rows (the study's own numbers); `bf16`: today's rows.",
        "- fetch B@128: what a row fetch reads per selected token at Dh = 128: its row, and for K scales per (channel, "
        "block) that block's fp16 scales (`+256`/`+512`: once per block touched; nothing if they stay in device "
        "memory, 4-8 B per token). The store's K codes are bits of channel-major planes, not a row: no row fetch.",
        f"- added: relative to the bf16 rows' error, same method, k and context. Target: <= "
        f"+{TARGET_RELATIVE:.0%} on {TARGET_METHOD} at k = {TARGET_K} at every context, <= "
        f"{TARGET_BYTES_DH128:.0f} B@128.",
        "",
    ]
    for run in runs:
        ks = [str(k) for k in run["ks"]]
        ctx = run["context"]
        out += [f"## {ctx} tokens ({run['wall_seconds']:.0f} s)", "",
                f"{TARGET_METHOD} and the exact top-k oracle at every k (error, and added error); `in quadrature`: the "
                "error the format adds if independent of the bf16 rows' own, sqrt(err^2 - err_bf16^2); `all methods`: "
                f"the mean relative added error over the {len(run['methods'])} methods at k = {_main_k(run)}.", ""]
        shown = [m for m in (TARGET_METHOD, ORACLE) if m in run["error"]]
        head = [f"{SHORT[m]} {what}k={k}" for m in shown for what in ("", "added ") for k in ks]
        km = _main_k(run)
        head.append(f"{SHORT[shown[-1]]} in quadrature k={km}")
        out += ["| format | row B | B/token | B@128 | fetch B@128 | " + " | ".join(head) + " | all methods |",
                "|---|---:|---:|---:|---:|" + "---:|" * (len(head) + 1)]
        for spec in ["f32"] + sorted(_specs(run), key=lambda s: -run["formats"][s]["bytes_per_token_dh128"]):
            f = run["formats"][spec]
            sizes = ("-", "-", "-", "-") if f["row_bytes"] is None else (
                f["row_bytes"], f"{f['bytes_per_token']:.0f}", f"{f['bytes_per_token_dh128']:.0f}", fetch_bytes(spec))
            cells = []
            for m in shown:
                cells += [f"{run['error'][m][spec][k]:.4f}" for k in ks]
                cells += [f"{relative_added(run, m, spec, k):+.1%}" for k in ks]
            base, err = run["error"][shown[-1]][BASE][km], run["error"][shown[-1]][spec][km]
            cells.append(f"{math.sqrt(max(err * err - base * base, 0.0)):.4f}")
            every = f"{_method_mean(run, spec, km):+.1%}"
            out.append(f"| {spec} | " + " | ".join(map(str, sizes)) + " | " + " | ".join(cells) + f" | {every} |")
        out += ["", f"Every method at k = {km} (error; formats within the byte target and bf16):", ""]
        cols = [BASE] + [s for s in _specs(run) if s != BASE and
                         run["formats"][s]["bytes_per_token_dh128"] <= TARGET_BYTES_DH128]
        out += ["| method | f32 | " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) + 1)]
        for m in run["methods"]:
            e = run["error"][m["name"]]
            out.append(f"| {m['name']} | {e['f32'][km]:.4f} | " + " | ".join(f"{e[s][km]:.4f}" for s in cols) + " |")
        out.append("")
    passing = [s for s in _specs(runs[0]) if s != BASE and meets_target(results, s)]
    out += ["## Target", "",
            "Formats within the target at every context: " + (", ".join(
                f"`{s}` ({runs[0]['formats'][s]['bytes_per_token_dh128']:.0f} B@128, "
                + ", ".join(f"{relative_added(r, TARGET_METHOD, s, TARGET_K):+.1%} at {r['context']}" for r in runs)
                + ")" for s in passing) or "none") + ".", ""]
    best = recommend(results)
    if best is not None:
        f = runs[0]["formats"][best]
        out += [f"Recommended default compressed format (least added error on {TARGET_METHOD} at k = {TARGET_K} among "
                f"those within the target): `{best}`, {f['bytes_per_token_dh128']:.0f} B@128 "
                f"({f['bytes_per_token']:.0f} B at Dh = {runs[0]['head_dim']}); added error "
                + ", ".join(f"{relative_added(r, TARGET_METHOD, best, TARGET_K):+.1%} on {TARGET_METHOD} and "
                            f"{_method_mean(r, best, TARGET_K):+.1%} averaged over every method at {r['context']}"
                            for r in runs) + ".", ""]
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
        y = [100 * relative_added(run, method, s, _main_k(run)) for s in specs]
        ax.scatter(x, y, marker=markers[i % len(markers)], label=f"{run['context']} tokens", alpha=0.8)
        if i == 0:
            for s, xi, yi in zip(specs, x, y):
                ax.annotate(s, (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axvline(TARGET_BYTES_DH128, color="gray", ls="--", lw=1)
    ax.axhline(100 * TARGET_RELATIVE, color="gray", ls="--", lw=1)
    ax.axvline(results["runs"][0]["formats"][BASE]["bytes_per_token_dh128"], color="gray", ls=":", lw=1)
    ax.set_yscale("symlog", linthresh=10)
    ax.set_xlabel("host bytes per token per layer and KV head at Dh = 128 (index included; bf16 rows: 580)")
    ax.set_ylabel(f"added attention error, % of bf16 rows ({TARGET_METHOD}, k = {_main_k(results['runs'][0])})")
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


def merge(results: list[dict]) -> dict:
    """One results dict from runs written separately (e.g. one process per context): every run, in context order,
    and the meta of the first with every run's command and commit."""
    meta = {**results[0]["meta"], "command": [r["meta"].get("command") for r in results],
            "commit": sorted({str(r["meta"].get("commit")) for r in results}),
            "date": sorted({r["meta"]["date"] for r in results})}
    runs = sorted((run for r in results for run in r["runs"]), key=lambda run: run["context"])
    return {"meta": meta, "runs": runs}


def load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)
