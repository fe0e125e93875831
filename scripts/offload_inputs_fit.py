"""What the offload benchmark's honest inputs are fitted to (``scripts/offload_inputs.py``): Fathom 32 / 48 / 64's
plane-0 share on today's and the honest synthetic keys at Qwen3-8B shapes, and the share of a step's rows reselected
under AR(1) query drift; writes ``results/offload_inputs_cpu.{json,md}``.

    python -m scripts.offload_inputs_fit
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from fathom_jax.methods import Fathom
from fathom_jax.placement.plane_reads import plane_reads
from scripts import harness
from scripts.bench_offload import QWEN3_8B
from scripts.offload_inputs import HONEST_KEYS, TODAY_KEYS, reselected_share
from scripts.offload_setup import synthetic_calibration


def fit_report(res: dict) -> str:
    m = res["machine"]
    lines = [f"# The offload benchmark's honest inputs against real decodes ({m['date'][:10]})", "",
             f"{m['date']}, JAX {m['jax']}, commit {m['commit']}, {m['backend']} ({m['cpus']} cores). Command: "
             f"`{res['command']}` ({res['wall_seconds']} s).", "",
             "Plane 0's share of Fathom's code bits (`fathom_jax.placement.plane_reads`, Qwen3-8B shapes: 36 layers x 8 KV "
             f"heads x G = 4, D = 128, {res['draws']} Gaussian query draws per group) on each key model, beside SmolLM2's "
             "real keys at 8k (session statistics, budgets scaled to D = 64; `results/plane_shares.md`).", "",
             "| keys | Fathom 32 | Fathom 48 | Fathom 64 |", "|---|---|---|---|"]
    for name, shares in res["plane0"].items():
        lines.append(f"| {name} | " + " | ".join(f"{100 * x:.1f}%" for x in shares) + " |")
    lines += ["", "The share of a step's rows (each KV group's union of its heads' exact top-k, k = 512, sink and local "
              "window included) that the step before selected too, under AR(1) query drift (`none`: fresh queries every "
              f"step), pooled over {res['groups']} groups x {res['steps']} steps; real decodes reselect 0.63 (SmolLM2, "
              "exact, 4k: 1 - 0.374) and 0.57 (Gemma 3's global layers, 4k).", "",
              "| keys | context | drift | reselected |", "|---|---|---|---|"]
    lines += [f"| {r['keys']} | {r['context']} | {r['drift'] or 'none'} | {r['reselected']:.3f} |" for r in res["reuse"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    """Measures what the key models and the drift are fitted to: results/offload_inputs_cpu.{json,md}."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--contexts", default="131072,1048576")
    ap.add_argument("--drifts", default="none,0.94,0.95,0.96,0.965,0.97")
    ap.add_argument("--groups", type=int, default=12, help="groups per drift, spread over the layers and KV heads")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--draws", type=int, default=64)
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    t0 = time.time()
    cfg = QWEN3_8B
    res = {"machine": harness.machine(), "command": harness.command("scripts.offload_inputs_fit", argv),
           "draws": args.draws, "groups": args.groups, "steps": args.steps, "plane0": {}, "reuse": []}
    q = np.random.default_rng(3).standard_normal((cfg.n_layers, args.draws, cfg.n_kv_heads, cfg.group_size,
                                                  cfg.head_dim)).astype(np.float32)
    for keys in (TODAY_KEYS, HONEST_KEYS):
        calib, _ = synthetic_calibration(cfg, keys=keys)
        res["plane0"][keys.name] = [float(plane_reads(Fathom(b), q, calib).overall_code_share[0]) for b in (32, 48, 64)]
        print(keys.name, res["plane0"][keys.name], flush=True)
    res["plane0"]["SmolLM2 8k (real keys)"] = [0.667, 0.646, 0.626]
    prefix = os.path.join(args.out, "offload_inputs_cpu")
    for context in map(int, args.contexts.split(",")):
        for keys in (TODAY_KEYS, HONEST_KEYS):
            scale = synthetic_calibration(cfg, keys=keys)[1]
            groups = scale.reshape(-1, cfg.head_dim)[::max(1, scale.shape[0] * scale.shape[1] // args.groups)]
            for drift in args.drifts.split(","):
                rho = None if drift == "none" else float(drift)
                share = reselected_share(groups[:args.groups], rho, tokens=context, k=512, group_size=cfg.group_size,
                                         steps=args.steps)
                res["reuse"].append({"keys": keys.name, "context": context, "drift": rho, "reselected": share})
                print(res["reuse"][-1], flush=True)
                res["wall_seconds"] = round(time.time() - t0, 1)
                harness.write_results(prefix, res, fit_report)


if __name__ == "__main__":
    main()
