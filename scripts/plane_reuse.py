"""How many of a decode step's host planes the previous steps already read: what a device cache of them would save.

With plane 0 in HBM (``Placement(resident_planes=1)``) a Fathom step still moves planes 1-3 of the channels its plan
reads deeper, every step: at 1M tokens with the offload benchmark's honest inputs that is 647 MB of a 949 MB step's
link bytes (``results/offload_h200_sel_1m.md``). A plan depends only on the query and the calibration, and
consecutive queries drift, so most of a step's deep planes may be the ones the step before read. This measures it
(:func:`fathom_jax.placement.plane_reads.plane_reuse`: channel planes a step reads, the share of them that none of
the last W steps read, and how many a cache of those steps holds) on

* real decodes: a window of the evaluation text captured once (post-RoPE queries of every layer), its last
  ``--positions`` positions as consecutive steps, Fathom planned with the corpus calibration (the study's protocol;
  budgets named at D = 128 and scaled to the model's D);
* the offload benchmark's inputs (Qwen3-8B shapes): ``honest`` keys with queries drifting at
  :data:`~scripts.offload_inputs.HONEST_DRIFT` (fitted to real row reselection, not to plans), and fresh queries
  every step (no drift, a bound).

    python -m scripts.plane_reuse --model smollm2 --context 4096 --positions 256
    python -m scripts.plane_reuse --model gemma3-270m --context 4096 --positions 256 --no-synthetic --append

writes ``results/plane_reuse.{json,md}`` (``--append`` adds a model's rows). Runs on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax.format import N_PLANES
from fathom_jax.methods import Fathom
from fathom_jax.placement.plane_reads import plan_depths, plane_reuse
from fathom_jax.store.tiered import warm_choice
from scripts import harness

BUDGETS = (32, 48, 64)  # Fathom budgets named at D = 128
WINDOWS = (1, 2, 4, 8)
RESIDENT = (0, 1)
ONE_M = 1 << 20
PROMPT_TOKENS = 1024  # a set chosen from the prompt: the mean importance of its last queries before the decode steps


def _host_reads(depths: np.ndarray, resident: int) -> np.ndarray:
    """``[T, N, D, 4]``: which channel planes each step reads from the host (groups flattened to N)."""
    d = depths.reshape(depths.shape[0], -1, depths.shape[-1])[..., None]
    plane = np.arange(N_PLANES)
    return (plane >= resident) & (plane < d)


def _missed(depths: np.ndarray, resident: int, kept: np.ndarray) -> float:
    """The share of the steps' host plane reads outside ``kept`` (each group's channel planes, ``[N, D, 4]`` or
    flat ``[N, D * 4]``)."""
    reads = _host_reads(depths, resident)
    total = reads.sum()
    return float((reads & ~kept.reshape(reads.shape[1:])).sum() / total) if total else 0.0


def static_new(depths: np.ndarray, calib_depths: np.ndarray, resident: int, slots: int) -> float:
    """The share of the steps' host plane reads that a fixed set of ``slots`` channel planes per group misses, the
    set being each group's most often read channel planes over ``calib_depths`` (plans of calibration queries): a
    residency chosen once, against which a cache of the last steps' planes is measured at the same HBM bytes."""
    calib = _host_reads(calib_depths, resident)
    freq = calib.mean(axis=0).reshape(calib.shape[1], -1)  # [N, D * 4]
    kept = np.zeros_like(freq, bool)
    np.put_along_axis(kept, np.argsort(-freq, axis=1, kind="stable")[:, :slots], True, axis=1)
    return _missed(depths, resident, kept)


def gain_new(depths: np.ndarray, mean_importance: np.ndarray, resident: int, slots: int) -> float:
    """:func:`static_new` with the set ``Placement(warm_planes=slots)`` keeps: the planner's own marginal gains
    ``g_j 4^-i`` at the groups' mean importance ``mean_importance [N..., D]`` (``E[sum_h q_j^2] Var(k_j)``,
    :func:`~fathom_jax.store.tiered.warm_choice`): a set chosen from statistics alone."""
    kept = np.asarray(warm_choice(jnp.asarray(mean_importance.reshape(-1, mean_importance.shape[-1])), resident,
                                  slots)) > 0  # [N, D, 4]
    return _missed(depths, resident, kept)


