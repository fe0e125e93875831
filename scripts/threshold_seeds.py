"""How often the threshold selection's second path would run on real decodes, by its rank and slack.

:class:`~fathom_jax.decode.selection.ThresholdSelection` keeps, per query head, the stored middle tokens (positions
``[sink, stop)``, ``stop = min(length - local, the newest block's start)``) whose score key reaches the head's
threshold ``T``; the newest block's middle tokens are always candidates. With ``k' = k - sink - local`` the
candidates prove the selection unless more than ``capacity = next_pow2(slack x rank x k')`` stored tokens passed
(overflow) or fewer than k' candidates reach ``T`` and not every stored middle token passed (too few); then the step
takes the second path (every score written, sorted top-k) and ``T`` becomes the key of the ``rank x k'``-th best
middle score. Otherwise the next ``T`` is ``max(T, key of the rank x k'-th best candidate reaching T)``. The first
``T`` is the lowest key. :func:`simulate` replays these rules step by step on one layer's scores.

Protocol (the fidelity study's): a window of the evaluation text captured once, its last ``--positions`` positions as
consecutive decode steps, each scored as the index a decode loop holds there
(:func:`~fathom_jax.eval.prefix_scan.prefix_scores`) by Fathom 48 (named at D = 128, scaled to the model's D;
corpus calibration) and by the exact ``q . k``. On Gemma 3 only the global layers scan; those are measured.

    python -m scripts.threshold_seeds --model smollm2 --context 4096
    python -m scripts.threshold_seeds --model gemma3-270m --context 32768

writes ``results/threshold_seeds_<model>_<context>.{json,md}``. Runs on CPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import methods
from fathom_jax.decode.selection import ThresholdSelection
from fathom_jax.eval import prefix_scan
from fathom_jax.format import BLOCK_TOKENS
from fathom_jax.index import build_index, unpack_index
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS
from pallas_kernels.topk_radix import INT_MIN, sortable_key
from scripts import harness

RANKS = (2, 4, 8)
SLACKS = (2, 4)
BUDGET = 48  # Fathom's budget at D = 128
POSITION_CHUNK = 64  # positions scored together (the same numbers as one at a time)


def middle_kth(keys: np.ndarray, lengths: np.ndarray, ms, *, sink: int = SINK_TOKENS, local: int = LOCAL_TOKENS):
    """``{m: [P, H]}``: each step's ``m``-th largest middle key (positions ``[sink, length - local)``; INT_MIN where
    there are fewer) of ``keys [P, H, n]``: the second path's seed (:func:`~fathom_jax.select.kth_largest_middle`)."""
    out = {m: np.full(keys.shape[:2], INT_MIN, np.int32) for m in ms}
    for t, length in enumerate(lengths):
        mid = np.sort(keys[t, :, sink:max(sink, length - local)], axis=-1)
        for m in ms:
            if 0 < m <= mid.shape[-1]:
                out[m][t] = mid[:, -m]
    return out


