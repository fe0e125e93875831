"""The offload benchmark's measurements (``scripts/bench_offload.py``): :class:`Run`, the results JSON rewritten
(with its report) after every row, each section guarded so one failure does not end the run; the bytes a step reads
and what a row records of its cache (host bytes per token, row-cache hits); and the sections' timed rows: the link
and HBM copy rates, attention-only steps, full decode steps and the prefill."""

from __future__ import annotations

import gc
import itertools
import os
import resource
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import decode, importance, kernel_launches, to_host, warm_choice
from fathom_jax.decode import RowLayout, StepConfig, attach_bulk, build_index, split_bulk
from fathom_jax.decode.prefill import corpus_calibration
from fathom_jax.models import generation
from scripts import harness
from scripts.offload_report import write_report
from scripts.offload_inputs import INPUTS, InputSet
from scripts.offload_runs import OffloadRun, Rows
from scripts.offload_setup import (AUTHORS_MS, METHODS, build_cache, cache_shape, drifting_queries,
                                   hook, random_step_inputs, rows_tag, split_fields, synthetic_calibration,
                                   variant_tag, with_row_cache, without_row_cache)


class Run:
    """Results accumulate in one JSON written after every measurement (a run stopped at its time limit keeps
    what it measured); each section is guarded so one failure does not end the run."""

    def __init__(self, args: OffloadRun, out: str, placement):
        self.args, self.out, self.placement = args, out, placement  # the run's record, its folder, where caches live
        self.cfg = args.model
        self.calib, self.scale = synthetic_calibration(args.model)  # every row's synthetic statistics and keys
        self._statistics = {INPUTS["today"].keys: (self.calib, self.scale)}  # and other --inputs' (drawn once)
        self.model = None  # the random-weight model, made by the first section that needs it
        self.t0 = time.time()
        self.name = harness.machine_name() + (f"_{args.tag}" if args.tag else "")  # offload_h200_attn on an H200
        self.path = os.path.join(out, f"offload_{self.name}.json")
        self.res = {"machine": harness.machine(), "command": harness.command("scripts.bench_offload"),
                    "config": args.record() | {"out": out}, "rows": [], "errors": [], "notes": []}

    def statistics(self, inputs: InputSet | None):
        """``(calibration, scale)`` of an input set's keys (None: today's)."""
        keys = (inputs or INPUTS["today"]).keys
        if keys not in self._statistics:
            self._statistics[keys] = synthetic_calibration(self.cfg, keys=keys)
        return self._statistics[keys]

    def left(self) -> float:
        return self.args.time_budget - (time.time() - self.t0)

    def save(self):
        if jax.process_index() != 0:  # across processes every one measures the same rows; process 0 writes them
            return
        self.res["wall_seconds"] = time.time() - self.t0
        harness.write_json(self.path, self.res)
        write_report(self.res, self.path[:-5])

    def add(self, row: dict):
        row["t"] = round(time.time() - self.t0, 1)
        self.res["rows"].append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                       if not isinstance(v, dict)), flush=True)
        self.save()

    def guard(self, name, fn, *a, **kw):
        if self.left() < 20:
            self.res["errors"].append({"section": name, "error": "skipped: time budget spent"})
            print(f"[{name}] skipped: time budget spent", flush=True)
            return None
        try:
            return fn(*a, **kw)
        except Exception as e:  # noqa: BLE001 - a benchmark run records the failure and goes on
            self.res["errors"].append({"section": name, "error": f"{type(e).__name__}: {e}"[:2000],
                                       "traceback": traceback.format_exc()[-4000:]})
            print(f"[{name}] FAILED: {type(e).__name__}: {str(e)[:500]}", flush=True)
            self.save()
            return None
        finally:  # the section's cache goes before the next is allocated (caches of every layer's own rows at 1M
            gc.collect()  # take most of the host: two at once do not fit)