def reuse_rows(inputs: str, depths_by_budget: dict, calib_by_budget: dict, head_dim: int, mean_importance,
               variance, prompt_importance=None, **extra) -> list[dict]:
    """One row per (budget, resident planes, window) from ``depths [T, ...groups, D]`` per budget; the fixed set of
    the same bytes as the window's cache from the plans of calibration queries ``calib_by_budget``."""
    rows = []
    for budget, depths in depths_by_budget.items():
        for resident in RESIDENT:
            for window in WINDOWS:
                r = plane_reuse(depths, resident, window)
                rows.append({"inputs": inputs, "budget": budget, "budget_at_d128": budget * 128 // head_dim,
                             "head_dim": head_dim, "resident": resident, "window": window, "read": r.read, "new": r.new,
                             "held_mean": r.held_mean, "held_max": r.held_max, "steps": int(depths.shape[0]),
                             "static_new": static_new(depths, calib_by_budget[budget], resident, r.held_max),
                             "gain_new": gain_new(depths, mean_importance, resident, r.held_max),
                             "variance_new": gain_new(depths, variance, resident, r.held_max),
                             "prompt_new": None if prompt_importance is None else
                             gain_new(depths, prompt_importance, resident, r.held_max), **extra})
        print(f"[{inputs}] budget {budget}: new share (p = 1, W = 1) "
              f"{next(r['new'] for r in rows if r['budget'] == budget and r['resident'] == 1 and r['window'] == 1):.3f}",
              flush=True)
    return rows


def synthetic_rows(steps: int) -> list[dict]:
    from scripts import bench_offload as bench  # the benchmark's own definitions of its keys and queries
    from scripts import offload_setup
    from scripts.offload_inputs import HONEST_DRIFT, HONEST_KEYS, drifting_queries

    cfg = bench.QWEN3_8B
    calib, _ = offload_setup.synthetic_calibration(cfg, keys=HONEST_KEYS)
    q0 = np.asarray(offload_setup.random_step_inputs(cfg, 1)[0])  # [L, Hkv, G, D]
    rows = []
    def depths(q):  # [L, T, Hkv, G, D] -> per budget [T, L, Hkv, D]
        return {b: np.moveaxis(np.asarray(plan_depths(Fathom(b), q, calib)), 1, 0) for b in BUDGETS}

    q_calib = jnp.asarray(np.random.default_rng(5).standard_normal((q0.shape[0], steps) + q0.shape[1:]), jnp.float32)
    drawn = depths(q_calib)  # the fixed set's calibration: independent Gaussian queries
    g = _mean_importance(q_calib, calib.variance)
    rows = []
    for name, rho in (("honest (drift 0.96)", HONEST_DRIFT), ("honest keys, fresh queries", 0.0)):
        q = jnp.stack(drifting_queries(q0, rho, steps), axis=1)
        rows += reuse_rows(name, depths(q), drawn, cfg.head_dim, g, np.asarray(calib.variance),
                           model="synthetic (Qwen3-8B shapes)")
    return rows


def _mean_importance(q, variance) -> np.ndarray:
    """``[L, Hkv, D]``: ``E[sum_h q_j^2] Var(k_j)`` over calibration queries ``q [L, T, Hkv, G, D]``."""
    return np.asarray(jnp.mean(jnp.sum(q * q, axis=-2), axis=1) * variance)


