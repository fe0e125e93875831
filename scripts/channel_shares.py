"""How much of a query's score variance the channels a scan picks hold: SparQ's top-|q| channels against the best.

A query's score variance over keys is ``sum_j q_j^2 Var(k_j)`` (the importance Fathom, Double Sparsity and Loki weigh
channels by). SparQ reads the ``r = D/4`` channels of largest ``|q_j|``, blind to ``Var(k_j)``; the best ``r``
channels are those of largest ``q_j^2 Var(k_j)``. This prints and writes, per model, the mean share of that sum the
two channel sets hold: on a window of ``--context`` tokens of standard-library code (the study's evaluation text),
every query head of every captured layer (Gemma 3: its global layers), every ``--every``-th of the last
``--positions`` positions, key variances over the window past its first 64 tokens.

    python -m scripts.channel_shares            # writes results/channel_shares.{json,md}
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

from fathom_jax.eval import texts
from fathom_jax.models import capture_qkv, hub
from scripts import harness


def shares(q: np.ndarray, k: np.ndarray, positions: np.ndarray, skip: int = 64) -> dict:
    """Mean share of ``sum_j q_j^2 Var(k_j)`` in SparQ's top-|q| D/4 channels and in the best D/4 (q [L,H,T,D],
    k [L,Hkv,T,D])."""
    n_layers, n_heads, _, d = q.shape
    group, r = n_heads // k.shape[1], d // 4
    var = k[:, :, skip:].var(axis=2)  # [L, Hkv, D]
    g = q[:, :, positions] ** 2 * np.repeat(var, group, axis=1)[:, :, None]  # [L, H, P, D]
    by_q = np.take_along_axis(g, np.argsort(-np.abs(q[:, :, positions]), axis=-1)[..., :r], -1).sum(-1)
    best = np.sort(g, axis=-1)[..., ::-1][..., :r].sum(-1)
    total = g.sum(-1)
    return {"head_dim": d, "r": r, "sparq_share": float((by_q / total).mean()), "best_share": float((best / total).mean()),
            "queries": int(total.size)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--positions", type=int, default=128)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    t0 = time.time()
    text, _ = texts.evaluation_text()
    rows = []
    for name in args.models:
        model, tokenizer, _ = hub.load_model(name)
        cap = capture_qkv(model, jnp.asarray(texts.token_window(tokenizer.encode(text), args.context)))
        positions = np.arange(args.context - args.positions, args.context, args.every)
        rows.append({"model": name, **shares(np.asarray(cap["q"]), np.asarray(cap["k"]), positions)})
        print(f"{name}: D = {rows[-1]['head_dim']}: SparQ's top-|q| {rows[-1]['r']} channels hold "
              f"{rows[-1]['sparq_share']:.3f} of sum q^2 Var(k), the best {rows[-1]['r']} {rows[-1]['best_share']:.3f}")
    result = {"machine": harness.machine(), "command": harness.command("scripts.channel_shares", argv),
              "config": vars(args), "rows": rows, "wall_seconds": round(time.time() - t0, 1)}
    harness.write_json(os.path.join(args.out, "channel_shares.json"), result)
    md = ["# Score variance in the channels a scan reads", "",
          f"Share of `sum_j q_j^2 Var(k_j)` in SparQ's top-|q| D/4 channels and in the best D/4, {args.context} tokens of "
          f"standard-library code, every {args.every}th of the last {args.positions} positions, every query head of the "
          f"captured layers; {result['machine']['date'][:10]}, commit {result['machine']['commit']}.", "",
          "| model | D | r | SparQ's channels | best channels | queries |", "|---|---:|---:|---:|---:|---:|"]
    md += [f"| {r['model']} | {r['head_dim']} | {r['r']} | {r['sparq_share']:.3f} | {r['best_share']:.3f} | "
           f"{r['queries']} |" for r in rows]
    with open(os.path.join(args.out, "channel_shares.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