def step_bytes(attn, cfg, calib, q, *, context, k):
    """Bytes a step reads: the planned planes + scales of every layer and the selected rows, and of those what crosses
    the link (with resident planes: only the planes below each layer's resident count stay in HBM, with the scales).
    A selected row is what the hook's row layout stores per token (K and V: ``2 Dh`` bf16 values, or a compressed
    format's words with their scales). With a selection shared across layers only its selection layers read planes;
    the others fetch the shared set's rows."""
    method = attn.method
    selects = attn.share.selects if attn.share is not None else (True,) * cfg.n_layers
    row_bytes = RowLayout.of(attn.rows, cfg.head_dim, jnp.bfloat16).row_bytes
    resident, warm = attn.placement.resident(cfg.n_layers), attn.placement.warm_planes
    bits, link_bits, plane0, code = [], [], 0.0, 0.0
    for layer in range(cfg.n_layers):
        c = corpus_calibration(attn, layer, q.shape[1])
        read = method.read(q[layer], None, c) if method.name != "fathom_klt" else None
        if not selects[layer]:  # a sharing layer scans nothing
            bits.append(np.zeros_like(np.asarray(read.bits)))
            link_bits.append(np.zeros_like(np.asarray(read.bits), np.float64))
            continue
        bits.append(np.asarray(read.bits))
        depths = getattr(read, "depths", None)  # None for a method that reads no planes (dense)
        depths = np.zeros((1, 1)) if depths is None else np.asarray(depths)
        plane0, code = plane0 + float((depths > 0).sum()), code + float(depths.sum())
        if resident[layer] or warm:  # planes below the resident count (and the warm ones) and every scale in HBM
            first = resident[layer]
            if warm:  # as the fill chose them: the step's queries are the prompt's (build_cache)
                gains = importance(q[layer], c.variance)
                first = first + np.sum(np.asarray(warm_choice(gains, resident[layer], warm)) > 0, axis=-1)
            link_bits.append(np.maximum(depths - first, 0).sum(-1).astype(np.float64))
        else:
            link_bits.append(np.asarray(read.bits, np.float64))
    bits = np.stack(bits)  # [L, R]
    r, g = q.shape[1:3]
    if method.name == "dense":  # reads every K and V row, selects nothing
        kv = float(cfg.n_layers * r * context * row_bytes)
        return {"bits_per_token": float(bits.mean()) * 2, "scan_bytes": kv, "link_scan_bytes": kv, "row_bytes_max": 0.0}
    scan = float(bits.sum() * context / 8)
    link = float(np.sum([b.sum() for b in link_bits]) * context / 8)
    shared = 0 if attn.share is None else attn.share.selection.budget
    per_layer = [min(g * k, context) if sel else shared for sel in selects]  # a union's upper bound, or the set
    rows = float(sum(per_layer) * r * row_bytes)
    return {"bits_per_token": float(bits.mean()), "scan_bytes": scan, "link_scan_bytes": link, "row_bytes_max": rows,
            "plane0_share": plane0 / code if code else None}  # of the planned code bits (a plane method's)


def link_section(run: Run):
    mesh = run.placement.mesh  # this process's devices of the mesh (each host measures its own links)
    devices = jax.local_devices()[:1] if mesh is None else [d for d in mesh.devices.flat
                                                            if d.process_index == jax.process_index()]
    run.res["link"] = harness.host_to_device_rate(run.args.link_bytes, devices=devices)
    run.res["hbm_copy"] = harness.hbm_copy_rate()
    print("link", run.res["link"], "hbm", run.res["hbm_copy"]["GBps"], flush=True)
    run.save()


def row_cache_fields(cache, link_gbps: float, scan_bytes: float) -> dict:
    """A step's row-cache counts from the cache it left (its last step): the fraction of rows taken from the slots,
    the row bytes fetched and the link floor with only those rows."""
    rc = cache.row_cache
    if rc is None:
        return {}
    hits, fetched = int(to_host(rc.hits).sum()), int(to_host(rc.fetched).sum())
    row_bytes = fetched * cache.layout.row_bytes  # each row: its K and V
    return {"row_hit_fraction": hits / max(1, hits + fetched), "row_bytes_fetched": float(row_bytes),
            "link_floor_fetched_ms": (scan_bytes + row_bytes) / (link_gbps * 1e9) * 1e3}


