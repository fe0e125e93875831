"""How many of a decode step's K/V rows the previous steps already selected, on a real model and real text.

The row fetch from host memory is what bounds a batch of long sequences (NOTES.md: batch 8 at 128k on the H200 moves
its rows at ~21 GB/s). A device-side cache of the rows the last W steps fetched would fetch only the rows new to it;
this measures that fraction. Protocol (the fidelity study's): a window of the evaluation text is captured once
(post-RoPE q/k/v of every layer); at each of the window's last ``--positions`` positions p, every method scores the
index a decode loop holds there (``prefix_index`` of the window's index at length p + 1), selects its top-k per head
(sink and local included, as the decode step does) and takes each KV group's union: the rows one step fetches.

    python -m scripts.row_reuse --context 4096 --positions 64 --k 128 --methods exact,fathom:32
    python -m scripts.row_reuse --model gemma3-270m --context 4096 --methods exact,fathom:128

writes ``results/row_reuse_<model>_<context>.{json,md}``. Runs on CPU (SmolLM2-135M or Gemma 3 270M, the GGUFs the
README's set-up fetches). On Gemma 3 only the global layers scan (the others keep a local ring in HBM): the capture
holds those, and they are the layers measured here.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import methods
from fathom_jax.eval import fidelity as fid
from fathom_jax.eval import texts
from fathom_jax.eval.sweeps import corpus_calibration
from fathom_jax.index import build_index, prefix_index
from fathom_jax.scan import scan_scores
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS, group_union, select_topk
from scripts import harness

WINDOWS = (1, 2, 4, 8)  # steps a row cache remembers


def layer_unions(method, k: int):
    """``(union [P, Hkv, U], mask [P, Hkv, U])`` of one layer at every position: jitted per method."""

    @jax.jit
    def run(q, keys, calib, positions):  # q [P, Hkv, G, D], keys [Hkv, T, D]
        full = build_index(keys, calib, method.parts)

        def one(args):
            q_p, p = args
            index = prefix_index(full, keys, p + 1)
            scores = scan_scores(method, q_p, index, calib).scores
            idx, mask = select_topk(scores, index.length, k, implementation="xla")
            union, union_mask, _ = group_union(idx, mask)
            return union, union_mask

        return jax.lax.map(one, (q, positions))

    return run


def new_fraction(union: np.ndarray, mask: np.ndarray, window: int, middle: tuple[int, np.ndarray] | None = None):
    """Per step after the first ``window``: the fraction of its rows (masked-in union slots) that none of the last
    ``window`` steps selected, pooled over groups. ``middle=(sink, local_start [P])`` counts only rows outside the
    sink and local window (those a cache would hold trivially)."""
    new = total = 0
    steps = union.shape[0]
    for t in range(window, steps):
        for g in range(union.shape[1]):
            rows = union[t, g][mask[t, g]]
            if middle is not None:
                sink, local_start = middle
                rows = rows[(rows >= sink) & (rows < local_start[t])]
            seen = set()
            for w in range(1, window + 1):
                seen.update(union[t - w, g][mask[t - w, g]].tolist())
            new += sum(1 for r in rows.tolist() if r not in seen)
            total += rows.size
    return new / max(total, 1), total


def main(argv=None):
    from fathom_jax.models import capture_qkv
    from fathom_jax.models.hub import KNOWN_MODELS, known_model, load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=KNOWN_MODELS)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--positions", type=int, default=64, help="consecutive decode positions at the window's end")
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--methods", default="exact,fathom:32")
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    if not 2 <= args.positions <= args.context:
        ap.error(f"--positions must lie in [2, --context], got {args.positions}")
    t0 = time.time()
    spec_file = known_model(args.model)
    model, tok, cfg = load_model(args.model)
    eval_text, eval_info = texts.evaluation_text()
    ids = texts.token_window(tok.encode(eval_text), args.context, name="evaluation text")
    cap = fid.Capture(**capture_qkv(model, jnp.asarray(ids)))
    calib, _, _ = corpus_calibration(model, tok, args.calibration_tokens)
    n_layers = cap.k.shape[0]  # the layers that scan (Gemma 3: its global ones)
    positions = np.arange(args.context - args.positions, args.context, dtype=np.int32)
    local_start = positions + 1 - LOCAL_TOKENS
    res = {"machine": harness.machine(), "command": harness.command("scripts.row_reuse", argv),
           "config": vars(args).copy(), "model": spec_file.title,
           "text": eval_info, "model_layers": list(getattr(cfg, "global_layers", range(n_layers))), "methods": {}}
    for spec in args.methods.split(","):
        method = methods.parse(spec)
        run = layer_unions(method, args.k)
        per_layer = []
        for layer in range(n_layers):
            q = cap.layer_queries(layer, positions)
            layer_calib = jax.tree.map(lambda x: x[layer], calib) if method.needs_calibration else None
            union, mask = map(np.asarray, run(q, cap.k[layer], layer_calib, jnp.asarray(positions)))
            per_layer.append({"rows_per_group": float(mask.sum(-1).mean()),
                              **{f"new_w{w}": new_fraction(union, mask, w)[0] for w in WINDOWS},
                              **{f"new_middle_w{w}": new_fraction(union, mask, w, (SINK_TOKENS, local_start))[0]
                                 for w in WINDOWS}})
            print(f"[{spec}] layer {layer}: {per_layer[-1]}", flush=True)
        res["methods"][spec] = {"layers": per_layer,
                                **{key: float(np.mean([r[key] for r in per_layer])) for key in per_layer[0]}}
    res["wall_seconds"] = round(time.time() - t0, 1)
    prefix = os.path.join(args.out, f"row_reuse_{spec_file.slug}_{args.context // 1024}k")
    print(harness.write_results(prefix, res, report))


def report(res: dict) -> str:
    c = res["config"]
    name = res["model"].split(" (")[0]
    lines = [f"# Rows a decode step shares with the steps before it ({name}, {c['context']} tokens)", "",
             f"{res['machine']['date']}, JAX {res['machine']['jax']}, commit {res['machine']['commit']}, "
             f"{res['machine']['backend']}. Command: `{res['command']}`. {res['model']}; evaluation text "
             f"{c['context']} tokens, its last {c['positions']} positions as consecutive decode steps, k = {c['k']} per "
             f"head ({SINK_TOKENS} sink + {LOCAL_TOKENS} local included), each KV group's union of its heads' "
             "selections = the rows one step fetches. Fathom is calibrated on the calibration text.", "",
             "`new (W)`: the fraction of a step's rows that none of the last W steps selected (what a device cache of "
             "those steps' rows would still fetch), pooled over layers' groups and steps, mean over layers; "
             "`middle`: the same for rows outside the sink and the local window.", "",
             "| method | rows per group | " + " | ".join(f"new (W={w})" for w in WINDOWS) + " | "
             + " | ".join(f"middle new (W={w})" for w in WINDOWS) + " |",
             "|---|---|" + "---|" * (2 * len(WINDOWS))]
    for spec, m in res["methods"].items():
        lines.append(f"| {spec} | {m['rows_per_group']:.0f} | " + " | ".join(f"{m[f'new_w{w}']:.3f}" for w in WINDOWS)
                     + " | " + " | ".join(f"{m[f'new_middle_w{w}']:.3f}" for w in WINDOWS) + " |")
    first = next(iter(res["methods"]))
    lines += ["", f"Per layer ({first}, new rows with W = 1 / 8):", "",
              "| layer | rows per group | new (W=1) | new (W=8) | middle new (W=1) |", "|---|---|---|---|---|"]
    model_layers = res.get("model_layers", range(len(res["methods"][first]["layers"])))
    for i, r in zip(model_layers, res["methods"][first]["layers"]):
        lines.append(f"| {i} | {r['rows_per_group']:.0f} | {r['new_w1']:.3f} | {r['new_w8']:.3f} | "
                     f"{r['new_middle_w1']:.3f} |")
    lines.append(f"\nWall time {res['wall_seconds']} s.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