def model_rows(model_name: str, context: int, positions: int, calibration_tokens: int) -> tuple[list[dict], dict]:
    from fathom_jax.eval import fidelity as fid
    from fathom_jax.eval import texts
    from fathom_jax.eval.sweeps import corpus_calibration
    from fathom_jax.models import capture_qkv
    from fathom_jax.models.hub import known_model, load_model

    model, tok, cfg = load_model(model_name)
    ids = texts.token_window(tok.encode(texts.evaluation_text()[0]), context, name="evaluation text")
    cap = fid.Capture(**capture_qkv(model, jnp.asarray(ids)))
    calib, calib_cap, _ = corpus_calibration(model, tok, calibration_tokens)

    def depths(capture, pos):  # per budget [T, L, Hkv, D]
        q = jnp.stack([capture.layer_queries(layer, pos) for layer in range(capture.q.shape[0])], axis=1)
        d = q.shape[-1]
        return {b * d // 128: np.asarray(jax.vmap(lambda qt: plan_depths(Fathom(b * d // 128), qt, calib))(q))
                for b in BUDGETS}

    pos = np.arange(context - positions, context, dtype=np.int32)
    calib_pos = np.linspace(64, calibration_tokens - 1, positions).astype(np.int32)  # past the first tokens' sinks
    title = known_model(model_name).title
    layers = list(getattr(cfg, "global_layers", range(cap.k.shape[0])))
    q_calib = jnp.stack([calib_cap.layer_queries(layer, calib_pos) for layer in range(calib_cap.q.shape[0])])
    prompt_pos = np.arange(max(0, pos[0] - PROMPT_TOKENS), pos[0], dtype=np.int32)  # the prompt's last tokens
    q_prompt = jnp.stack([cap.layer_queries(layer, prompt_pos) for layer in range(cap.q.shape[0])])
    return reuse_rows(f"{title.split(' (')[0]}, {context // 1024}k", depths(cap, pos), depths(calib_cap, calib_pos),
                      cap.q.shape[-1], _mean_importance(q_calib, calib.variance), np.asarray(calib.variance),
                      _mean_importance(q_prompt, calib.variance), model=title), {
        "model": title, "context": context, "positions": [int(pos[0]), int(pos[-1])], "layers": layers,
        "calibration_tokens": calibration_tokens}


def main(argv=None):
    from fathom_jax.models.hub import KNOWN_MODELS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=KNOWN_MODELS)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--positions", type=int, default=256, help="consecutive decode positions at the window's end")
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=256, help="steps of the synthetic queries")
    ap.add_argument("--no-synthetic", action="store_true")
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--append", action="store_true", help="add to results/plane_reuse.json (replacing its rows of the "
                                                          "same inputs)")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    if not max(WINDOWS) < args.positions <= args.context or args.steps <= max(WINDOWS):
        ap.error(f"--positions must lie in ({max(WINDOWS)}, --context] and --steps exceed {max(WINDOWS)}")
    prefix = os.path.join(args.out, "plane_reuse")
    if args.append and not os.path.isfile(prefix + ".json"):
        ap.error(f"--append: no {prefix}.json to add to")
    t0 = time.time()
    rows, info = [], {}
    if not args.no_synthetic:
        rows += synthetic_rows(args.steps)
    if not args.no_model:
        model_part, info = model_rows(args.model, args.context, args.positions, args.calibration_tokens)
        rows += model_part
    run = {"machine": harness.machine(), "command": harness.command("scripts.plane_reuse", argv), "config": vars(args),
           "model": info, "wall_seconds": round(time.time() - t0, 1)}
    res = {"runs": [], "rows": []}
    if args.append:
        with open(prefix + ".json") as f:
            res = json.load(f)
        res["rows"] = [r for r in res["rows"] if r["inputs"] not in {n["inputs"] for n in rows}]
    res["runs"].append(run)
    res["rows"] += rows
    print(harness.write_results(prefix, res, report))