def launch_fields(attn, q, key, value, cache, hlo_path=None) -> dict:
    """The kernels the attention-only step's compiled program launches a layer (on a GPU; none elsewhere): ``launches``
    in the layer loop's body outside any branch, ``launches_first`` / ``launches_second`` those of the body's
    branches' first and last branch (a shared selection's: the layer that follows, the layer that selects),
    ``launches_captured`` those of the body inside XLA's command buffers and ``triton_uncaptured`` its Pallas
    kernels outside them, from ``fathom_jax.hlo.kernel_launches``."""
    if jax.default_backend() != "gpu":
        return {}
    program = decode.programs.attention_program(attn, cache)
    text = program.lower(q, key, value, cache=cache).compile().as_text()
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(text)
    found = kernel_launches(text)
    if not found["loops"]:
        return {}
    layer = max(found["loops"], key=lambda loop: loop["kernels"])  # the layer scan's body
    out = {"launches": layer["kernels"] + len(layer["branches"]), "launches_entry": found["entry"],
           "launches_captured": layer["captured"], "triton_uncaptured": layer["triton_outside"]}
    if layer["branches"]:
        out["launches_first"] = sum(b[0] for b in layer["branches"])
        out["launches_second"] = sum(b[-1] for b in layer["branches"])
    return out


def host_fields(cache, placement) -> dict:
    """A cache's bytes per token, layer and KV head (over ``layers x batch x KV heads x capacity``) from its own arrays:
    ``host_bytes_per_token`` as held in host memory (with ``shared_kv`` the one row buffer counted once, so less than
    a cache of every layer's own rows would take), ``host_bytes_per_token_own`` with every layer's own rows (the
    layout's ``row_bytes`` plus the index's host bytes per token), ``index_bytes_per_token`` (planes and scales
    wherever they live), and ``row_bytes_per_token`` (what the row fetch moves per selected token). In device memory
    (the HBM control) nothing is on the host: the host figures are None."""
    held = cache.nbytes()
    tokens = cache.n_layers * cache.groups * cache.capacity
    index_host = index_host_bytes(held)
    index_all = sum(v for name, v in held.items() if name != "kv")
    out = {"row_bytes_per_token": cache.layout.row_bytes, "index_bytes_per_token": index_all / tokens,
           "host_bytes_per_token": None, "host_bytes_per_token_own": None}
    if placement.offloaded:
        out["host_bytes_per_token"] = (held["kv"] + index_host) / tokens
        out["host_bytes_per_token_own"] = cache.layout.row_bytes + index_host / tokens
    return out


def index_host_bytes(held: dict) -> int:
    """The index's bytes in host memory of a cache's ``nbytes()``: every array but the K/V rows and those in HBM."""
    return sum(v for name, v in held.items() if name != "kv" and not name.endswith("_hbm"))


def link_rate(run) -> float:
    """The link's GB/s measured in the run: every device at once, else the mean of each one's (NaN: not measured)."""
    link = run.res.get("link", {})
    rates = [v["GBps"] for v in link.values()]
    return link["all"]["GBps"] if "all" in link else float(np.mean(rates)) if rates else float("nan")


def _first_cache(run: Run, context, labels, batch, placement, rows, inputs=None):
    """``(placement, rows, shared, cache)``: the defaults filled in and the synthetic cache of the first method (the
    others' rows read it too), its K/V row buffer shared by every layer where ``rows`` says so; keys of ``inputs``."""
    args = run.args
    placement = placement or run.placement
    rows = rows or Rows(None, args.share_kv_from)
    shared = rows.share_kv_from is not None and batch * context >= rows.share_kv_from
    calib, scale = run.statistics(inputs)
    first = hook(METHODS[labels[0]], calib, args.k, placement, args.implementation,
                 shape=cache_shape(run.cfg, batch, context), rows=rows.format)
    queries = random_step_inputs(run.cfg, batch)[0] if placement.warm_planes else None  # warm planes: the step's
    return placement, rows, shared, build_cache(first, run.cfg, scale, context=context, batch=batch,
                                                shared_kv=shared, queries=queries)


