"""Session-pool benchmark: a churn trace (arrivals, decode bursts, pauses, saves and loads, departures, more sessions
than slots) on a :class:`fathom_jax.serve.SessionPool`: results/pool_<tag>.{json,md,png}.

    python3 -m scripts.bench_pool --model qwen3-8b --prompt-tokens 32768 --slots 4 --sessions 8 --out $OUT  # H200
    python3 -m scripts.bench_pool --model tiny --prompt-tokens 200 --slots 2 --sessions 4 --out /tmp/pool   # CPU

By default the pool's cache is issue 47's layout: K/V rows (k8v8) and planes 1-3 in ``pinned_host`` memory, plane 0
of every channel in HBM (``--placement pinned_host --resident-planes 1``); ``--placement device`` keeps it all in HBM.
Parked sessions live in host memory either way.

Reports the aggregate decode rate over the trace's bursts (tokens of every active session per second, the streamed
tokens read back after each step) against the fixed batch of the same size (the pool's cache with every slot full,
decoded by the plain ``decode_step`` driver), the time to add a session (a prefill of its prompt alone and the move
into a slot or host memory), save and load rates (a session's bytes over the seconds), and host and HBM bytes over
the trace, beside the disk's own rate in the save directory (plain write + fsync and read-back of a session's bytes).
Qwen3-8B shapes run with random bf16 weights (``scripts/offload_setup.random_model``) and random prompts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import numpy as np

from fathom_jax import decode
from fathom_jax.models import generation
from fathom_jax.decode import Placement
from fathom_jax.models import LlamaConfig
from fathom_jax.serve import PoolConfig, SessionPool
from scripts import harness, pool_trace

TINY = LlamaConfig(vocab=97, hidden=32, intermediate=48, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=8,
                   rope_theta=1e4, rms_norm_eps=1e-6, attention_bias=True, qk_norm=True)


def build_model(name: str):
    if name == "tiny":
        from flax import nnx

        from fathom_jax.models.llama import LlamaForCausalLM

        return LlamaForCausalLM(TINY, rngs=nnx.Rngs(0))
    from scripts.bench_offload import QWEN3_8B, SMOKE
    from scripts.offload_setup import random_model

    return random_model(SMOKE if name == "smoke" else QWEN3_8B, Placement())  # random bf16 weights


def prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[np.ndarray]:
    """Random prompts of ``length`` minus up to 63 tokens (sessions of different lengths, in one prefill bucket when
    ``length`` is a multiple of 64)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length - int(rng.integers(0, min(64, length)))).astype(np.int32)
            for _ in range(count)]


def disk_rate(directory: str | None, nbytes: int, block: int = 64 << 20) -> tuple[float, float]:
    """GB/s of plain file I/O in ``directory``: ``nbytes`` written in ``block``-byte writes and fsynced, then read back
    (as soon after as a load follows its save, so from wherever the system keeps it) into one reused buffer."""
    buf = np.random.default_rng(0).integers(0, 256, min(block, max(nbytes, 1)), np.uint8)
    fd, path = tempfile.mkstemp(dir=directory, prefix="disk_rate_")
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb", buffering=0) as f:
            for at in range(0, nbytes, buf.size):
                f.write(memoryview(buf)[: min(buf.size, nbytes - at)])
            os.fsync(f.fileno())
        write = time.perf_counter() - t0
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        read = time.perf_counter() - t0
    finally:
        os.remove(path)
    return nbytes / write / 1e9, nbytes / read / 1e9


def fixed_batch_rate(pool: SessionPool, steps: int) -> float:
    """Tokens per second of the plain decode driver on the pool's cache with every slot full (consumes the pool)."""
    attn, cache = pool.attention, pool.cache
    tokens = np.zeros(pool.config.slots, np.int32)
    tok, _, cache = generation.decode_step(pool.model, tokens, cache, attn)  # compile
    jax.block_until_ready(tok)
    t0 = time.perf_counter()
    for _ in range(steps):
        tok, _, cache = generation.decode_step(pool.model, tok, cache, attn)
    jax.block_until_ready(tok)
    return pool.config.slots * steps / (time.perf_counter() - t0)


def placement(args) -> Placement:
    """The pool cache's placement: ``--placement`` with ``--resident-planes`` (default 1 in pinned_host, 0 in HBM)."""
    resident = args.resident_planes if args.resident_planes is not None else int(args.placement == "pinned_host")
    return Placement(args.placement, resident_planes=resident)


