"""The row fetch against the host pages it touches: results/rowfetch_pages_<tag>.{json,md}.

At batch 8 the decode step's row fetch moves scattered ~260-byte rows (k8v8 at Dh = 128) spread over gigabytes of
``pinned_host`` memory, and moves them at ~17 GB/s where a repeated row set moves at ~43 (results/rowfetch_h200.md):
the cost looks like the translation of host pages, not the bytes. This measures, in one run, rows/s and GB/s of
``pallas_kernels.row_fetch`` over one ``[groups, n, words]`` pinned_host array of ``--gigabytes`` (each call its own
row set unless ``repeated``) for these index patterns (``--patterns``), every group ``--slots`` rows a call:

* ``scattered``: uniform over the group's rows, in random order; ``sorted``: the same rows sorted (as the step's
  union is); ``repeated``: one sorted set fetched by every call (translations stay warm);
* ``window-2MB`` / ``window-64KB``: rows uniform inside disjoint windows of that many bytes placed at random, a
  quarter of each window's rows drawn (2 MB: one huge page's reach; 64 KB: 16 small pages);
* ``page-1`` .. ``page-8``: that many rows in each 4 KB page touched (rows lying wholly inside it), pages at random;
* ``run-16`` / ``run-128``: disjoint runs of that many consecutive rows at random (aligned) starts;

``sorted`` again under each of ``--programs`` (persistent programs of the fetch, 0: one per 32 rows), ``device_put``
of one call's bytes as one contiguous array and of 2 GiB (the link's ceiling), and the transparent huge page setting
(``/sys/kernel/mm/transparent_hugepage/enabled``): where it can be written, ``scattered`` and ``sorted`` again over a
second array allocated under ``always`` (the setting is put back after; only on a GPU).

    python3 -m scripts.bench_rowfetch --out $OUT                     # the H200 run (defaults: 4 GB, 64 groups x 2048)
    python3 -m scripts.bench_rowfetch --gigabytes 0.002 --groups 2 --slots 64 --reps 2 --out /tmp/x   # CPU, tiny

Every fetched row is checked against the value the array holds there (each word is its own flat position), so a
pattern whose indices went wrong cannot report a rate. On a CPU the array sits in device memory and the kernel runs
interpreted: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import row_fetch as RF
from scripts import harness

PAGE = 4096
THP = "/sys/kernel/mm/transparent_hugepage/enabled"
PATTERNS = ("scattered", "sorted", "repeated", "window-2MB", "window-64KB", "page-1", "page-2", "page-4", "page-8",
            "run-16", "run-128")


def _size(text: str) -> int:
    return int(text[:-2]) << {"KB": 10, "MB": 20}[text[-2:]]


def _distinct(rng, high: int, shape: tuple[int, ...], count: int) -> np.ndarray:
    """``shape + (count,)`` draws from ``range(high)``, distinct along the last axis."""
    flat = [rng.choice(high, count, replace=False) for _ in range(int(np.prod(shape)))]
    return np.asarray(flat, np.int64).reshape(shape + (count,))


def index_sets(pattern: str, sets: int, groups: int, n: int, slots: int, row_bytes: int, seed: int = 0) -> np.ndarray:
    """``[sets, groups, slots]`` int32 distinct row indices of ``pattern`` (see the module doc) into groups of ``n``
    rows of ``row_bytes``; every pattern but ``scattered`` sorted within a group."""
    rng = np.random.default_rng(seed)
    shape = (sets, groups)
    kind, _, arg = pattern.partition("-")
    if kind in ("scattered", "sorted", "repeated"):
        idx = _distinct(rng, n, shape, slots)
        if kind == "repeated":
            idx = np.broadcast_to(idx[:1], idx.shape)
    elif kind == "window":  # disjoint windows of `size` bytes at random, a quarter of each window's rows drawn
        rows = max(4, min(n, _size(arg) // row_bytes))
        per = min(slots, rows // 4)
        starts = _distinct(rng, n // rows, shape, -(-slots // per))[..., None] * rows
        offsets = np.argsort(rng.random(starts.shape[:-1] + (rows,)), axis=-1)[..., :per]
        idx = (starts + offsets).reshape(shape + (-1,))[..., :slots]
    elif kind == "page":  # `k` distinct rows lying wholly inside each of slots / k distinct random 4 KB pages
        k = int(arg)
        inside = PAGE // row_bytes - 1  # every page holds at least this many whole rows
        if not 1 <= k <= inside:
            raise ValueError(f"pattern {pattern}: 1 to {inside} rows of {row_bytes} B per page")
        pages = _distinct(rng, n * row_bytes // PAGE - 1, shape, -(-slots // k))[..., None]
        first = -(-pages * PAGE // row_bytes)  # the first row starting in the page
        offsets = np.argsort(rng.random(pages.shape[:-1] + (inside,)), axis=-1)[..., :k]
        idx = (first + offsets).reshape(shape + (-1,))[..., :slots]
    elif kind == "run":  # disjoint runs of `length` consecutive rows
        length = int(arg)
        starts = _distinct(rng, n // length, shape, -(-slots // length))[..., None] * length
        idx = (starts + np.arange(length)).reshape(shape + (-1,))[..., :slots]
    else:
        raise ValueError(f"unknown pattern {pattern!r}; patterns: {PATTERNS}")
    return (idx if kind == "scattered" else np.sort(idx, axis=-1)).astype(np.int32)


def touched(idx: np.ndarray, n: int, row_bytes: int, unit: int) -> float:
    """Distinct ``unit``-byte pages one call's rows (``idx [groups, slots]``) touch, start and end byte of each."""
    base = (np.arange(idx.shape[0], dtype=np.int64)[:, None] * n + idx) * row_bytes
    return float(np.unique(np.concatenate([base // unit, (base + row_bytes - 1) // unit])).size)


def _kv(groups: int, n: int, words: int, memory: str):
    """``[groups, n, words]`` uint32, each word its flat position (mod 2^32), in ``memory``."""
    def fill():
        g = jax.lax.broadcasted_iota(jnp.uint32, (groups, n, words), 0)
        r = jax.lax.broadcasted_iota(jnp.uint32, (groups, n, words), 1)
        w = jax.lax.broadcasted_iota(jnp.uint32, (groups, n, words), 2)
        return (g * jnp.uint32(n) + r) * jnp.uint32(words) + w

    kv = jax.jit(fill)()
    if memory == "device":
        return kv
    return jax.device_put(kv, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=memory))


def _exact(got, idx: np.ndarray, n: int, words: int) -> bool:
    g = np.arange(idx.shape[0], dtype=np.uint64)[:, None, None]
    want = ((g * n + idx[..., None].astype(np.uint64)) * words + np.arange(words, dtype=np.uint64)) % (1 << 32)
    return bool(np.array_equal(np.asarray(got).astype(np.uint64), want))


def fetch(kv, idx, config: RF.RowFetchConfig):
    """One call: the rows ``idx [groups, slots]`` of ``kv`` by the Pallas kernel (interpreted on a CPU)."""
    return RF.row_fetch(RF.StoredRows(kv), idx, config=config, implementation="triton")[0]


def time_fetch(kv, sets: np.ndarray, config: RF.RowFetchConfig, repeats: int) -> tuple[dict, bool]:
    """ms per fetch over ``len(sets)`` chained calls in one program (each its own index set), and whether the first
    call's rows are the array's."""
    reps = sets.shape[0]
    dev_sets = jnp.asarray(sets)

    @jax.jit
    def run(c, kv, sets):
        out = None
        for i in range(reps):  # chained: each call's index depends on the last call's rows (never in fact)
            out = fetch(kv, sets[i] + (c > 1e30).astype(jnp.int32), config)
            c = c + out[0, 0, 0].astype(jnp.float32) * 1e-30
        return c

    first = fetch(kv, dev_sets[0], config)
    ok = _exact(first, sets[0], kv.shape[1], kv.shape[2])
    c0 = jnp.zeros((), jnp.float32)
    jax.block_until_ready(run(c0, kv, dev_sets))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(run(c0, kv, dev_sets))
        times.append((time.perf_counter() - t) * 1e3 / reps)
    return harness.stats(times), ok


def device_put_rate(nbytes: int, memory: str, repeats: int) -> dict:
    """``device_put`` of one contiguous ``nbytes`` array from ``memory`` to HBM."""
    dev = jax.devices()[0]
    src = jax.device_put(np.ones(max(1, nbytes // 4), np.uint32), jax.sharding.SingleDeviceSharding(dev, memory_kind=memory))
    return harness.put_rate(src, jax.sharding.SingleDeviceSharding(dev, memory_kind="device"), repeats) | {
        "bytes": src.nbytes}


def read_thp(path: str = THP) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def anon_huge_kb() -> int | None:
    """This process's anonymous memory in transparent huge pages (kB; /proc/self/smaps_rollup), None where unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            found = re.search(r"^AnonHugePages:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(found.group(1)) if found else None


def set_thp(mode: str, path: str = THP) -> str | None:
    """Write ``mode`` to the THP setting; None if done, else why not."""
    try:
        with open(path, "w") as f:
            f.write(mode)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results")
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--gigabytes", type=float, default=4.0, help="bytes of the K/V row array (all groups)")
    ap.add_argument("--groups", type=int, default=64, help="groups (batch 8 x 8 KV heads)")
    ap.add_argument("--slots", type=int, default=2048, help="rows per group a call fetches (k = 512 x G = 4)")
    ap.add_argument("--row-words", type=int, default=65, help="uint32 words per row (k8v8 at Dh = 128: 65 = 260 B)")
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--programs", default="0,66,132,264", help="persistent fetch programs timed on `sorted`")
    ap.add_argument("--reps", type=int, default=20, help="chained calls per timing, each its own row set")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--link-bytes", type=int, default=2 << 30)
    ap.add_argument("--no-thp", action="store_true", help="do not try to change the transparent huge page setting")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    patterns = [p for p in args.patterns.split(",") if p]
    programs = [int(p) for p in args.programs.split(",") if p]
    if min(args.groups, args.slots, args.row_words, args.reps, args.repeats) < 1 or args.gigabytes <= 0:
        ap.error("--gigabytes, --groups, --slots, --row-words, --reps and --repeats must be positive")
    row_bytes = 4 * args.row_words
    n = int(args.gigabytes * 1e9) // (args.groups * row_bytes) // 1024 * 1024  # a group's rows fill whole pages
    if n < max(args.slots, 1024):
        ap.error(f"--gigabytes {args.gigabytes} leaves {n} rows per group: fewer than --slots or 1024")
    for p in patterns:
        index_sets(p, 1, 1, n, args.slots, row_bytes)  # an unknown pattern fails here, before anything runs
    memory = "pinned_host" if jax.default_backend() == "gpu" else "device"
    res = {"machine": harness.machine(), "command": harness.command("scripts.bench_rowfetch", argv),
           "config": vars(args) | {"rows_per_group": n, "row_bytes": row_bytes, "memory": memory},
           "thp": {"enabled": read_thp(), "defrag": read_thp(THP.replace("enabled", "defrag"))}, "rows": []}
    prefix = os.path.join(args.out, f"rowfetch_pages_{args.tag}")
    call_bytes = args.groups * args.slots * row_bytes

    def save():
        harness.write_results(prefix, res, report)

    def measure(kv, pattern, fetch_programs=0, array="first"):
        sets = index_sets(pattern, args.reps, args.groups, n, args.slots, row_bytes, seed=len(res["rows"]))
        r, ok = time_fetch(kv, sets, RF.RowFetchConfig(programs=fetch_programs), args.repeats)
        r |= {"pattern": pattern, "programs": fetch_programs, "array": array, "exact": ok, "bytes": call_bytes,
              "GBps": call_bytes / (r["median_ms"] * 1e-3) / 1e9,
              "rows_per_s": args.groups * args.slots / (r["median_ms"] * 1e-3),
              "pages_4k": touched(sets[0], n, row_bytes, PAGE), "pages_2m": touched(sets[0], n, row_bytes, 2 << 20)}
        res["rows"].append(r)
        print(f"{pattern:12s} programs={fetch_programs:4d} {array:6s} {r['median_ms']:.4f} ms {r['GBps']:.1f} GB/s "
              f"{r['rows_per_s']:.3g} rows/s 4K pages {r['pages_4k']:.0f} exact={ok}", flush=True)
        save()

    print("thp", res["thp"], flush=True)
    res["device_put"] = {"one call's bytes": device_put_rate(call_bytes, memory, args.repeats)}
    res["device_put"]["link bytes"] = device_put_rate(args.link_bytes, memory, args.repeats)
    print("device_put", {k: round(v["GBps"], 1) for k, v in res["device_put"].items()}, flush=True)
    kv = _kv(args.groups, n, args.row_words, memory)
    res["thp"]["anon_huge_kb_first"] = anon_huge_kb()
    for pattern in patterns:
        measure(kv, pattern)
    for p in programs:
        if p:
            measure(kv, "sorted", p)
    was = res["thp"]["enabled"]
    current = re.search(r"\[(\w+)\]", was or "")
    if memory == "pinned_host" and not args.no_thp and current and current.group(1) != "always":
        why = set_thp("always")
        res["thp"]["always"] = why or "set; a second array allocated under it (the first kept alive)"
        if why is None:
            try:
                second = _kv(args.groups, n, args.row_words, memory)
                res["thp"]["anon_huge_kb_second"] = anon_huge_kb()
                for pattern in ("scattered", "sorted"):
                    measure(second, pattern, array="thp")
                del second
            finally:
                res["thp"]["restored"] = set_thp(current.group(1)) or current.group(1)
        print("thp always:", res["thp"]["always"], flush=True)
    save()
    print(report(res))


def report(res: dict) -> str:
    m, c = res["machine"], res["config"]
    gb = c["groups"] * c["rows_per_group"] * c["row_bytes"] / 1e9
    lines = [f"# Row fetch against the host pages it touches ({m['device']})", "",
             f"{m['date']}, JAX {m['jax']}, commit {m['commit']}, {m['backend']}. Command: `{res['command']}`.", "",
             f"One `[{c['groups']}, {c['rows_per_group']}, {c['row_words']}]` uint32 array in {c['memory']} memory "
             f"({gb:.2f} GB, {c['row_bytes']} B rows); a call fetches {c['slots']} rows of every group "
             f"({c['groups'] * c['slots'] * c['row_bytes'] / 1e6:.1f} MB), each of {c['reps']} chained calls its own "
             "row set (`repeated`: one set); median of repeats [min, max]. `4K pages` / `2M regions`: distinct ones a "
             "call's rows touch. `exact`: the first call's rows are the array's.", "",
             f"Transparent huge pages: enabled `{res['thp'].get('enabled')}`, defrag `{res['thp'].get('defrag')}`"
             + (f"; `always`: {res['thp']['always']}" if "always" in res["thp"] else "")
             + (f"; restored: {res['thp']['restored']}" if "restored" in res["thp"] else "") + ". AnonHugePages of "
             f"the process after the first array: {res['thp'].get('anon_huge_kb_first')} kB"
             + (f", after the second: {res['thp']['anon_huge_kb_second']} kB" if "anon_huge_kb_second" in res["thp"]
                else "") + " (THP backs pages first touched under it; an allocator may reuse a region pinned "
             "before).", "",
             "device_put from the same memory (the link's ceiling): " + ", ".join(
                 f"{k} ({v['bytes'] / 1e6:.1f} MB) {v['GBps']:.1f} GB/s" for k, v in res.get("device_put", {}).items()), "",
             "| pattern | programs | array | ms | GB/s | rows/s | 4K pages | 2M regions | of device_put | exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ceiling = res.get("device_put", {}).get("one call's bytes", {}).get("GBps")
    for r in res["rows"]:
        share = f"{r['GBps'] / ceiling:.2f}" if ceiling else ""
        lines.append(f"| {r['pattern']} | {r['programs']} | {r['array']} | {r['median_ms']:.4f} [{r['min_ms']:.4f}, "
                     f"{r['max_ms']:.4f}] | {r['GBps']:.1f} | {r['rows_per_s']:.3g} | {r['pages_4k']:.0f} | "
                     f"{r['pages_2m']:.0f} | {share} | {r['exact']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
