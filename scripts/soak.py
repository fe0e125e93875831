"""Soak: one long decode of a SmolLM2 session with its cache and index in host memory: results/soak_<tag>.{json,md}.

    python3 scripts/soak.py --steps 10000 --check-every 1000 --out $OUT        # on a GPU (pinned_host memory)
    python3 scripts/soak.py --steps 200 --check-every 100 --prompt-tokens 300 --out /tmp/soak   # a CPU check

A prompt that crosses many 64-token blocks is prefilled, then ``--steps`` greedy decode steps run one compiled step
each (the cache donated, host memory written in place). Every ``--check-every`` steps it checks:

* the key index equals a rebuild from every key the cache holds, bit for bit (``index_writes="every_step"``: the
  stores always hold every key; with bf16 rows the cache's K rows are the keys the model produced);
* the step program compiled once (its jit cache holds one entry after the first step);
* device memory in use and the process's resident host memory, against the first check (flat within 1%).

Positions past the model's 8192 are decoded on purpose (RoPE extends; the tokens need not make sense): what is under
test is the cache machinery, not the text.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import harness  # noqa: E402
from fathom_jax import decode  # noqa: E402
from fathom_jax.eval import texts  # noqa: E402
from fathom_jax.index import build_index  # noqa: E402
from fathom_jax.models import generation, load_smollm2  # noqa: E402


def rss_bytes() -> int:
    """The process's resident host memory now (Linux: /proc/self/statm)."""
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_bytes() -> int | None:
    """Device memory in use (None where the backend keeps no statistics: the CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats["bytes_in_use"]) if "bytes_in_use" in stats else None


_build = jax.jit(build_index, static_argnums=(2,), static_argnames=("capacity",))


def index_matches(cache, attn) -> tuple[bool, str]:
    """Whether every layer's index equals build_index over the keys the cache holds (bit for bit)."""
    host = jax.device_get(cache)
    n = np.asarray(host.length)
    for layer in range(host.n_layers):
        keys = jnp.asarray(np.asarray(host.k[layer]), jnp.float32)  # [R, C, D]: rows past each length are zero
        want = _build(keys, None, cache.index.parts, capacity=host.capacity, length=jnp.asarray(np.repeat(
            n, host.groups // host.batch), jnp.int32))
        got = jax.tree.map(lambda a, layer=layer: a[layer], host.index)
        for part, g, w in zip(got.parts, got.data, want.data):
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
                if not np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)):
                    return False, f"layer {layer}, part {part.name}"
    return True, ""


def soak(model, tokenizer, args) -> dict:
    ids = tokenizer.encode(texts.evaluation_text()[0])
    prompt = np.asarray(ids[: args.prompt_tokens], np.int32)[None]
    lengths = np.array([prompt.shape[1]])
    capacity = prompt.shape[1] + args.steps + 64
    attn = decode.from_spec(args.method, k=args.k, placement="pinned_host")
    logits, cache, attn = generation.prefill(model, prompt, lengths, attn, capacity)
    tokens = jnp.argmax(logits, -1).astype(jnp.int32)
    run = generation.decode_step_program(model, cache, attn)
    checks, t0 = [], time.time()
    first = None
    for step in range(1, args.steps + 1):
        tokens, _, cache = generation.decode_step(model, tokens, cache, attn)
        if step % args.check_every and step != args.steps:
            continue
        jax.block_until_ready(cache.length)
        ok, where = index_matches(cache, attn)
        mem = {"device_bytes": device_bytes(), "rss_bytes": rss_bytes()}
        first = first or mem
        checks.append({"step": step, "length": int(np.asarray(cache.length)[0]), "index_equals_rebuild": ok,
                       "mismatch": where, "programs": run.jit._cache_size(), **mem,
                       "device_vs_first": None if first["device_bytes"] is None else
                       mem["device_bytes"] / max(1, first["device_bytes"]),
                       "rss_vs_first": mem["rss_bytes"] / max(1, first["rss_bytes"]), "elapsed_s": time.time() - t0})
        print(checks[-1], flush=True)
    return {"method": args.method, "k": args.k, "prompt_tokens": int(prompt.shape[1]), "steps": args.steps,
            "host_memory": attn.placement.memory_kind, "ms_per_step": (time.time() - t0) / args.steps * 1e3,
            "checks": checks,
            "passed": all(c["index_equals_rebuild"] and c["programs"] == 1 for c in checks)
            and all(abs(c["rss_vs_first"] - 1) <= 0.01 and (c["device_vs_first"] is None or
                                                              abs(c["device_vs_first"] - 1) <= 0.01) for c in checks)}


def write_report(res: dict, prefix: str) -> None:
    m, r = res["machine"], res["soak"]
    lines = [f"# Soak: {r['steps']} decode steps of one SmolLM2 session in {r['host_memory']} memory", "",
             f"{m['date']}, {m['device']}, JAX {m['jax']}, commit {m['commit']}. Command: `{res['command']}`.",
             f"{r['method']}, k = {r['k']}, a {r['prompt_tokens']}-token prompt of standard-library code; "
             f"{r['ms_per_step']:.1f} ms per step with the checks. Passed: **{r['passed']}**.", "",
             "| step | tokens | index = rebuild | step programs | device MB | vs first | host RSS MB | vs first |",
             "|---|---|---|---|---|---|---|---|"]
    for c in r["checks"]:
        device = "n/a | n/a" if c["device_bytes"] is None else f"{c['device_bytes'] / 1e6:.0f} | {c['device_vs_first']:.4f}"
        lines.append(f"| {c['step']} | {c['length']} | {c['index_equals_rebuild']} {c['mismatch']} | {c['programs']} | "
                     f"{device} | {c['rss_bytes'] / 1e6:.0f} | {c['rss_vs_first']:.4f} |")
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10000)
    ap.add_argument("--check-every", type=int, default=1000)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--method", default="fathom:32")
    ap.add_argument("--k", type=int, default=128)
    ap.add_argument("--tag", default=f"smollm2_{jax.default_backend()}")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.check_every < 1 or args.prompt_tokens < 65:
        ap.error("--steps and --check-every must be >= 1, --prompt-tokens >= 65 (more than one 64-token block)")
    model, tokenizer, _ = load_smollm2()
    t = time.time()
    res = {"machine": harness.machine(), "command": " ".join(sys.argv), "soak": soak(model, tokenizer, args)}
    res["wall_seconds"] = time.time() - t
    os.makedirs(args.out, exist_ok=True)
    prefix = os.path.join(args.out, f"soak_{args.tag}")
    harness.write_json(prefix + ".json", res)
    write_report(res, prefix)
    print(f"{'passed' if res['soak']['passed'] else 'FAILED'}: {prefix}.md", flush=True)
    return 0 if res["soak"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