def bench(args) -> dict:
    model = build_model(args.model)
    vocab = model.config.vocab
    attn = decode.from_spec(args.method, k=args.k, rows=None if args.rows == "model" else args.rows,
                            placement=placement(args))
    if attn.placement.note:
        print("note:", attn.placement.note, file=sys.stderr)
    capacity = args.prompt_tokens + args.rounds * args.burst + 2 * args.fixed_steps + 64
    pool = SessionPool(model, attn, PoolConfig(slots=args.slots, capacity=capacity))
    texts = prompts(vocab, args.sessions, args.prompt_tokens)
    events = pool_trace.churn(args.sessions, args.slots, args.rounds, args.burst, seed=args.seed)
    with tempfile.TemporaryDirectory(dir=args.save_dir) as save_dir:
        pool_trace.warm_up(pool, texts[0], save_dir)  # nothing below compiles but a prefill of a new length bucket
        res = pool_trace.run(pool, events, texts, save_dir)
        disk = [disk_rate(save_dir, res["session_bytes"]) for _ in range(args.disk_repeats)]
    steps = [e for e in res["timeline"] if e["op"] == "steps"]
    decoded, seconds = sum(e["tokens"] for e in steps), sum(e["seconds"] for e in steps)
    full = [pool.add(t) for t in texts[: args.slots]]
    for _ in range(2):
        pool.step()
    one = res["session_bytes"]
    where = pool.attention.placement
    out = dict(model=args.model, method=args.method, k=args.k, rows=args.rows, slots=args.slots,
               placement=where.memory, memory_kind=where.memory_kind, resident_planes=where.resident_planes,
               sessions=args.sessions, prompt_tokens=args.prompt_tokens, capacity=capacity, rounds=args.rounds,
               burst=args.burst, events=len(events), session_bytes=one,
               pool_tokens_per_s=decoded / seconds if seconds else None, pool_steps=sum(e["steps"] for e in steps),
               mean_active=decoded / max(1, sum(e["steps"] for e in steps)),
               full_pool_tokens_per_s=_full_rate(pool, args.fixed_steps),
               add_s=res["add_s"], save_gb_s=[one / s / 1e9 for s in res["save_s"]],
               load_gb_s=[one / s / 1e9 for s in res["load_s"]], disk_write_gb_s=[w for w, _ in disk],
               disk_read_gb_s=[r for _, r in disk], step_compiles=res["step_compiles"],
               timeline=res["timeline"], slots_filled=len(full))
    out["fixed_batch_tokens_per_s"] = fixed_batch_rate(pool, args.fixed_steps)
    return out


def _full_rate(pool: SessionPool, steps: int) -> float:
    t0 = time.perf_counter()
    tokens = sum(len(pool.step()) for _ in range(steps))
    return tokens / (time.perf_counter() - t0)


def _fmt(values, spec=".3g") -> str:
    return "n/a" if not values else f"{np.median(values):{spec}} (median of {len(values)})"


def write_report(res: dict, prefix: str) -> None:
    m, r = res["machine"], res["pool"]
    lines = [f"# Session pool: {r['slots']} slots, {r['sessions']} sessions of ~{r['prompt_tokens']} tokens "
             f"({r['model']})", "",
             f"{m['date']}, {m['device']}, JAX {m['jax']}, commit {m['commit']}. Command: `{res['command']}`.",
             f"{r['method']}, k = {r['k']}, rows `{r['rows']}`, capacity {r['capacity']}; the pool's cache in "
             f"{r['memory_kind']} memory (placement {r['placement']}, resident planes {r['resident_planes']}); a "
             f"churn trace of "
             f"{r['events']} events ({r['rounds']} bursts of 1-{r['burst']} steps). One session: "
             f"{r['session_bytes'] / 1e6:.1f} MB. Step programs compiled: {r['step_compiles']}.", "",
             "| measure | value |", "|---|---|",
             f"| churn: tokens/s (all active sessions; {r['mean_active']:.2f} active per step on average) | "
             f"{r['pool_tokens_per_s']:.1f} |",
             f"| pool, every slot full: tokens/s (streamed, read back each step) | {r['full_pool_tokens_per_s']:.1f} |",
             f"| fixed batch of {r['slots']} (plain decode_step on the same cache) : tokens/s | "
             f"{r['fixed_batch_tokens_per_s']:.1f} |",
             f"| add a session (prefill alone + move), s | {_fmt(r['add_s'])} |",
             f"| save, GB/s | {_fmt(r['save_gb_s'])} |",
             f"| the disk beside it: write + fsync of as many bytes, plain file I/O, GB/s | "
             f"{_fmt(r['disk_write_gb_s'])} |", f"| load, GB/s | {_fmt(r['load_gb_s'])} |",
             f"| the disk beside it: read back, plain file I/O, GB/s | {_fmt(r['disk_read_gb_s'])} |", "",
             "| event | session | s | parked | host MB | HBM MB (pool) | device in use MB |", "|---|---|---|---|---|---|---|"]
    for e in r["timeline"]:
        dev = "n/a" if e["device_in_use"] is None else f"{e['device_in_use'] / 1e6:.1f}"
        who = "" if e["session"] is None else e["session"]
        op = e["op"] if e["op"] != "steps" else f"{e['steps']} steps"
        lines.append(f"| {op} | {who} | {e['seconds']:.3f} | {e['parked']} | {e['host_bytes'] / 1e6:.1f} | "
                     f"{e['hbm_bytes'] / 1e6:.1f} | {dev} |")
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    _plot(r, prefix + ".png")


