"""The collectives a sharded decode step issues, read from its compiled HLO: results/step_collectives_<tag>.{json,md}.

    python3 -m scripts.step_collectives --devices 2,4,8 --contexts 128k,1m --batches 1,8 --out results

For every mesh size, context and batch: the full decode step (QKV, sparse attention, o_proj, MLP, lm_head) of the
Qwen3-8B-shaped benchmark model (``scripts/bench_offload.py``) with the cache in the host layout split over a mesh of
that many CPU host devices, lowered and compiled from shapes alone (nothing is allocated), and every collective in
its HLO: opcode, shape, bytes, how many times one step runs it (a collective inside the layer scan runs once per
layer) and the JAX op it came from. XLA's SPMD partitioner is the same on every backend; the sparse attention here is
the ``xla`` implementation (the Pallas kernels run inside ``shard_map``, per device, and issue no collective).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys


def _devices_flag(argv) -> int:
    """The most devices any mesh asks for (XLA's host device count is fixed before JAX starts)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--devices"):
            value = arg.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "2")
            return max(int(x) for x in value.split(","))
    return 2


if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_devices_flag(sys.argv[1:])}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from fathom_jax import hlo_collectives  # noqa: E402
from fathom_jax.models import LlamaForCausalLM, generation  # noqa: E402
from fathom_jax.decode import Placement, device_mesh  # noqa: E402
from scripts import bench_offload as bench  # noqa: E402
from scripts import harness  # noqa: E402
from scripts import offload_setup  # noqa: E402


def abstract_step(cfg, placement: Placement, *, context: int, batch: int, method: str, k: int):
    """The compiled decode step's HLO text for a cache of ``context`` tokens (+ 64) per sequence, from shapes."""
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    rep = placement.replicated()
    _, state = nnx.split(model)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state)
    calib, _ = offload_setup.synthetic_calibration(cfg)
    shape = offload_setup.cache_shape(cfg, batch, context)
    attn = offload_setup.hook(offload_setup.METHODS[method], calib, k, placement, "xla", shape=shape)
    cache = jax.eval_shape(lambda: attn.init_cache(shape))
    cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache,
                         placement.shardings(cache, cache.bulk()))
    run = generation.decode_step_program(model, cache, attn)
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rep)
    return run.lower(state, tokens, None, cache=cache).compile().as_text()  # None: a Llama keeps no state of its own


def write_report(res: dict, prefix: str) -> None:
    m, c, cfg = res["machine"], res["config"]["model"], res["config"]
    lines = [f"# Collectives of one sharded decode step ({m['backend']}, compiled HLO)", "",
             f"{m['date']}, JAX {m['jax']}, commit {m['commit']}, host {m['host']}. Command: `{res['command']}`.", "",
             f"Model shapes: {c['n_layers']} layers, {c['n_heads']} query / {c['n_kv_heads']} KV heads, D = "
             f"{c['head_dim']}, hidden {c['hidden']}, bf16 weights; {cfg['method']}, k = {cfg['k']}, the cache in "
             "the host layout split over the mesh on the KV-head groups, the weights replicated. `per step`: runs "
             "of the collective in one step (inside the layer scan: once per layer). `bytes`: its output buffer on "
             "each device.", "",
             "| devices | context | batch | collective | shape | bytes | per step | bytes per step | JAX op |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in res["rows"]:
        if not row["collectives"]:
            lines.append(f"| {row['devices']} | {row['context']} | {row['batch']} | none | | | | | |")
        for c in row["collectives"]:
            op = (c["op"] or "").rsplit("/", 3)
            lines.append(f"| {row['devices']} | {row['context']} | {row['batch']} | {c['opcode']} | `{c['shape']}` | "
                         f"{c['bytes']} | {c['per_step']} | {c['bytes'] * c['per_step']} | `{'/'.join(op[-3:])}` |")
    harness.write_json(prefix + ".json", res)
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", default="2", help="mesh sizes (a list)")
    ap.add_argument("--contexts", default="128k,1m")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--method", default="Fathom 48", choices=list(offload_setup.METHODS))
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a check of the script)")
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    cfg = bench.SMOKE if args.smoke else bench.QWEN3_8B
    res = {"machine": harness.machine(), "command": harness.command("scripts.step_collectives", argv),
           "config": {**vars(args), "model": dataclasses.asdict(cfg)}, "rows": []}
    for devices in (int(d) for d in args.devices.split(",")):
        placement = Placement("pinned_host", mesh=device_mesh(devices))
        for context in (offload_setup.parse_ctx(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                text = abstract_step(cfg, placement, context=context, batch=batch, method=args.method, k=args.k)
                row = {"devices": devices, "context": context, "batch": batch, "collectives": hlo_collectives(text)}
                res["rows"].append(row)
                print(devices, context, batch, [(c["opcode"], c["shape"], c["per_step"]) for c in row["collectives"]],
                      flush=True)
    os.makedirs(args.out, exist_ok=True)
    write_report(res, os.path.join(args.out, f"step_collectives_{args.tag}"))


if __name__ == "__main__":
    main()
