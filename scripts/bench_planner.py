"""Planner benchmark: jitted water-filling for 36 layers x 8 KV heads x batch 8 (G = 4, D = 128).

Times the paper's 30-step bisection and the exact integer allocation on the CPU (or whatever backend
JAX picks), and counts how often the exact allocation reads a different plan, and whether it ever has
lower ``sum g 4^-t`` at equal bits. Writes results/planner_<backend>.json and .md.

    .venv/bin/python -m scripts.bench_planner [--repeats 20]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import planner as P

LAYERS, KV_HEADS, BATCH, GROUP, D = 36, 8, 8, 4, 128


def timed(fn, *args, repeats: int) -> np.ndarray:
    jax.block_until_ready(fn(*args))  # compile
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t)
    return np.array(out) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    # Real-looking statistics: log-normal channel variances, Gaussian queries.
    var = np.exp(rng.normal(0, 1.5, size=(LAYERS, 1, KV_HEADS, D))).astype(np.float32)
    q = rng.standard_normal((LAYERS, BATCH, KV_HEADS, GROUP, D)).astype(np.float32)
    g = jnp.asarray(np.sum(q * q, axis=-2) * var)

    rows = []
    for budget in (40, 48, 64, 80):
        bis = jax.jit(lambda g: P.plan_bisection(g, budget).depths)
        ex = jax.jit(lambda g: P.plan_exact(g, budget).depths)
        t_bis = timed(bis, g, repeats=args.repeats)
        t_ex = timed(ex, g, repeats=args.repeats)
        d_bis, d_ex = np.asarray(bis(g)), np.asarray(ex(g))
        g64 = np.asarray(g, np.float64)
        cost_bis = np.sum(g64 * 4.0 ** -d_bis, axis=-1)
        cost_ex = np.sum(g64 * 4.0 ** -d_ex, axis=-1)
        differs = np.any(d_bis != d_ex, axis=-1)
        rows.append({
            "budget": budget,
            "groups": int(differs.size),
            "bisection_ms_median": float(np.median(t_bis)),
            "bisection_ms_iqr": [float(np.percentile(t_bis, 25)), float(np.percentile(t_bis, 75))],
            "exact_ms_median": float(np.median(t_ex)),
            "exact_ms_iqr": [float(np.percentile(t_ex, 25)), float(np.percentile(t_ex, 75))],
            "plans_differ": int(differs.sum()),
            "exact_lower_error": int(np.sum(cost_ex < cost_bis * (1 - 1e-9))),
            "bisection_mean_code_bits": float(d_bis.sum(-1).mean()),
            "exact_mean_code_bits": float(d_ex.sum(-1).mean()),
            "mean_active_channels": float((d_bis > 0).sum(-1).mean()),
        })

    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "batch": BATCH, "group": GROUP, "head_dim": D},
        "repeats": args.repeats,
    }
    os.makedirs(args.out, exist_ok=True)
    prefix = os.path.join(args.out, f"planner_{jax.default_backend()}")
    with open(prefix + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        f"# Planner: {LAYERS} layers x {KV_HEADS} KV heads x batch {BATCH}, G = {GROUP}, D = {D} "
        f"({LAYERS * KV_HEADS * BATCH} groups), jitted",
        "",
        f"{meta['date']}, {meta['machine']}, backend {meta['backend']}, JAX {meta['jax']}; "
        f"median [IQR] of {args.repeats} calls",
        "",
        "| budget | bisection ms | exact ms | plans differ | exact lower error | mean code bits (bis / exact) | active channels |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['budget']} | {r['bisection_ms_median']:.2f} [{r['bisection_ms_iqr'][0]:.2f}, {r['bisection_ms_iqr'][1]:.2f}] "
            f"| {r['exact_ms_median']:.2f} [{r['exact_ms_iqr'][0]:.2f}, {r['exact_ms_iqr'][1]:.2f}] "
            f"| {r['plans_differ']} / {r['groups']} | {r['exact_lower_error']} "
            f"| {r['bisection_mean_code_bits']:.2f} / {r['exact_mean_code_bits']:.2f} | {r['mean_active_channels']:.1f} |"
        )
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
