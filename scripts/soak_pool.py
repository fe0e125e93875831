"""Soak a session pool with churn: results/soak_pool_<tag>.{json,md}.

    python3 -m scripts.soak_pool --events 200 --out $OUT                                          # SmolLM2, a GPU
    python3 -m scripts.soak_pool --model tiny --events 40 --prompt-tokens 100 --out /tmp/soak     # a CPU check

A churn trace of ``--events`` rounds (``scripts/pool_trace.churn``: arrivals, decode bursts, pauses, saves to disk
and loads, resumes, departures; more sessions than slots) runs on one pool. Then every session is decoded again
alone and uninterrupted in the same pool, and checked:

* each session's tokens equal its uninterrupted decode (bit for bit: greedy tokens, every one), across every pause,
  save, load and the other sessions joining and leaving;
* the step program compiled once, before the trace (its jit cache gained one entry: none where an earlier pool of
  the same layout compiled it), and never during it;
* memory flat: with every session gone, device memory in use (where the backend reports it) and the bytes of live
  JAX arrays equal what they were with the pool empty before the trace (within 1%).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import jax
import numpy as np

from fathom_jax import decode
from fathom_jax.serve import PoolConfig, SessionPool
from scripts import harness, pool_trace


def soak(model, prompts: list, args) -> dict:
    attn = decode.from_spec(args.method, k=args.k, rows=None if args.rows == "model" else args.rows)
    capacity = max(p.size for p in prompts) + args.events * args.burst + 64
    pool = SessionPool(model, attn, PoolConfig(slots=args.slots, capacity=capacity))
    events = pool_trace.churn(len(prompts), args.slots, args.events, args.burst, seed=args.seed)
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=args.save_dir) as save_dir:
        pool_trace.warm_up(pool, prompts[0], save_dir)
        before, compiled = pool_trace.memory(), pool.step_compiles()
        res = pool_trace.run(pool, events, prompts, save_dir)
    gc.collect()
    after = pool_trace.memory()
    trace_s = time.time() - t0
    sessions = []
    for i, got in sorted(res["tokens"].items()):
        want = pool_trace.lone_tokens(pool, prompts[i], len(got))
        sessions.append(dict(session=i, tokens=len(got), equal=got == want,
                             first_difference=next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)))
    flat = {k: None if before[k] is None else after[k] / max(1, before[k]) for k in before}
    ops = {op: sum(e["op"] == op for e in events) for op in ("add", "steps", "pause", "resume", "save", "load",
                                                            "remove")}
    return dict(method=args.method, k=args.k, rows=args.rows, slots=args.slots, sessions=len(prompts),
                capacity=capacity, events=len(events), ops=ops, trace_seconds=trace_s,
                step_compiles=pool.step_compiles(), step_compiles_in_trace=pool.step_compiles() - compiled,
                session_checks=sessions, memory_before=before,
                memory_after=after, memory_vs_before=flat,
                passed=all(s["equal"] for s in sessions) and pool.step_compiles() <= 1 and pool.step_compiles() == compiled
                and all(v is None or abs(v - 1) <= 0.01 for v in flat.values()))


def write_report(res: dict, prefix: str) -> None:
    m, r = res["machine"], res["soak"]
    ops = ", ".join(f"{n} {op}" for op, n in r["ops"].items())
    flat = ", ".join(f"{k} {v:.4f}" for k, v in r["memory_vs_before"].items() if v is not None)
    lines = [f"# Soak of a session pool: {r['events']} events, {r['sessions']} sessions in {r['slots']} slots", "",
             f"{m['date']}, {m['device']}, JAX {m['jax']}, commit {m['commit']}. Command: `{res['command']}`.",
             f"{r['method']}, k = {r['k']}, rows `{r['rows']}`, capacity {r['capacity']}. Events: {ops}. Passed: "
             f"**{r['passed']}**.", "",
             f"Step programs compiled: {r['step_compiles']} (by the warm-up; during the trace: "
             f"{r['step_compiles_in_trace']}). Memory with the pool empty after the trace against before "
             f"it: {flat}.", "", "| session | tokens | equal to its uninterrupted decode | first difference |",
             "|---|---|---|---|"]
    for s in r["session_checks"]:
        lines.append(f"| {s['session']} | {s['tokens']} | {s['equal']} | {s['first_difference']} |")
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--events", type=int, default=200)
    pool_trace.add_options(ap, prompt_tokens=1000, slots=3, sessions=6, burst=6, method="fathom:32", k=128,
                           rows="model")
    ap.add_argument("--tag", default=None, help="default <model>_<backend>")
    args = pool_trace.parse(ap, argv, ("events", "sessions", "slots", "burst", "prompt_tokens", "k"))
    rng = np.random.default_rng(args.seed)
    if args.model == "tiny":
        from scripts.bench_pool import build_model

        model = build_model("tiny")
        ids = rng.integers(0, model.config.vocab, args.prompt_tokens * args.sessions)
    else:
        from fathom_jax.eval import texts
        from fathom_jax.models import load_smollm2

        model, tokenizer, _ = load_smollm2()
        ids = np.asarray(tokenizer.encode(texts.evaluation_text()[0]))
    lengths = [args.prompt_tokens - int(rng.integers(0, 64)) for _ in range(args.sessions)]
    starts = [int(rng.integers(0, max(1, ids.size - n))) for n in lengths]
    prompts = [np.asarray(ids[s:s + n], np.int32) for s, n in zip(starts, lengths)]
    tag = args.tag or f"{args.model}_{jax.default_backend()}"
    res = dict(machine=harness.machine(), command=harness.command("scripts.soak_pool", argv),
               soak=soak(model, prompts, args))
    return harness.write_soak(res, os.path.join(args.out, f"soak_pool_{tag}"), write_report)


if __name__ == "__main__":
    sys.exit(main())
