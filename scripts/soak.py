"""Soak: one long decode of a SmolLM2 session with its cache and index in host memory: results/soak_<tag>.{json,md}.

    python3 -m scripts.soak --steps 10000 --check-every 1000 --out $OUT        # on a GPU (pinned_host memory)
    python3 -m scripts.soak --steps 10000 --check-every 1000 --rows k8v8 --tag smollm2_gpu_k8v8 --out $OUT
    python3 -m scripts.soak --steps 200 --check-every 100 --prompt-tokens 300 --out /tmp/soak   # a CPU check

A prompt that crosses many 64-token blocks is prefilled, then ``--steps`` greedy decode steps run one compiled step
each (the cache donated, host memory written in place). ``--rows``: how the cache stores K/V rows (``model``: the
model dtype; a compressed format such as ``k8v8``, :mod:`fathom_jax.rows.layout`). Every ``--check-every`` steps it
checks:

* the key index equals a rebuild from every key the model produced, bit for bit (``index_writes="every_step"``: the
  stores always hold every key). Compressed rows keep only a quantized copy of each key, from which a rebuild would
  not match the index (built from the model's keys before compression), so the soak keeps the keys themselves, from
  the cache's own raw tail (:class:`KeyLog`: the index's f32 copy of the newest 64-token block's keys, read as each
  block fills; the step program is unchanged): the blocks the prompt filled equal the index the prefill built
  (``build_index`` of the prompt's keys; no step may change them), every block from the prompt's last partial block
  on equals ``build_index`` of the kept keys, and every layer's length is the cache's. With rows in the model dtype
  the index must also equal a rebuild from the cache's K rows (the keys the model produced), as before;
* the K rows hold those keys: in the model dtype, the keys themselves; compressed, the format's encoding of them
  (the dequantized K of the rows equals that of the kept keys encoded again; a row's K depends on its key alone);
* the step program compiled once (its jit cache holds one entry after the first step);
* device memory in use and the process's resident host memory, against the first check (flat within 1%; the kept
  keys' buffer is allocated and touched before the first step).

Positions past the model's 8192 are decoded on purpose (RoPE extends; the tokens need not make sense): what is under
test is the cache machinery, not the text.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import decode
from fathom_jax.eval import texts
from fathom_jax import BLOCK_TOKENS, WORD_BITS
from fathom_jax.decode import build_index, row_format
from fathom_jax.models import generation, load_smollm2
from scripts import harness


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


def index_matches(cache, attn, host=None) -> tuple[bool, str]:
    """Whether every layer's index equals build_index over the keys the cache's K rows hold (bit for bit): the keys
    the model produced where the rows are in the model dtype. ``host``: the cache already on the host."""
    host = jax.device_get(cache) if host is None else host
    n = np.asarray(host.length)
    for layer in range(host.n_layers):
        keys = jnp.asarray(np.asarray(host.k[layer]), jnp.float32)  # [R, C, D]: rows past each length are zero
        want = _build(keys, None, cache.index.parts, capacity=host.capacity, length=jnp.asarray(np.repeat(
            n, host.groups // host.batch), jnp.int32))
        got = jax.tree.map(lambda a, layer=layer: a[layer], host.index)
        for part, g, w in zip(got.parts, got.data, want.data):
            g, w = _open_tail(g, int(n[0])), _open_tail(w, int(n[0]))
            if not all(map(_same, jax.tree.leaves(g), jax.tree.leaves(w))):
                return False, f"layer {layer}, part {part.name}"
    return True, ""


def _open_tail(data, length: int):
    """A store's data with its tail cut to the partial newest block: once a block fills, appending leaves its keys in
    the tail and a build leaves zeros, and neither is read again (the next append starts the block over)."""
    if not hasattr(data, "tail") or data.tail is None:
        return data
    return dataclasses.replace(data, tail=data.tail[..., :length % BLOCK_TOKENS, :])


@functools.partial(jax.jit, static_argnums=0)
def _encoded_keys(layout, keys):
    """Keys as a compressed row format gives them back (the stored rows' K, dequantized)."""
    return layout.split(layout.join(keys, jnp.zeros_like(keys)))[0]


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def raw_store(index) -> int:
    """The position of the index's plane store of the keys as they are (no rotation): its tail holds each newest
    block's keys in f32."""
    for i, part in enumerate(index.parts):
        if part.kind == "planes" and part.rotation is None:  # the plane store of the keys as they are
            return i
    raise ValueError(f"the soak keeps the keys from the raw plane store's tail; this index has parts "
                     f"{[p.name for p in index.parts]} (choose a method that reads raw planes: fathom, sparq, full4)")


class KeyLog:
    """The keys the model produced, kept by the soak for the exact index check (compressed rows keep only a
    quantized copy): the raw plane store's tail ``[L, R, 64, D]`` (the f32 keys of the newest 64-token block, in the
    cache's small device-memory leaves) is read after the prefill and after every step that fills a block, before
    the next step replaces it. Keys from ``start`` (the prompt's last block boundary) on are kept; the blocks before
    it, which the prefill built from the prompt's keys, are kept as the prefill left them."""

    def __init__(self, cache, steps: int):
        self.part = raw_store(cache.index)
        store = cache.index.data[self.part]
        length = int(np.asarray(cache.length)[0])
        self.start = length // BLOCK_TOKENS * BLOCK_TOKENS
        layers, groups, _, d = store.tail.shape
        room = -(-(length - self.start + steps + 1) // BLOCK_TOKENS) * BLOCK_TOKENS
        self.keys = np.empty((layers, groups, room, d), np.float32)
        self.keys.fill(0.0)  # touched now: the host memory checks see it from the first
        prompt = jax.device_get(store)
        words, blocks = self.start // WORD_BITS, self.start // BLOCK_TOKENS
        self.prompt_planes = np.array(prompt.planes[..., :words])
        self.prompt_scales = np.array(prompt.scales[..., :blocks])
        self.length = length
        self._read_tail(cache)

    def _read_tail(self, cache):
        first = (self.length - 1) // BLOCK_TOKENS * BLOCK_TOKENS  # the block holding the newest key
        count = self.length - first
        if self.length <= self.start or count <= 0:
            return
        tail = np.asarray(cache.index.data[self.part].tail)  # [L, R, 64, D]
        self.keys[:, :, first - self.start:self.length - self.start] = tail[:, :, :count]

    def after_step(self, cache) -> None:
        """Called after every decode step (before the next: the step donates the cache)."""
        self.length += 1
        if self.length % BLOCK_TOKENS == 0:  # the block just filled; the next step starts a new tail
            self._read_tail(cache)

    def check(self, cache, attn, host=None) -> tuple[bool, str]:
        """Whether the index equals a rebuild from the kept keys (see the module docstring) and the K rows hold them:
        ``(True, "")`` or ``(False, where)``."""
        self._read_tail(cache)  # the partial newest block
        host = jax.device_get(cache) if host is None else host
        n = self.length
        if not (np.asarray(host.length) == n).all() or not (np.asarray(host.index.length) == n).all():
            return False, f"lengths {np.unique(np.asarray(host.index.length))} / {np.asarray(host.length)}, want {n}"
        store = host.index.data[self.part]
        words, blocks = self.start // WORD_BITS, self.start // BLOCK_TOKENS
        if not _same(store.planes[..., :words], self.prompt_planes) or not _same(store.scales[..., :blocks],
                                                                                 self.prompt_scales):
            return False, "the prompt's blocks changed since the prefill"
        # Fixed shapes (every kept-key slot, the rest masked by the length): a check compiles once, so the memory
        # checks see the decode loop, not programs compiled for each check's length.
        keys = self.keys
        groups = store.tail.shape[1]
        open_keys = n % BLOCK_TOKENS  # the tail's keys that are read again (see _open_tail)
        for layer in range(host.n_layers):
            want = _build(jnp.asarray(keys[layer]), None, frozenset({host.index.parts[self.part]}),
                          capacity=host.capacity - self.start, length=jnp.full((groups,), n - self.start, jnp.int32))
            (want,) = want.data
            for name, got, ref in (("planes", store.planes[layer][..., words:], want.planes),
                                   ("scales", store.scales[layer][..., blocks:], want.scales),
                                   ("tail", store.tail[layer][..., :open_keys, :], want.tail[..., :open_keys, :])):
                if not _same(got, ref):
                    return False, f"layer {layer}, {name} of the blocks from token {self.start}"
        layout = host.layout
        rows = np.asarray(host.kv[..., self.start:n, :])  # [L or 1, R, n - start, W]
        if rows.shape[0] != host.n_layers:
            return False, "shared K/V rows"  # not a cache the soak makes
        if layout.compressed:
            stored = np.asarray(layout.split(jnp.asarray(rows))[0])
            want = np.asarray(_encoded_keys(layout, jnp.asarray(keys)))[:, :, :n - self.start]
        else:
            stored, want = rows[..., :layout.head_dim], keys[:, :, :n - self.start].astype(rows.dtype)
        if not _same(stored, want):
            return False, "K rows differ from the kept keys" + (" encoded" if layout.compressed else "")
        return True, ""


def soak(model, tokenizer, args) -> dict:
    ids = tokenizer.encode(texts.evaluation_text()[0])
    prompt = np.asarray(ids[: args.prompt_tokens], np.int32)[None]
    lengths = np.array([prompt.shape[1]])
    capacity = prompt.shape[1] + args.steps + 64
    attn = decode.from_spec(args.method, k=args.k, placement="pinned_host", rows=args.rows)
    logits, cache, attn = generation.prefill(model, prompt, lengths, attn, capacity)
    tokens = jnp.argmax(logits, -1).astype(jnp.int32)
    log = KeyLog(cache, args.steps)
    if cache.layout.compressed and len(cache.index.parts) > 1:  # the kept keys rebuild the raw planes alone
        raise ValueError(f"--rows {args.rows}: the soak checks the raw plane store only, and {args.method}'s index "
                         f"has {[p.name for p in cache.index.parts]}")
    held = cache.nbytes()
    per_token = cache.n_layers * cache.groups * cache.capacity
    run = generation.decode_step_program(model, cache, attn)
    checks, t0 = [], time.time()
    first = None
    for step in range(1, args.steps + 1):
        tokens, _, cache = generation.decode_step(model, tokens, cache, attn)
        log.after_step(cache)
        if step % args.check_every and step != args.steps:
            continue
        jax.block_until_ready(cache.length)
        host = jax.device_get(cache)
        ok, where = log.check(cache, attn, host)
        if ok and not cache.layout.compressed:  # the model's keys are the K rows as well: the rebuild from them
            ok, where = index_matches(cache, attn, host)
            where = where and f"rebuild from the K rows: {where}"
        del host
        mem = {"device_bytes": device_bytes(), "rss_bytes": rss_bytes()}
        first = first or mem
        checks.append({"step": step, "length": int(np.asarray(cache.length)[0]), "index_equals_rebuild": ok,
                       "mismatch": where, "programs": run.jit._cache_size(), **mem,
                       "device_vs_first": None if first["device_bytes"] is None else
                       mem["device_bytes"] / max(1, first["device_bytes"]),
                       "rss_vs_first": mem["rss_bytes"] / max(1, first["rss_bytes"]), "elapsed_s": time.time() - t0})
        print(checks[-1], flush=True)
    return {"method": args.method, "k": args.k, "prompt_tokens": int(prompt.shape[1]), "steps": args.steps,
            "rows": cache.layout.spec, "row_bytes_per_token": cache.layout.row_bytes,
            # bytes per token, layer and KV head of the cache's bulk arrays (K/V rows, planes, scales), over its capacity
            "host_bytes_per_token": sum(held.values()) / per_token,
            "cache_bytes": {name: int(v) for name, v in held.items()}, "capacity": cache.capacity,
            "kept_keys_from": log.start,
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
             f"K/V rows: `{r.get('rows', 'model')}` ({r.get('row_bytes_per_token', float('nan')):.0f} B per token); "
             f"{r.get('host_bytes_per_token', float('nan')):.0f} host bytes per token, layer and KV head with the index "
             f"(capacity {r.get('capacity', '')} tokens). Index check: the blocks the prompt filled as the prefill built "
             f"them, every block from token {r.get('kept_keys_from', '')} on equal to `build_index` of the model's keys "
             "(kept from the index's raw tail as each block filled), and the K rows holding those keys"
             + ("; and equal to a rebuild from the K rows." if r.get("rows", "model") == "model" else
                " (the format's encoding of them)."), "",
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
    ap.add_argument("--rows", default="model",
                    help="K/V row format: model (the model dtype) or a compressed format with per-token scales (k8v8)")
    ap.add_argument("--tag", default=None, help="default smollm2_<backend>, and _<format> with compressed rows")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.check_every < 1 or args.prompt_tokens < 65:
        ap.error("--steps and --check-every must be >= 1, --prompt-tokens >= 65 (more than one 64-token block)")
    try:
        fmt = row_format(args.rows)
    except ValueError as e:
        ap.error(f"--rows: {e}")
    if args.tag is None:
        args.tag = f"smollm2_{jax.default_backend()}" + ("" if fmt is None else f"_{fmt.spec}")
    model, tokenizer, _ = load_smollm2()
    t = time.time()
    res = {"machine": harness.machine(), "command": harness.command("scripts.soak", argv),
           "soak": soak(model, tokenizer, args)}
    res["wall_seconds"] = time.time() - t
    return harness.write_soak(res, os.path.join(args.out, f"soak_{args.tag}"), write_report)


if __name__ == "__main__":
    sys.exit(main())
