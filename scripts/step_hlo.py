"""What a compiled decode step moves: its optimized HLO, the largest instructions by output bytes (with the JAX op
and source line each came from), the copies and dynamic slices among them, and the step's time, per set of XLA
compiler options (one line of ``--option NAME=VALUE ...`` per set; the first set is always the default).

    python3 scripts/step_hlo.py --context 32k --batch 8 --out $OUT \\
        --option xla_gpu_enable_dynamic_slice_fusion=true

Writes ``step_<tag>_<i>.hlo.txt`` (set ``i``) and ``step_<tag>.json`` under ``--out``. A diagnostic for the full step
(QKV, sparse attention, MLP, lm_head) of the Qwen3-8B-shaped benchmark model (``scripts/bench_offload.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import bench_offload as bench  # noqa: E402
import harness  # noqa: E402
from fathom_jax.hlo import device_copies, running_instructions  # noqa: E402
from fathom_jax.models import sparse  # noqa: E402
from fathom_jax.models.llama import split_attention  # noqa: E402
from fathom_jax.placement import Placement  # noqa: E402

def summary(text: str, top: int = 40, min_bytes: int = 1 << 20) -> dict:
    big = running_instructions(text, min_bytes=min_bytes)
    copies = device_copies(text, min_bytes=min_bytes)
    return {"top": big[:top], "copies": copies, "n_copies": len(copies),
            "copy_bytes": sum(i["bytes"] for i in copies)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", default="32k")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--method", default="Fathom 48", choices=list(bench.METHODS))
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--option", action="append", nargs="+", default=[],
                    help="one set of XLA compiler options NAME=VALUE ... (repeat for more sets)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--out", default="results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the script)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    context = bench.parse_ctx(args.context)
    cfg = bench.SMOKE if args.smoke else bench.QWEN3_8B
    placement = Placement("pinned_host")
    calib, scale = bench.synthetic_calibration(cfg)
    attn = bench.hook(bench.METHODS[args.method], cfg, calib, args.k, placement, "pallas")
    model = bench.random_model(cfg, placement)
    cache = bench.build_cache(attn, cfg, scale, context=context, batch=args.batch, shared_kv=False)
    start = jax.tree.map(jnp.copy, Placement.detach_bulk(cache))
    _, state = nnx.split(model)
    attn_leaves = split_attention(attn)[1]
    tokens = jnp.zeros((args.batch,), jnp.int32)
    res = {"machine": harness.machine(), "command": " ".join(sys.argv), "context": context, "batch": args.batch,
           "method": args.method, "sets": []}
    for i, options in enumerate([[]] + args.option):
        extra = {}
        for item in options:
            name, _, value = item.partition("=")
            extra[name] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
        with_extra = dataclasses.replace(attn, placement=dataclasses.replace(attn.placement, xla_options=extra))
        opts = with_extra.placement.compiler_options
        programs = sparse.host_programs(model, with_extra, cache)
        t = time.time()
        compiled = programs.lower_step(state, tokens, cache, attn_leaves).compile()
        compile_s = time.time() - t
        text = compiled.as_text()
        with open(os.path.join(args.out, f"step_{args.tag}_{i}.hlo.txt"), "w") as f:
            f.write(text)
        cache = Placement.attach_bulk(jax.tree.map(jnp.copy, start), cache)

        def call(st, programs=programs):
            nxt, _, cache = programs.step(state, st[0], st[1], attn_leaves)
            return nxt, cache

        timing, (_, cache) = harness.timeit_calls(call, (tokens, cache), n=args.steps, repeats=3)
        s = summary(text)
        print(f"[set {i}] {opts}: compile {compile_s:.1f} s, step {timing['median_ms']:.2f} ms, "
              f"{s['n_copies']} copies / dynamic slices of >= 1 MB, {s['copy_bytes'] / 1e6:.1f} MB", flush=True)
        for ins in s["copies"][:30]:
            print(f"   copy {ins['name']:40s} {ins['opcode']:22s} {ins['bytes'] / 1e6:9.1f} MB  {ins['op']}  {ins['source']}")
        for ins in s["top"][:25]:
            print(f"   top  {ins['name']:40s} {ins['opcode']:22s} {ins['bytes'] / 1e6:9.1f} MB  {ins['op']}  {ins['source']}")
        res["sets"].append({"options": opts, "compile_s": compile_s, "timing": timing, **s})
        harness.write_json(os.path.join(args.out, f"step_{args.tag}.json"), res)


if __name__ == "__main__":
    main()
