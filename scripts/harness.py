"""The shared timing harness of the benchmarks and studies (the modules of ``scripts``).

* :func:`timeit`: ms per iteration of a step run ``iters`` times inside one jitted ``fori_loop`` (a single
  jitted call costs ~0.1 ms to dispatch, more than a kernel at 32k); median and spread over repeats.
* :func:`timeit_calls`: ms per call of an already-jitted function called back to back (a decode step that
  donates its cache), wall clock around ``n`` asynchronous calls.
* :func:`machine`, :func:`command`: device, host, JAX version, date, and the command line - recorded in every
  results file.
* :func:`host_to_device_rate` (over :func:`put_rate`), :func:`hbm_copy_rate`: the link and HBM ceilings, measured in
  the same run.
* :func:`profile_breakdown`: device time per kernel category from a JAX profiler (perfetto) trace.
* :func:`expand_preset`: ``--preset NAME`` on a benchmark's command line, the argument list behind a committed table.
"""

from __future__ import annotations

import datetime as dt
import glob
import gzip
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np


def stats(times_ms) -> dict:
    times_ms = np.asarray(times_ms, np.float64)
    return {"median_ms": float(np.median(times_ms)), "min_ms": float(np.min(times_ms)),
            "max_ms": float(np.max(times_ms)), "n": int(times_ms.size)}


def time_ms(call, repeats: int, per: int = 1, warmup: bool = True) -> dict:
    """:func:`stats` of ``repeats`` timed runs of ``call()`` (blocked on), ms per ``per`` (calls it makes); one
    untimed run first with ``warmup``."""
    if warmup:
        jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(call())
        times.append((time.perf_counter() - t) * 1e3 / per)
    return stats(times)


def timeit(step, x0, *, iters, repeats=5):
    """ms per iteration of ``x -> step(x)`` run ``iters`` times in one jitted fori_loop."""
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, iters, lambda i, c: step(c), x))
    return time_ms(lambda: loop(x0), repeats, iters)


def timeit_args(step, x0, args, *, reps=20, repeats=5):
    """Like :func:`timeit` for steps that read pinned_host arrays: they must be jit *arguments* (a closed-over
    array becomes a device constant) and are not carried through a while loop, so ``reps`` chained calls are
    unrolled in one jitted function."""

    @jax.jit
    def run(x, *a):
        for _ in range(reps):
            x = step(x, *a)
        return x

    return time_ms(lambda: run(x0, *args), repeats, reps)