def report(res: dict) -> str:
    lines = ["# Host planes a decode step shares with the steps before it", "",
             "A Fathom step reads channel j's planes `[p, depth_j)` from the host (`p` resident planes). `read`: "
             "channel planes per KV group and step (one bit per token each); `new (W)`: the share of them that none of "
             "the last W steps read (what a device cache of those steps' planes would still fetch); `held`: the "
             "channel planes such a cache holds, this step's included (mean / max over steps and groups). At 1M "
             "tokens one channel plane of one group is 128 KiB, so the Qwen3-8B step (36 layers x 8 groups) moves "
             "`read x 36 MiB` of planes without a cache and `new` of that with one, and the cache takes "
             "`held max x 36 MiB` of HBM (those columns: the rows of Qwen3-8B's D = 128 only).", "",
             "Against a cache, sets chosen once, of the same bytes (each group's `held max` channel planes at W = 1, "
             "or at W = 8): `fixed set` the ones the plans of calibration queries read most often (the calibration "
             "text's for a model, independent Gaussian queries for the synthetic keys); `by mean gains` those with the "
             "largest planner gains `g_j 4^-i` at the mean importance `E[sum_h q_j^2] Var(k_j)` of those queries "
             "(statistics, no plans); `by the prompt's gains` the same at the mean importance of the model's own "
             f"queries at the {PROMPT_TOKENS} positions before the decode steps (what a prefill could choose); `by key "
             "variance` by the gains of the keys' variances alone (no query statistic).", "",
             "| inputs | Fathom (at D = 128) | bits | p | read | new (W=1) | new (W=2) | new (W=4) | new (W=8) | "
             "fixed set, bytes of W=1 / W=8: new | by mean gains: new | by the prompt's gains: new | by key variance: new | "
             "held W=1 mean / max | "
             "held W=8 mean / max | 1M: MB a step (no cache / W = 1) | 1M: cache GB (W = 1) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keyed = {(r["inputs"], r["budget"], r["resident"], r["window"]): r for r in res["rows"]}
    for inputs, budget, resident in dict.fromkeys((r["inputs"], r["budget"], r["resident"]) for r in res["rows"]):
        w = {window: keyed[(inputs, budget, resident, window)] for window in WINDOWS}
        one = w[1]
        mib = 36 * 8 * ONE_M / 8 / 2**20  # MiB per channel plane per step: 36 layers x 8 groups x 128 KiB
        lines.append(
            f"| {inputs} | {one['budget_at_d128']} | {one['budget']} | {resident} | {one['read']:.1f} | "
            + " | ".join(f"{w[x]['new']:.3f}" for x in WINDOWS)
            + f" | {w[1]['static_new']:.3f} / {w[8]['static_new']:.3f} | {w[1]['gain_new']:.3f} | "
            + ("" if w[1].get("prompt_new") is None else f"{w[1]['prompt_new']:.3f}")
            + f" | {w[1]['variance_new']:.3f}"
            + f" | {w[1]['held_mean']:.1f} / {w[1]['held_max']} | {w[8]['held_mean']:.1f} / {w[8]['held_max']} | "
            + (f"{one['read'] * mib * 2**20 / 1e6:.0f} / {one['read'] * one['new'] * mib * 2**20 / 1e6:.0f} | "
               f"{one['held_max'] * mib * 2**20 / 1e9:.2f} |" if one["head_dim"] == 128 else " | |"))
    lines += ["", "## Residency by plane against residency by channel plane", "",
              "Per KV group, in channel planes (one bit per token each; D = 64 / 128 / 256 of them per plane for "
              "SmolLM2 / Qwen3-8B / Gemma 3): what sits in HBM and what a step still reads from the host. `plane 0`: "
              "today's `resident_planes=1`, every channel's plane 0; `fixed set`: each group's S most often read "
              "channel planes (S = `held max` of the W = 1 cache above), alone or beside plane 0.", "",
              "| inputs | Fathom (at D = 128) | plane 0: HBM / host a step | fixed set: HBM / host a step | plane 0 + fixed "
              "set: HBM / host a step |", "|---|---|---|---|---|"]
    for inputs, budget in dict.fromkeys((r["inputs"], r["budget"]) for r in res["rows"]):
        p0, p1 = keyed[(inputs, budget, 0, 1)], keyed[(inputs, budget, 1, 1)]
        d = p0["head_dim"]
        lines.append(f"| {inputs} | {p0['budget_at_d128']} | {d} / {p1['read']:.1f} | {p0['held_max']} / "
                     f"{p0['read'] * p0['static_new']:.1f} | {d + p1['held_max']} / {p1['read'] * p1['static_new']:.2f} |")
    lines += ["", "Runs:", ""]
    for run in res["runs"]:
        m = run["machine"]
        lines.append(f"- {m['date']}, JAX {m['jax']}, commit {m['commit']}, {m['backend']}: `{run['command']}` "
                     f"({run['wall_seconds']} s)" + (f"; {run['model']['model']}, positions {run['model']['positions']}, "
                                                    f"layers {run['model']['layers']}" if run["model"] else ""))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