def _plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [e["at"] for e in r["timeline"]]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    bursts = [e for e in r["timeline"] if e["op"] == "steps" and e["seconds"]]
    a.plot([e["at"] for e in bursts], [e["tokens"] / e["seconds"] for e in bursts], "o-", label="churn bursts")
    a.axhline(r["fixed_batch_tokens_per_s"], color="k", ls="--", label=f"fixed batch of {r['slots']}")
    a.set_ylabel("tokens/s")
    a.legend()
    b.step(t, [e["host_bytes"] / 1e9 for e in r["timeline"]], where="post", label="host (pool cache + parked)")
    b.step(t, [e["hbm_bytes"] / 1e9 for e in r["timeline"]], where="post", label="HBM (pool cache)")
    if all(e["device_in_use"] is not None for e in r["timeline"]):
        b.step(t, [e["device_in_use"] / 1e9 for e in r["timeline"]], where="post", label="device in use")
    b.set_ylabel("GB")
    b.set_xlabel("seconds into the trace")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny", "smoke", "qwen3-8b"), default="qwen3-8b",
                    help="tiny: f32, 3 layers, head_dim 8; smoke: Qwen3-8B's dtype at 3 layers, head_dim 64")
    pool_trace.add_options(ap, prompt_tokens=32768, slots=4, sessions=8, burst=8, method="fathom:48", k=512,
                           rows="k8v8")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--fixed-steps", type=int, default=16)
    ap.add_argument("--placement", choices=("pinned_host", "device"), default="pinned_host",
                    help="where the pool cache's bulk arrays live (pinned_host: device memory where the backend has "
                         "none)")
    ap.add_argument("--resident-planes", type=int, default=None,
                    help="planes of every channel kept in HBM with --placement pinned_host (default 1; 0 in HBM)")
    ap.add_argument("--disk-repeats", type=int, default=3,
                    help="plain write + fsync and read-back measurements of one session's bytes in the save directory")
    ap.add_argument("--tag", default=None, help="default <model>_<prompt tokens>_<backend>")
    args = pool_trace.parse(ap, argv, ("prompt_tokens", "slots", "sessions", "rounds", "burst", "fixed_steps", "k",
                                       "disk_repeats"))
    try:
        placement(args)
    except ValueError as e:
        ap.error(f"--resident-planes: {e}")
    if args.sessions <= args.slots:
        print(f"note: {args.sessions} sessions in {args.slots} slots: none has to park", file=sys.stderr)
    tag = args.tag or f"{args.model}_{args.prompt_tokens}_{jax.default_backend()}"
    res = dict(machine=harness.machine(), command=harness.command("scripts.bench_pool", argv), pool=bench(args))
    os.makedirs(args.out, exist_ok=True)
    prefix = os.path.join(args.out, f"pool_{tag}")
    harness.write_json(prefix + ".json", res)
    write_report(res, prefix)
    r = res["pool"]
    print(f"{prefix}.md: churn {r['pool_tokens_per_s']:.1f} tok/s, full pool {r['full_pool_tokens_per_s']:.1f}, "
          f"fixed batch {r['fixed_batch_tokens_per_s']:.1f}; add {_fmt(r['add_s'])} s; save "
          f"{_fmt(r['save_gb_s'])} GB/s, load {_fmt(r['load_gb_s'])} GB/s (disk: write {_fmt(r['disk_write_gb_s'])}, "
          f"read {_fmt(r['disk_read_gb_s'])}); step compiles {r['step_compiles']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