def attention_rows(run: Run, context, labels, *, batch=1, placement=None, tag="", rows=None, inputs=None):
    """Attention-only steps of several methods over one synthetic cache (all plane methods share it); ``rows``: a
    ``--rows`` entry (the K/V row format and its ``--share-kv-from``; default the model dtype); ``inputs``: an
    ``--inputs`` set (its keys and query drift; default today's keys and ``--query-drift``)."""
    args = run.args
    t = time.time()
    cfg, (calib, _) = run.cfg, run.statistics(inputs)
    drift = inputs.drift if inputs is not None and inputs.drift is not None else args.query_drift
    placement, rows, shared, cache = _first_cache(run, context, labels, batch, placement, rows, inputs)
    fill_s = time.time() - t
    q, key, value = random_step_inputs(cfg, batch)
    # Every row starts from the same `context` tokens: the small leaves (lengths, raw tails) are put back before
    # each row (a cache sized for 64 more tokens filled up after three rows, and later rows' writes fell outside
    # it: before 2026-11-30 (run o5) rows after the first ~64 steps read a full cache).
    bulk = cache.bulk()
    start = jax.tree.map(jnp.copy, split_bulk(cache, bulk)[0])
    queries = drifting_queries(q, drift) if drift is not None else [q]
    # the HBM control runs each scan configuration and attention with the step's other defaults (its options are the
    # offload's)
    variants = args.configs if placement.offloaded else list(dict.fromkeys(
        StepConfig(scan=c.scan, attention=c.attention) for c in args.configs))
    for label, variant in ((m, v) for m in labels for v in variants):
        if run.left() < 30:
            run.res["errors"].append({"section": f"attn {label} {context}", "error": "skipped: time budget spent"})
            break
        attn = hook(METHODS[label], calib, args.k, placement, args.implementation, variant,
                    shape=cache_shape(cfg, batch, context), rows=rows.format)
        split = split_fields(attn)
        cache = with_row_cache(attach_bulk(jax.tree.map(jnp.copy, start), without_row_cache(cache), bulk), attn)
        steps = itertools.count()

        def call(state, attn=attn, steps=steps):  # (outputs, cache)
            return decode.attention_step(queries[next(steps) % len(queries)], key, value, state[1], attn)

        try:
            r, state = harness.timeit_calls(call, (None, cache), n=args.steps, repeats=args.repeats)
        except Exception as e:  # noqa: BLE001
            run.res["errors"].append({"section": f"attn {label} {context}{rows_tag(rows)}",
                                      "error": f"{type(e).__name__}: {e}"[:2000],
                                      "traceback": traceback.format_exc()[-4000:]})
            print(f"[attn {label} {context}] FAILED {e}"[:600], flush=True)
            return None
        cache = state[1]
        hlo_path = os.path.join(run.out, f"{run.name}_{placement.memory}_{variant_tag(split)}.hlo.txt") if (
            args.dump_hlo) else None
        launches = launch_fields(attn, queries[0], key, value, cache, hlo_path)
        profile = None
        if "attnprofile" in args.sections:
            trace = os.path.join(run.out, "traces", f"attn_{context}_{label.split()[0]}_{batch}_{placement.memory}_{variant_tag(split)}")
            try:
                profile, state = harness.profile_breakdown(call, state, trace)
                cache = state[1]
            except Exception as e:  # noqa: BLE001
                run.res["errors"].append({"section": "attnprofile", "error": f"{type(e).__name__}: {e}"[:2000]})
        nbytes = step_bytes(attn, cfg, calib, q, context=context, k=args.k)
        floor_ms = ((nbytes["link_scan_bytes"] + nbytes["row_bytes_max"]) / (link_rate(run) * 1e9) * 1e3
                    if placement.offloaded else float("nan"))  # the HBM control: no link traffic
        held = cache.nbytes()
        tiers = {"resident_planes": placement.resident_planes, "warm_planes": placement.warm_planes,
                 "index_host_bytes": float(index_host_bytes(held)),
                 "index_hbm_bytes": float(held.get("planes_hbm", 0))}
        cached = row_cache_fields(cache, link_rate(run), nbytes["scan_bytes"])
        run.add({"kind": "attention", "method": label, "context": context, "batch": batch, "memory": placement.memory,
                 "mesh": placement.num_shards, **split, **tiers, "shared_kv": shared, "query_drift": drift,
                 "inputs": (inputs or INPUTS["today"]).name,
                 **cached, **host_fields(cache, placement), **launches,
                 "fill_s": fill_s,
                 "host_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, **r, **nbytes,
                 "link_floor_ms": floor_ms, "fraction_of_link": floor_ms / r["median_ms"],
                 "tokens_per_s": batch / (r["median_ms"] * 1e-3),
                 "authors_ms": AUTHORS_MS.get(context, {}).get(label) if batch == 1 and placement.num_shards == 1 else None,
                 "tag": tag, **({"profile": profile} if profile else {})})
    return cache