def timeit_calls(call, state, *, n=5, repeats=3, warmup=2):
    """ms per call of ``state -> call(state)`` (returns the next state), ``n`` async calls per repeat."""
    for _ in range(warmup):
        state = call(state)
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            state = call(state)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t) * 1e3 / n)
    return stats(times), state


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def machine() -> dict:
    devices = jax.devices()
    return {
        "device": devices[0].device_kind, "devices": len(devices), "backend": jax.default_backend(),
        "host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
        "cpus": os.cpu_count(), "jax": jax.__version__, "commit": git_commit(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def machine_name(devices=None) -> str:
    """The machine a run used, as its result files name it: the accelerator's model from the first device's
    ``device_kind`` (``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100``; ``cpu`` on the CPU), and
    ``xN`` where the process sees N > 1 devices (``h200x2``)."""
    devices = jax.devices() if devices is None else devices
    kind = devices[0].device_kind
    found = re.search(r"\b([A-Za-z]{1,2}\d{2,4}[A-Za-z]?)\b", kind) if devices[0].platform != "cpu" else None
    name = found.group(1).lower() if found else re.sub(r"[^a-z0-9]+", "", kind.lower()) or devices[0].platform
    return name + (f"x{len(devices)}" if len(devices) > 1 else "")


def command(module: str, argv: list[str] | None = None) -> str:
    """The command line that reruns this run from the repository root: ``python3 -m MODULE ARGS`` (``argv``: the
    arguments, by default this process's), shell-quoted as typed."""
    return shlex.join(["python3", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def hbm_copy_rate(nbytes=1 << 30) -> dict:
    x = jnp.ones((nbytes // 4,), jnp.float32)
    r = timeit(lambda c: c * 1.0000001, x, iters=20)
    r["GBps"] = 2 * nbytes / (r["median_ms"] * 1e-3) / 1e9  # read + write
    return r


def put_rate(src, dst, repeats=5) -> dict:
    """``device_put`` of the array ``src`` to the sharding ``dst`` (one warm-up, then ``repeats`` timed): ms and GB/s."""
    r = time_ms(lambda: jax.device_put(src, dst), repeats)
    return r | {"GBps": src.nbytes / (r["median_ms"] * 1e-3) / 1e9}


def host_to_device_rate(nbytes=2 << 30, devices=None, repeats=5) -> dict:
    """``device_put`` of ``nbytes`` from pinned_host to each device, one at a time and all at once (GB/s)."""
    def sharding(d, kind):
        return jax.sharding.SingleDeviceSharding(d, memory_kind=kind)

    srcs = [(d, jax.device_put(np.ones(nbytes // 4, np.float32), sharding(d, "pinned_host")))
            for d in devices or jax.devices()]
    out = {f"device{d.id}": put_rate(src, sharding(d, "device"), repeats) for d, src in srcs}
    if len(srcs) > 1:
        r = time_ms(lambda: [jax.device_put(s, sharding(d, "device")) for d, s in srcs], repeats, warmup=False)
        out["all"] = {**r, "GBps": len(srcs) * nbytes / (r["median_ms"] * 1e-3) / 1e9}
    return out


# ----------------------------------------------------------------------------------------------
# Profiler breakdown

CATEGORIES = (  # (category, substrings of kernel / op names), first match wins
    ("plane scan kernel", ("fathom_plane_scan",)),
    ("scan transfer (run gather)", ("run_gather", "tier_gather")),
    ("nibble scan", ("nibble_scan",)),
    ("planner (water line)", ("water_line",)),
    ("top-k", ("topk", "kth_largest")),
    ("row fetch", ("row_fetch",)),
    ("cache write", ("cache_write", "tier_write")),
    ("GEMMs", ("gemm", "cublas", "cutlass", "xmma", "nvjet", "matmul", "dot", "sm90_", "wgmma")),
    ("copies", ("memcpy", "copy", "memset")),
)


def categorize(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def trace_events(trace_dir: str) -> list[dict]:
    """Events of the newest perfetto trace under ``trace_dir`` (``jax.profiler`` with
    ``create_perfetto_trace=True``)."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True), key=os.path.getmtime)
    files = files or sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                            key=os.path.getmtime)
    return read_trace(files[-1]) if files else []


def read_trace(path: str) -> list[dict]:
    """The events of one saved trace (perfetto JSON, gzipped or not)."""
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_events(events: list[dict]) -> list[dict]:
    """Complete events of GPU streams (their process is named after the device), or all if none are marked."""
    names = {e.get("pid"): str(e.get("args", {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {pid for pid, n in names.items() if "GPU" in n.upper()}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    return [e for e in complete if e.get("pid") in gpu_pids] if gpu_pids else complete


TRANSFER = "scan transfer (run gather)"


def exposed_time(events: list[dict], transfer: str = TRANSFER, key=categorize) -> dict:
    """Where the device timeline is *not* moving planes: the span cut at every kernel's start and end; each piece
    with no ``transfer`` kernel running is split evenly among the ``key``s (categories; kernel names with
    ``key=str``) running in it ("idle" if none). With overlapped transfers this is what keeps a step above its link
    time (ms over all ``events``)."""
    edges = []
    for e in events:
        name = e.get("name", "")
        label, is_transfer = key(name), categorize(name) == transfer
        edges.append((e["ts"], 1, label, is_transfer))
        edges.append((e["ts"] + e["dur"], -1, label, is_transfer))
    edges.sort(key=lambda x: (x[0], x[1]))
    running, out = Counter(), Counter()  # kernels running by key; ms by key
    transfer_ms, transfers, last = 0.0, 0, None
    for ts, step, name, is_transfer in edges:
        if last is not None and ts > last:
            dt = (ts - last) / 1e3
            active = [c for c, n in running.items() if n > 0]
            if transfers > 0:
                transfer_ms += dt
            else:
                for c in active or ["idle"]:
                    out[c] += dt / max(len(active), 1)
        running[name] += step
        transfers += step * is_transfer
        last = ts
    return {"transfer_running": transfer_ms, "outside_transfers": dict(sorted(out.items(), key=lambda kv: -kv[1]))}


def transfer_gaps(events: list[dict], transfer: str = TRANSFER) -> list[tuple[float, float]]:
    """The stretches (start, end in the trace's microseconds) between one plane transfer's end and the next one's
    start, the transfers' intervals merged first."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if categorize(e.get("name", "")) == transfer)
    merged: list[list[float]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)]


def gap_timeline(events: list[dict], *, min_us: float = 20.0, transfer: str = TRANSFER) -> dict:
    """The median of the gaps between plane transfers longer than ``min_us`` (in a layer-pipelined step: the layer
    boundaries, where the last chunk's scan, top-k and row fetch, the next layer's plan and its first transfer's
    set-up run with the link idle but for the rows), with every kernel that runs in it, times relative to its start."""
    gaps = sorted((g for g in transfer_gaps(events, transfer) if g[1] - g[0] > min_us), key=lambda g: g[1] - g[0])
    if not gaps:
        return {}
    a, b = gaps[len(gaps) // 2]
    kernels = [{"name": e.get("name", "")[:80], "category": categorize(e.get("name", "")),
                "start_us": round(e["ts"] - a, 1), "end_us": round(e["ts"] + e["dur"] - a, 1)}
               for e in sorted(events, key=lambda e: e["ts"]) if e["ts"] + e["dur"] > a and e["ts"] < b]
    return {"gaps": len(gaps), "median_us": round(b - a, 1), "total_ms": sum(y - x for x, y in gaps) / 1e3,
            "kernels": kernels}


def idle_breakdown(events: list[dict], steps: int, *, top_kernels: int = 25) -> dict:
    """Per step of a trace of ``steps`` steps: the time a plane transfer ran and, with none running, the time by
    category and by kernel name (the ``top_kernels`` costliest), and the median long gap between transfers."""
    exposed = exposed_time(events)
    by_kernel = exposed_time(events, key=str)["outside_transfers"]
    return {"exposed_ms_per_step": {"transfer_running": exposed["transfer_running"] / steps,
                                    "outside_transfers": {k: v / steps for k, v in exposed["outside_transfers"].items()}},
            "exposed_kernels_ms_per_step": {k[:160]: v / steps for k, v in list(by_kernel.items())[:top_kernels]},
            "median_gap": gap_timeline(events)}


def profile_breakdown(call, state, trace_dir: str, *, steps: int = 3, top_kernels: int = 25) -> tuple[dict, object]:
    """Device ms per step per category of ``steps`` calls of ``call`` traced with the JAX profiler, the
    ``top_kernels`` costliest kernels by name, and the kernel launches per step."""
    os.makedirs(trace_dir, exist_ok=True)
    jax.block_until_ready(state)
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    t = time.perf_counter()
    for _ in range(steps):
        state = call(state)
    jax.block_until_ready(state)
    wall = (time.perf_counter() - t) * 1e3 / steps
    jax.profiler.stop_trace()
    events = device_events(trace_events(trace_dir))
    per_cat, per_name, launches = Counter(), Counter(), Counter()  # ms by category, ms and launches by kernel name
    for e in events:
        name = e.get("name", "")
        per_cat[categorize(name)] += e["dur"] / 1e3
        per_name[name] += e["dur"] / 1e3
        launches[name] += 1
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:top_kernels]
    busy = sum(per_cat.values()) / steps
    span = ((max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e3 / steps if events
            else float("nan"))
    return {"wall_ms_per_step": wall, "device_busy_ms_per_step": busy, "device_span_ms_per_step": span,
            # the span split into: a plane transfer running, and (per category, per kernel) time with none running
            **idle_breakdown(events, steps, top_kernels=top_kernels),
            "ms_per_step": {k: v / steps for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n[:160], "category": categorize(n), "ms_per_step": ms / steps,
                             "launches_per_step": launches[n] / steps} for n, ms in top],
            "launches_per_step": len(events) / steps, "events": len(events),
            # kernels per GPU stream (the trace's thread ids): overlap between streams shows as busy > span
            "streams": {str(tid): sum(1 for e in events if e.get("tid") == tid) / steps
                        for tid in sorted({e.get("tid") for e in events}, key=str)}}, state


def write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def write_soak(res: dict, prefix: str, write_report) -> int:
    """A soak's results (``res["soak"]["passed"]`` among them) as ``prefix.json`` and its ``write_report`` markdown;
    says whether it passed; the exit status (0 passed, 1 not)."""
    write_json(prefix + ".json", res)
    write_report(res, prefix)
    print(f"{'passed' if res['soak']['passed'] else 'FAILED'}: {prefix}.md", flush=True)
    return 0 if res["soak"]["passed"] else 1


def presets(lines: dict[str, str]) -> dict[str, list[str]]:
    """Argument lists from shell-quoted lines (``--methods "Fathom 48,SparQ r=16"`` stays one argument)."""
    return {name: shlex.split(line) for name, line in lines.items()}


def expand_preset(argv: list[str], table: dict[str, list[str]]) -> list[str]:
    """``argv`` with ``--preset NAME`` (or ``--preset=NAME``) replaced by ``table[NAME]``, put first so that the
    command line's own arguments (``--out``, ``--tag``, any option) override the preset's; unchanged without one.
    An unknown or missing name, or a second ``--preset``, exits with a message naming the presets."""
    at = [i for i, arg in enumerate(argv) if arg == "--preset" or arg.startswith("--preset=")]
    if not at:
        return list(argv)
    if len(at) > 1:
        raise SystemExit("--preset: give one preset")
    i = at[0]
    name = argv[i].partition("=")[2] if "=" in argv[i] else (argv[i + 1] if i + 1 < len(argv) else "")
    if name not in table:
        raise SystemExit(f"--preset: {name!r} is not a preset; presets: {', '.join(table)}")
    return [*table[name], *argv[:i], *argv[i + (1 if "=" in argv[i] else 2):]]