def simulate(keys: np.ndarray, lengths: np.ndarray, k: int, rank: int, slack: int, *, sink: int = SINK_TOKENS,
             local: int = LOCAL_TOKENS, coupled: bool = False, kth: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The threshold selection's decisions over consecutive steps of one layer: ``keys [P, H, n]`` the
    order-preserving keys (:func:`~pallas_kernels.topk_radix.sortable_key`) of each step's scores, valid below
    ``lengths [P]`` (the new token included). ``coupled``: a failure of any head sends every head to the second
    path (the step's ``lax.cond`` over a chunk of the layer's heads). ``kth``: :func:`middle_kth` at ``rank x k'``.

    Returns ``[P, H]`` arrays: ``overflow`` / ``few`` (the head's own failure), ``second`` (the path its step took)
    and ``written`` (candidates the scan wrote, ``min(passed, capacity)``)."""
    kp = k - sink - local
    m, capacity = rank * kp, ThresholdSelection(rank, slack).capacity(kp)
    if kth is None:
        kth = middle_kth(keys, lengths, (m,), sink=sink, local=local)[m]
    shape = keys.shape[:2]
    out = {"overflow": np.zeros(shape, bool), "few": np.zeros(shape, bool), "second": np.zeros(shape, bool),
           "written": np.zeros(shape, np.int64)}
    threshold = np.full(shape[1], INT_MIN, np.int32)
    for t, length in enumerate(lengths):
        newest = (length - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        stop = min(length - local, newest)
        count = np.sum(keys[t, :, sink:max(sink, stop)] >= threshold[:, None], axis=-1)
        extra = np.sum(keys[t, :, max(sink, newest):length - local] >= threshold[:, None], axis=-1)
        overflow = count > capacity
        few = (np.minimum(count, capacity) + extra < kp) & (count != max(stop - sink, 0))
        second = overflow | few
        if coupled:
            second = np.full_like(second, second.any())
        out["overflow"][t], out["few"][t], out["second"][t] = overflow, few, second
        out["written"][t] = np.minimum(count, capacity)
        threshold = np.where(second, kth[t], np.maximum(kth[t], threshold))
    return out


@functools.partial(jax.jit, static_argnums=0)
def _window(method, keys, calib):
    full = unpack_index(build_index(keys, calib, method.parts))
    return full, prefix_scan.plane_windows(full)


@functools.partial(jax.jit, static_argnums=0)
def _keys(method, q, full, windows, keys, lengths, calib):
    return sortable_key(prefix_scan.prefix_scores(method, q, full, keys, lengths, calib, windows=windows)[0])


def layer_keys(method, q, keys, calib, lengths) -> np.ndarray:
    """``[P, H, n]`` int32: the keys of ``method``'s scores of one layer (``q [P, Hkv, G, D]``, ``keys [Hkv, n, D]``)
    at each length, as a decode loop's index there scores them."""
    full, windows = _window(method, keys, calib)
    parts = [np.asarray(_keys(method, q[i:i + POSITION_CHUNK], full, windows, keys,
                              jnp.asarray(lengths[i:i + POSITION_CHUNK]), calib))
             for i in range(0, len(lengths), POSITION_CHUNK)]
    out = np.concatenate(parts)
    return out.reshape(out.shape[0], -1, out.shape[-1])


def layer_stats(keys, lengths, ks) -> dict:
    """Per (k, rank, slack): the shares of this layer's decisions after the first step."""
    kths = middle_kth(keys, lengths, {r * (k - SINK_TOKENS - LOCAL_TOKENS) for k in ks for r in RANKS})
    stats = {}
    for k in ks:
        kp = k - SINK_TOKENS - LOCAL_TOKENS
        for rank in RANKS:
            for slack in SLACKS:
                run = functools.partial(simulate, keys, lengths, k, rank, slack, kth=kths[rank * kp])
                alone, coupled = run(), run(coupled=True)
                stats[(k, rank, slack)] = {
                    "second": float(alone["second"][1:].mean()), "overflow": float(alone["overflow"][1:].mean()),
                    "few": float(alone["few"][1:].mean()), "coupled": float(coupled["second"][1:, 0].mean()),
                    "candidates_per_kp": float(alone["written"][1:].mean() / kp)}
    return stats


def main(argv=None):
    from fathom_jax.eval import fidelity as fid
    from fathom_jax.eval import texts
    from fathom_jax.eval.sweeps import corpus_calibration
    from fathom_jax.models import capture_qkv
    from fathom_jax.models.hub import KNOWN_MODELS, known_model, load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=KNOWN_MODELS)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--positions", type=int, default=256, help="consecutive decode positions at the window's end")
    ap.add_argument("--k", default="128,512", help="selection sizes (a list)")
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    ks = tuple(int(k) for k in args.k.split(","))
    if not 2 <= args.positions <= args.context - max(ks):
        ap.error("--positions must lie in [2, --context - max k]")
    t0 = time.time()
    spec_file = known_model(args.model)
    model, tok, cfg = load_model(args.model)
    eval_text, eval_info = texts.evaluation_text()
    cap = fid.Capture(**capture_qkv(model, jnp.asarray(texts.token_window(tok.encode(eval_text), args.context,
                                                                           name="evaluation text"))))
    calib, _, _ = corpus_calibration(model, tok, args.calibration_tokens)
    budget = BUDGET * cap.q.shape[-1] // 128
    scorings = {f"Fathom {BUDGET} (fathom:{budget})": methods.parse(f"fathom:{budget}"),
                "exact q.k": methods.parse("exact")}
    lengths = np.arange(args.context - args.positions, args.context, dtype=np.int32) + 1
    model_layers = [int(x) for x in getattr(cfg, "global_layers", range(cap.k.shape[0]))]
    per_layer = {label: [] for label in scorings}
    for layer in range(cap.k.shape[0]):
        q = cap.layer_queries(layer, lengths - 1)
        for label, method in scorings.items():
            layer_calib = jax.tree.map(lambda x: x[layer], calib) if method.needs_calibration else None
            per_layer[label].append(layer_stats(layer_keys(method, q, cap.k[layer], layer_calib, lengths), lengths, ks))
        print(f"layer {model_layers[layer]}: {time.time() - t0:.0f} s", flush=True)
    rows = []
    for label, layers in per_layer.items():
        for (k, rank, slack) in layers[0]:
            by_layer = [s[(k, rank, slack)] for s in layers]
            worst = int(np.argmax([s["second"] for s in by_layer]))
            kp = k - SINK_TOKENS - LOCAL_TOKENS
            rows.append({"scores": label, "k": k, "rank": rank, "slack": slack,
                         "capacity": ThresholdSelection(rank, slack).capacity(kp),
                         **{key: float(np.mean([s[key] for s in by_layer])) for key in by_layer[0]},
                         "worst_layer": model_layers[worst], "worst_second": by_layer[worst]["second"],
                         "worst_coupled": max(s["coupled"] for s in by_layer), "layers": by_layer})
    res = {"meta": {"machine": harness.machine(), "command": harness.command("scripts.threshold_seeds", argv),
                    "config": vars(args), "model": spec_file.title, "text": eval_info, "layers": model_layers,
                    "heads": int(cap.q.shape[1]), "head_dim": int(cap.q.shape[-1]), "sink": SINK_TOKENS,
                    "local": LOCAL_TOKENS, "wall_seconds": round(time.time() - t0, 1)}, "rows": rows}
    prefix = os.path.join(args.out, f"threshold_seeds_{spec_file.slug}_{args.context // 1024}k")
    print(harness.write_results(prefix, res, report))


def report(res: dict) -> str:
    meta, c = res["meta"], res["meta"]["config"]
    m = meta["machine"]
    lines = [f"# Threshold selection: how often the second path runs ({meta['model'].split(' (')[0]}, "
             f"{c['context']} tokens)", "",
             f"{m['date']}, JAX {m['jax']}, commit {m['commit']}, {m['backend']}, {meta['wall_seconds']} s. Command: "
             f"`{meta['command']}`. {meta['model']}, layers {meta['layers']} x {meta['heads']} query heads (D = "
             f"{meta['head_dim']}); the evaluation text's last {c['positions']} of {c['context']} positions as "
             f"consecutive decode steps; sink {meta['sink']}, local {meta['local']}, k' = k - {meta['sink']} - "
             f"{meta['local']}; the rules of `scripts/threshold_seeds.py` (`ThresholdSelection`), the first step "
             "(which starts from the lowest threshold) excluded.", "",
             "`second path`: share of (step, layer, query head) decisions whose candidates cannot prove the selection "
             "(each head on its own), split into `overflow` (more than `capacity` stored tokens passed) and `too "
             "few`; `coupled`: share of (step, layer) where the layer's heads share the decision (any head's failure "
             "takes every head of the layer to the second path and reseeds them all, as one `lax.cond` per chunk "
             "does); `cand / k'`: the candidates the scan writes per head (at most `capacity`) over k'; `worst "
             "layer`: the largest per-layer second-path share (the layer), and the largest coupled one; `*`: a "
             "capacity of at least the middle tokens (no overflow possible).", "",
             "| scores | k | rank | slack | capacity | second path | overflow | too few | coupled | cand / k' | "
             "worst layer | worst coupled |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    middle = c["context"] - meta["sink"] - meta["local"]
    for r in res["rows"]:
        star = "*" if r["capacity"] >= middle else ""
        lines.append(f"| {r['scores']} | {r['k']} | {r['rank']} | {r['slack']} | {r['capacity']}{star} | "
                     f"{r['second']:.4f} | {r['overflow']:.4f} | {r['few']:.4f} | {r['coupled']:.4f} | "
                     f"{r['candidates_per_kp']:.2f} | {r['worst_second']:.4f} ({r['worst_layer']}) | "
                     f"{r['worst_coupled']:.4f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