def full_rows(run: Run, context, labels, *, batch=1, profile=False, placement=None, rows=None):
    """Full decode steps of several methods over one synthetic cache; ``rows`` as :func:`attention_rows`."""
    args = run.args
    model, cfg, calib = run.model, run.cfg, run.calib
    placement, rows, shared, cache = _first_cache(run, context, labels, batch, placement, rows)
    bulk = cache.bulk()
    start = jax.tree.map(jnp.copy, split_bulk(cache, bulk)[0])  # every row from `context` tokens (see attention_rows)
    tokens = jnp.zeros((batch,), jnp.int32)
    for label, variant in ((m, v) for m in labels for v in args.configs):
        attn = hook(METHODS[label], calib, args.k, placement, args.implementation, variant,
                    shape=cache_shape(cfg, batch, context), rows=rows.format)
        split = split_fields(attn)
        cache = with_row_cache(attach_bulk(jax.tree.map(jnp.copy, start), without_row_cache(cache), bulk), attn)

        def call(state, attn=attn):
            toks, _, c = generation.decode_step(model, state[0], state[1], attn)
            return toks, c

        r, state = harness.timeit_calls(call, (tokens, cache), n=args.steps, repeats=args.repeats)
        cache = state[1]
        q, _, _ = random_step_inputs(cfg, batch)
        nbytes = step_bytes(attn, cfg, calib, q, context=context, k=args.k)
        options = generation.decode_compiler_options(attn.compiler_options) or {}
        in_place = (options.get("xla_gpu_enable_triton_gemm") is False
                    and options.get("xla_gpu_enable_dynamic_slice_fusion") is True)
        row = {"kind": "full", "method": label, "context": context, "batch": batch, "memory": placement.memory,
               "mesh": placement.num_shards, **split, "resident_planes": placement.resident_planes, "shared_kv": shared,
               **r,
               # cuBLAS GEMMs reading each layer's weights in place, or Triton GEMMs on copies of them (before 12-01)
               "weight_gemms": "in place" if in_place else "copied",
               **nbytes, **row_cache_fields(cache, link_rate(run), nbytes["scan_bytes"]),
               **host_fields(cache, placement), "tokens_per_s": batch / (r["median_ms"] * 1e-3)}
        if profile:
            trace = os.path.join(run.out, "traces", f"full_{context}_{label.split()[0]}_{batch}_{variant_tag(split)}")
            try:
                bd, state = harness.profile_breakdown(call, state, trace)
                cache = state[1]
                row["profile"] = bd
                row["wall_over_device"] = bd["wall_ms_per_step"] / bd["device_span_ms_per_step"]
            except Exception as e:  # noqa: BLE001
                run.res["errors"].append({"section": "profile", "error": f"{type(e).__name__}: {e}"[:2000]})
        run.add(row)
    return cache


def prefill_section(run: Run, context):
    args = run.args
    model, cfg = run.model, run.cfg
    attn = hook("fathom:48", run.calib, args.k, run.placement, args.implementation, StepConfig(read=args.read))
    prompt = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab, (1, context)), jnp.int32)
    lengths = jnp.full((1,), context, jnp.int32)
    times = []
    for _ in range(2):  # the first includes compilation
        t = time.time()
        logits, cache, _ = generation.prefill(model, prompt, lengths, attn, context + 64)
        jax.block_until_ready((logits, cache))
        times.append(time.time() - t)
        del cache
    # the index build alone (one layer's keys, the same shapes), x layers
    keys = jax.random.normal(jax.random.key(1), (cfg.n_kv_heads, context, cfg.head_dim), jnp.float32)
    build = jax.jit(lambda k: build_index(k, None, attn.method.parts, capacity=context + 64))
    jax.block_until_ready(build(keys))
    t = time.time()
    for _ in range(3):
        jax.block_until_ready(build(keys))
    index_s = (time.time() - t) / 3 * cfg.n_layers
    run.add({"kind": "prefill", "context": context, "first_s": times[0], "prefill_s": times[1],
             "index_build_s": index_s, "index_share": index_s / times[1], "memory": run.placement.memory})
