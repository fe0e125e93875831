"""Kernel benchmarks on the GPU: writes results/kernels_h200.{json,md,png}.

Every timing runs the kernel ``iters`` times inside one jitted ``lax.fori_loop`` (each iteration
depends on the last through a negligible perturbation of an input, so nothing is hoisted or elided)
and divides; ``repeats`` such loops give the median and the spread (min, max). A single jitted call
costs ~0.1 ms to dispatch, more than a scan at 32k, so per-call timing would measure dispatch.

    python3 scripts/bench_kernels.py --out results            # the scans (the default --sections)
    python3 scripts/bench_kernels.py --sections scan --tune    # scan tile / warp sweep
    python3 scripts/bench_kernels.py --preset topk-tune --out $OUT   # the run behind a committed table (PRESETS)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import planner  # noqa: E402
import harness  # noqa: E402
from harness import stats, timeit, timeit_args  # noqa: E402
from pallas_kernels import nibble_scan as NS
from pallas_kernels import plane_scan as PS
from pallas_kernels import row_fetch as RF
from pallas_kernels import run_gather as RG
from pallas_kernels import topk as TK

AUTHORS = {  # DESIGN.md: the authors' Triton kernels on this H200 (ms), batch 4 x 8 KV heads, G=4, D=128
    32768: {"sparq_r16": 0.024, "nibble_32": 0.056, "full_4bit": 0.156, "fathom_48": 0.048, "fathom_64": 0.058},
    131072: {"sparq_r16": 0.091, "nibble_32": 0.158, "full_4bit": 0.549, "fathom_48": 0.171, "fathom_64": 0.210},
}
LOGVAR_STD = 1.25  # log-normal channel variances: ~39 active channels at a budget of 48 (DESIGN.md)


def copy_rate(nbytes=1 << 30):
    x = jnp.ones((nbytes // 4,), jnp.float32)
    r = timeit(lambda c: c * 1.0000001, x, iters=20)
    r["GBps"] = 2 * nbytes / (r["median_ms"] * 1e-3) / 1e9  # read + write
    return r


def scan_inputs(n, *, batch=4, heads=8, groups=4, d=128, seed=0):
    rng = np.random.default_rng(seed)
    w = n // 32
    planes = jnp.asarray(rng.integers(0, 2**32, (batch, heads, d, 4, w), dtype=np.uint32))
    scales = jnp.asarray(rng.uniform(0.5, 2.0, (batch, heads, d, n // 64)).astype(np.float16))
    length = jnp.full((batch, heads), n, jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, heads, groups, d)), jnp.float32)
    var = jnp.asarray(np.exp(LOGVAR_STD * rng.standard_normal((batch, heads, d))), jnp.float32)
    return q, planes, scales, length, var


def scan_cases(n, tune=False):
    q, planes, scales, length, var = scan_inputs(n)
    g = planner.importance(q, var)
    bh = 4 * 8
    out = []
    plan_stats = {}
    for budget in (48, 64):
        plan = planner.plan_bisection(g, budget)
        ch, dep = PS.active_channels(plan.depths)
        active = float(jnp.mean(jnp.sum(plan.depths > 0, -1)))
        plan_stats[budget] = active
        bits = float(jnp.mean(plan.bits_per_token))
        nbytes = bh * n * bits / 8 + bh * 4 * n * 4  # reads (codes + scales) + f32 scores written
        cfgs = [PS.PlaneScanConfig(), PS.PlaneScanConfig(tile=1024, lanes=32), PS.PlaneScanConfig(tile=512, lanes=8,
                                                                                                  num_warps=2)]
        if n >= 131072:
            cfgs.insert(1, PS.PlaneScanConfig(tile=1024, lanes=16, num_warps=2))
        if tune and n >= 131072:
            cfgs += [PS.PlaneScanConfig(tile=2048, lanes=32, num_warps=2), PS.PlaneScanConfig(tile=256, lanes=8)]
        for cfg in cfgs:
            step = lambda c, ch=ch, dep=dep, cfg=cfg: c + 1e-30 * PS.plane_scan(
                q + c, planes, scales, length, ch, dep, config=cfg, assume_sorted=True
            )[..., :1, :1].sum(axis=(-1, -2))[..., None, None]
            r = timeit(step, jnp.zeros((4, 8, 1, 1), jnp.float32), iters=100)
            r.update(kernel=f"fathom_{budget}", n=n, **_scan_config_fields(cfg), active_channels=active,
                     bits_per_token=bits, bytes=nbytes)
            out.append(r)
    nib = NS.pack_nibbles(planes)
    for name, r_ch in (("sparq_r16", 16), ("nibble_32", 32), ("full_4bit", 128)):
        ch = jnp.broadcast_to(jnp.arange(r_ch, dtype=jnp.int32), (4, 8, r_ch))
        bits = r_ch * 4 + r_ch * 16 / 64
        nbytes = bh * n * bits / 8 + bh * 4 * n * 4
        cfgs = [(512, 1)]
        for tile, warps in cfgs:
            step = lambda c, ch=ch, tile=tile, warps=warps: c + 1e-30 * NS.nibble_scan(
                q + c, nib, scales, length, ch, config=NS.NibbleScanConfig(tile=tile, num_warps=warps)
            )[..., :1, :1].sum(axis=(-1, -2))[..., None, None]
            r = timeit(step, jnp.zeros((4, 8, 1, 1), jnp.float32), iters=100)
            r.update(kernel=name, n=n, lanes=0, tile=tile, num_warps=warps, bits_per_token=bits, bytes=nbytes)
            out.append(r)
        if tune and r_ch == 32 and n >= 131072:  # the same scan from the plane store at depth 4
            for tile, warps in ((2048, 2),):
                step = lambda c, ch=ch, tile=tile, warps=warps: c + 1e-30 * NS.nibble_scan_planes(
                    q + c, planes, scales, length, ch, config=NS.NibbleScanConfig(tile=tile, num_warps=warps)
                )[..., :1, :1].sum(axis=(-1, -2))[..., None, None]
                r = timeit(step, jnp.zeros((4, 8, 1, 1), jnp.float32), iters=100)
                r.update(kernel="nibble_32_from_planes", n=n, lanes=0, tile=tile, num_warps=warps, bits_per_token=bits, bytes=nbytes)
                out.append(r)
    for r in out:
        r["GBps"] = r["bytes"] / (r["median_ms"] * 1e-3) / 1e9
        r["authors_ms"] = AUTHORS.get(n, {}).get(r["kernel"])
    return out, plan_stats


def _scan_config_fields(cfg):
    return {"lanes": cfg.lanes, "tile": cfg.tile, "num_warps": cfg.num_warps}


# One chunk of the pipelined decode step (fathom_jax.placement): the scan of the staged planes of a few groups, which
# sits between the layer's last plane transfer and its top-k. (groups, n): Qwen3-8B shapes at batch 1, 8 KV heads in
# 8 chunks at 1M and in 2 at 128k; batch 8 at 128k in 2 chunks.
SCAN_CHUNKS = ((1, 1 << 20), (4, 1 << 17), (32, 1 << 17))
SCAN_CHUNK_CONFIGS = tuple(PS.PlaneScanConfig(tile=t, lanes=l, num_warps=w)
                           for t, l, w in ((512, 16, 1), (256, 8, 1), (1024, 16, 2), (1024, 32, 1)))


def parse_chunks(text):
    """``"1x1048576,4x131072"`` -> ((1, 1048576), (4, 131072)): groups x tokens of each chunk."""
    return tuple(tuple(int(v) for v in item.split("x")) for item in text.split(","))


def scan_chunk_cases(chunks=SCAN_CHUNKS, configs=SCAN_CHUNK_CONFIGS, budget=48):
    """Fathom ``budget``'s scan of one pipelined chunk's staged planes (the run gather's compact [Rc, C, 4, W] layout,
    the active channels first, deepest first), per kernel configuration; every configuration's scores are compared
    with the first's (``same_bits``)."""
    out = []
    for groups, n in chunks:
        q, planes, scales, length, var = scan_inputs(n, batch=1, heads=groups)
        q, planes, scales, length, var = (x[0] for x in (q, planes, scales, length, var))
        plan = planner.plan_bisection(planner.importance(q, var), budget)
        ch, dep = PS.active_channels(plan.depths)
        planes, scales = jnp.take_along_axis(planes, ch[..., None, None], 1), jnp.take_along_axis(scales, ch[..., None], 1)
        qs = jnp.take_along_axis(q, ch[:, None, :], axis=-1)
        slots = jnp.broadcast_to(jnp.arange(ch.shape[-1], dtype=jnp.int32), ch.shape)
        active = float(jnp.mean(jnp.sum(dep > 0, -1)))
        first = None
        for cfg in configs:
            scan = jax.jit(lambda qq, cfg=cfg: PS.plane_scan(qq, planes, scales, length, slots, dep, config=cfg,
                                                            assume_sorted=True))
            got = np.asarray(scan(qs))
            first = got if first is None else first
            step = lambda c, cfg=cfg: c + 1e-30 * PS.plane_scan(
                qs + c, planes, scales, length, slots, dep, config=cfg, assume_sorted=True)[:, :1, :1].sum()
            r = timeit(step, jnp.zeros((), jnp.float32), iters=100)
            r.update(kernel=f"fathom_{budget}_chunk", groups=groups, n=n, **_scan_config_fields(cfg),
                     active_channels=active, same_bits=bool(np.array_equal(got, first)))
            out.append(r)
            print(f"scan chunk groups={groups:2d} n={n:7d} tile={cfg.tile:4d} lanes={cfg.lanes:2d} w={cfg.num_warps} "
                  f"{r['median_ms'] * 1e3:7.1f} us [{r['min_ms'] * 1e3:.1f}, {r['max_ms'] * 1e3:.1f}] "
                  f"same bits {r['same_bits']}", flush=True)
    return out


def _host(x):
    dev = jax.devices()[0]
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))


GATHER_CONFIGS = ((2048, 4), (1024, 4), (4096, 4), (8192, 4), (2048, 8), (4096, 8), (8192, 8), (16384, 8))


def gather_cases(tune=False):
    """Run gather from pinned host memory vs run size (4 planes of one channel = 16 W bytes). With ``tune``: the
    runs of a 128k and a 1M store (64 and 512 KiB per channel) under ``GATHER_CONFIGS`` (chunk, warps)."""
    out = []
    bh, d = 8, 128
    for run_kb in ((64, 512) if tune else (1, 8, 64, 512)):
        w = run_kb * 1024 // 16
        rng = np.random.default_rng(run_kb)
        planes_np = rng.integers(0, 2**32, (bh, d, 4, w), dtype=np.uint32)
        scales_np = rng.uniform(0.5, 2, (bh, d, w // 2)).astype(np.float16)
        ch = jnp.broadcast_to(jnp.arange(d, dtype=jnp.int32), (bh, d))
        dep = jnp.full((bh, d), 4, jnp.int32)
        nbytes = planes_np.nbytes + scales_np.nbytes
        iters = max(3, min(200, int(2e8 // nbytes)))
        sources = [("pinned_host", _host(planes_np), _host(scales_np))]
        if not tune:
            sources.append(("hbm", jnp.asarray(planes_np), jnp.asarray(scales_np)))
        configs = GATHER_CONFIGS if tune else GATHER_CONFIGS[:1]
        for where, planes, scales in sources:
            for chunk, warps in configs:
                config = RG.RunGatherConfig(chunk=chunk, num_warps=warps)

                def step(c, planes, scales, config=config):
                    p, sc = RG.run_gather(planes, scales, ch + (c > 1e30).astype(jnp.int32), dep, config=config)
                    return c + p[0, 0, 0, 0].astype(jnp.float32) * 1e-30
                r = timeit_args(step, jnp.zeros((), jnp.float32), (planes, scales), reps=min(20, iters), repeats=3)
                r.update(kernel="run_gather", source=where, run_bytes=run_kb * 1024, bytes=nbytes, chunk=chunk,
                         num_warps=warps)
                r["GBps"] = nbytes / (r["median_ms"] * 1e-3) / 1e9
                out.append(r)
                print(f"run_gather {where:11s} run={run_kb * 1024:7d}B chunk={chunk:5d} w={warps} "
                      f"{r['median_ms']:.3f} ms {r['GBps']:.1f} GB/s", flush=True)
        host = _host(planes_np)
        dev = jax.devices()[0]
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(jax.device_put(host, jax.sharding.SingleDeviceSharding(dev, memory_kind="device")))
            ts.append((time.perf_counter() - t) * 1e3)
        r = {"kernel": "device_put", "source": "pinned_host", "run_bytes": run_kb * 1024, "bytes": planes_np.nbytes,
             "median_ms": float(np.median(ts)), "min_ms": float(np.min(ts)), "max_ms": float(np.max(ts))}
        r["GBps"] = r["bytes"] / (r["median_ms"] * 1e-3) / 1e9
        out.append(r)
        print(f"device_put  pinned_host run={run_kb * 1024:7d}B {r['median_ms']:.3f} ms {r['GBps']:.1f} GB/s", flush=True)
        del host
    return out


def topk_cases(tune=False):
    """[32, n] rows at k = 512. ``n`` = 2^15, 2^17, 2^20 and, with ``tune``, a decode cache's rows (2^17 + 64 and
    2^20 + 64 slots) under other warp counts and the former bucket limit (32768: 64-token buckets at 2^20 + 64)."""
    out = []
    k = 512
    sizes = (32768, 131072, 1 << 20) + (((1 << 17) + 64, (1 << 20) + 64) if tune else ())
    fused = lambda **kw: TK.TopkConfig(path="fused", **kw)  # noqa: E731
    variants = [("ours_radix", TK.TopkConfig(path="radix", num_warps=4)), ("ours_fused", fused(num_warps=16))]
    if tune:
        variants += [("ours_fused_w8", fused(num_warps=8)), ("ours_fused_w32", fused(num_warps=32)),
                     ("ours_fused_buckets32768", fused(num_warps=16, max_buckets=32768)),
                     ("ours_fused_buckets32768_w32", fused(num_warps=32, max_buckets=32768))]
    for n in sizes:
        rng = np.random.default_rng(n)
        scores = jnp.asarray(rng.standard_normal((32, n)), jnp.float32)
        length = jnp.full((32,), n, jnp.int32)
        b = TK.topk_select_reference(scores, length, k=k)
        iters = 50 if n < (1 << 20) else 20
        fns = [(name, lambda s, c=c: TK.topk_select(s, length, k=k, implementation="pallas", config=c))
               for name, c in variants]
        fns += [("reference_lax_top_k", lambda s: TK.topk_select_reference(s, length, k=k)),
                ("lax.top_k_only", lambda s: jax.lax.top_k(s, k - TK.SINK_TOKENS - TK.LOCAL_TOKENS)[1])]
        for name, fn in fns:
            same = bool(jnp.array_equal(fn(scores), b)) if name.startswith("ours") else True
            step = lambda c, fn=fn: c + fn(scores + c).astype(jnp.float32)[:, :1] * 1e-30
            r = timeit(step, jnp.zeros((32, 1), jnp.float32), iters=iters, repeats=3)
            r.update(kernel=f"topk_{name}", n=n, k=k, rows=32, same_set_as_reference=same)
            out.append(r)
            print(f"topk {name:28s} n={n:8d} {r['median_ms']:.4f} ms same={same}", flush=True)
    return out


TOPK_SPLITS = ((1, 1), (4, 1), (8, 1), (16, 1), (1, 2), (1, 4), (1, 8), (4, 4), (8, 4), (16, 4), (8, 8))


def topk_split_cases(sizes=((1 << 17) + 64, (1 << 20) + 64), rows=(4, 32), splits=TOPK_SPLITS):
    """The fused top-k with each row's bucket and token selections split over several programs (then merged), on a
    decode cache's rows (2^k + 64 slots) at k = 512: 4 rows are one pipelined chunk's (one KV group), 32 a layer's."""
    out = []
    k = 512
    for n in sizes:
        for r in rows:
            rng = np.random.default_rng(n + r)
            scores = jnp.asarray(rng.standard_normal((r, n)), jnp.float32)
            length = jnp.full((r,), n - 63, jnp.int32)  # a decode cache one step in
            want = TK.topk_select_reference(scores, length, k=k)
            for bs, ts in splits:
                cfg = TK.TopkConfig(path="fused", bucket_splits=bs, token_splits=ts)
                fn = lambda s, cfg=cfg: TK.topk_select(s, length, k=k, implementation="pallas", config=cfg)  # noqa: E731
                same = bool(jnp.array_equal(fn(scores), want))
                step = lambda c, fn=fn: c + fn(scores + c).astype(jnp.float32)[:, :1] * 1e-30  # noqa: E731
                t = timeit(step, jnp.zeros((r, 1), jnp.float32), iters=50, repeats=3)
                t.update(kernel="topk_split", n=n, k=k, rows=r, bucket_splits=bs, token_splits=ts,
                         same_set_as_reference=same)
                out.append(t)
                print(f"topk split n={n:8d} rows={r:2d} buckets/{bs:2d} tokens/{ts:2d} {t['median_ms']:.4f} ms "
                      f"[{t['min_ms']:.4f}, {t['max_ms']:.4f}] same={same}", flush=True)
    return out


def rowfetch_cases(sizes=(131072,), configs=((32, 4),)):
    """Row fetch of 2048 rows x 8 KV heads (K and V) at each context size and config, from host and HBM.

    Index patterns: ``random`` (sorted uniform positions: the decode step's union is sorted) and
    ``clustered`` (runs of 16 consecutive rows), to tell a per-row cost from a per-page one."""
    out = []
    bh, dh, s = 8, 128, 2048
    for n in sizes:
        rng = np.random.default_rng(3)
        kk, kv = jax.random.split(jax.random.key(n))  # drawn on the device: 2 GB per array at 1M
        k_hbm = jax.random.normal(kk, (bh, n, dh), jnp.bfloat16)
        v_hbm = jax.random.normal(kv, (bh, n, dh), jnp.bfloat16)
        starts = np.sort(rng.choice(n // 16, (bh, s // 16), replace=False), axis=-1) * 16
        patterns = {
            "random": np.sort(rng.choice(n, (bh, s)), axis=-1),
            "clustered": (starts[..., None] + np.arange(16)).reshape(bh, s),
        }
        nbytes = 2 * bh * s * dh * 2
        sources = (("pinned_host", _host(k_hbm), _host(v_hbm)), ("hbm", k_hbm, v_hbm))
        for where, k_, v_ in sources:
            for pattern, idx_np in patterns.items():
                idx = jnp.asarray(idx_np, jnp.int32)
                ref = RF.row_fetch_reference(k_hbm, v_hbm, idx)[0]
                for rows, warps in (configs if where == "pinned_host" else configs[:1]):
                    cfg = RF.RowFetchConfig(rows=rows, num_warps=warps)
                    ok = bool(jnp.array_equal(RF.row_fetch(k_, v_, idx, config=cfg)[0], ref))

                    def step(c, k_, v_, cfg=cfg, idx=idx):
                        got = RF.row_fetch(k_, v_, idx + (c > 1e30).astype(jnp.int32), config=cfg)[0]
                        return c + got[0, 0, 0].astype(jnp.float32) * 1e-30

                    timed = {"repeated": timeit_args(step, jnp.zeros((), jnp.float32), (k_, v_), reps=20, repeats=3)}
                    if pattern == "random":  # a new row set every call, as in a decode step (no warm translations)
                        timed["fresh"] = _time_fresh_rows(k_, v_, n, bh, s, cfg)
                    for rowset, r in timed.items():
                        r.update(kernel="row_fetch", source=where, n=n, pattern=pattern, rowset=rowset, rows=rows,
                                 num_warps=warps, slots=bh * s, bytes=nbytes, exact=ok)
                        r["GBps"] = nbytes / (r["median_ms"] * 1e-3) / 1e9
                        r["rows_per_s"] = bh * s / (r["median_ms"] * 1e-3)
                        out.append(r)
                        print(f"row_fetch {where:11s} n={n:8d} {pattern:9s} {rowset:8s} rows={rows:3d} w={warps} "
                              f"{r['median_ms']:.4f} ms {r['GBps']:.1f} GB/s exact={ok}", flush=True)
        del sources, k_hbm, v_hbm
    return out


def rowlayout_cases(sizes=(131072, 1048576), reps=20):
    """Fresh rows per call from host memory: K and V as two arrays (two 256-byte runs per token) against one
    interleaved ``[n, 2 Dh]`` array (one 512-byte run): the same bytes, half the host pages touched."""
    out = []
    bh, dh, s = 8, 128, 2048
    for n in sizes:
        kk, kv = jax.random.split(jax.random.key(n))
        k_hbm = jax.random.normal(kk, (bh, n, dh), jnp.bfloat16)
        v_hbm = jax.random.normal(kv, (bh, n, dh), jnp.bfloat16)
        kv_hbm = jnp.concatenate([k_hbm, v_hbm], axis=-1)
        layouts = {"split": (_host(k_hbm), _host(v_hbm)), "interleaved": (_host(kv_hbm), None)}
        del k_hbm, v_hbm
        idx = jnp.asarray(np.sort(np.random.default_rng(5).choice(n, (bh, s)), axis=-1), jnp.int32)
        want = RF.row_fetch_reference(kv_hbm, None, idx)[0]
        for layout, (a, b) in layouts.items():
            got = RF.row_fetch(a, b, idx)
            got = got[0] if b is None else jnp.concatenate([got[0], got[1]], axis=-1)
            ok = bool(jnp.array_equal(got, want))
            r = _time_fresh_rows(a, b, n, bh, s, RF.RowFetchConfig(), reps=reps)
            nbytes = 2 * bh * s * dh * 2
            r.update(kernel="row_fetch_layout", layout=layout, source="pinned_host", n=n, rowset="fresh",
                     slots=bh * s, bytes=nbytes, exact=ok)
            r["GBps"] = nbytes / (r["median_ms"] * 1e-3) / 1e9
            out.append(r)
            print(f"row_fetch layout={layout:11s} n={n:8d} fresh {r['median_ms']:.4f} ms "
                  f"[{r['min_ms']:.4f}, {r['max_ms']:.4f}] {r['GBps']:.1f} GB/s exact={ok}", flush=True)
        del layouts, kv_hbm
    return out


ROWORDER_CASES = ((8, 1 << 20), (64, 131072), (8, 131072))  # (groups, n): 4 GiB, 4 GiB and 0.5 GiB of K/V rows
ROWORDER_PROGRAMS = (0, 66, 132, 264)


def roworder_cases(cases=ROWORDER_CASES, programs=ROWORDER_PROGRAMS):
    """Fresh rows per call (2048 per group, one 512-byte K/V run each) from host memory: one program per 32 rows
    (every group's rows in flight at once) against persistent programs walking the groups one after another."""
    out = []
    dh, s = 128, 2048
    for bh, n in cases:
        kv_hbm = jax.random.normal(jax.random.key(n + bh), (bh, n, 2 * dh), jnp.bfloat16)
        kv = _host(kv_hbm)
        idx = jnp.asarray(np.sort(np.random.default_rng(5).choice(n, (bh, s)), axis=-1), jnp.int32)
        want = RF.row_fetch_reference(kv_hbm, None, idx)[0]
        del kv_hbm
        for p in programs:
            cfg = RF.RowFetchConfig(programs=p)
            ok = bool(jnp.array_equal(RF.row_fetch(kv, None, idx, config=cfg)[0], want))
            r = _time_fresh_rows(kv, None, n, bh, s, cfg)
            nbytes = bh * s * dh * 2 * 2
            r.update(kernel="row_fetch_order", source="pinned_host", groups=bh, n=n, programs=p, rowset="fresh",
                     slots=bh * s, bytes=nbytes, exact=ok, GBps=nbytes / (r["median_ms"] * 1e-3) / 1e9)
            out.append(r)
            print(f"row_fetch groups={bh:3d} n={n:8d} programs={p:4d} fresh {r['median_ms']:.4f} ms "
                  f"[{r['min_ms']:.4f}, {r['max_ms']:.4f}] {r['GBps']:.1f} GB/s exact={ok}", flush=True)
        del kv
    return out


def _time_fresh_rows(k_, v_, n, bh, s, cfg, reps=20, repeats=3):
    """ms per row fetch when each of ``reps`` chained calls fetches its own random sorted row set."""
    rng = np.random.default_rng(11)
    sets = jnp.asarray(np.sort(rng.choice(n, (reps, bh, s)), axis=-1), jnp.int32)

    @jax.jit
    def run(c, k_, v_, sets):
        for i in range(reps):
            got = RF.row_fetch(k_, v_, sets[i] + (c > 1e30).astype(jnp.int32), config=cfg)[0]
            c = c + got[0, 0, 0].astype(jnp.float32) * 1e-30
        return c

    c0 = jnp.zeros((), jnp.float32)
    jax.block_until_ready(run(c0, k_, v_, sets))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(run(c0, k_, v_, sets))
        times.append((time.perf_counter() - t) * 1e3 / reps)
    return stats(times)


def check_scans():
    """Kernel == reference on the GPU at a small odd size (fresh random data)."""
    q, planes, scales, length, var = scan_inputs(1984, batch=2, heads=3, seed=7)
    length = jnp.asarray([[1984, 1000, 65], [7, 1984, 1500]], jnp.int32)
    plan = planner.plan_bisection(planner.importance(q, var), 48)
    ch, dep = PS.active_channels(plan.depths)
    b = PS.plane_scan_reference(q, planes, scales, length, ch, dep)
    rel = lambda x, y: float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))
    e = {f"plane_scan_lanes{lanes}_rel_err": rel(PS.plane_scan(
        q, planes, scales, length, ch, dep, config=PS.PlaneScanConfig(lanes=lanes, tile=32 * lanes, num_warps=2)), b)
        for lanes in (8, 16, 32)}
    nib = NS.pack_nibbles(planes)
    ch16 = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 3, 16))
    c = NS.nibble_scan(q, nib, scales, length, ch16)
    d = NS.nibble_scan_reference(q, nib, scales, length, ch16)
    rel = lambda x, y: float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))
    return {**e, "nibble_scan_rel_err": rel(c, d)}


# `--preset NAME`: the argument list of the run behind a committed table (results/README.md); arguments after it win.
PRESETS = harness.presets({
    "kernels": "--sections scan,topk,gather,rowfetch --name kernels_h200",  # its command was not recorded: its sections
    "topk-tune": "--sections topk --tune --name topk_tune_h200",
    "gather-tune": "--sections gather --tune --name gather_tune_h200",
    "rowfetch": "--sections rowfetch --tune --rowfetch-sizes 131072,1048576 --name rowfetch_h200",
    "rowfetch-fresh": "--sections rowfetch --rowfetch-sizes 131072,1048576 --name rowfetch_fresh_h200",
    "rowlayout": "--sections rowlayout --rowfetch-sizes 131072,1048576 --name rowlayout_h200",
    "topk-split-roworder": "--sections topksplit,roworder --name kernels_u2_h200",
})
SECTIONS = ("scan", "scanchunk", "topk", "topksplit", "gather", "rowfetch", "roworder", "rowlayout")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results")
    ap.add_argument("--sections", default="scan")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--sizes", default="32768,131072")
    ap.add_argument("--rowfetch-sizes", default="131072", help="context sizes of the row-fetch section")
    ap.add_argument("--name", default="kernels_h200", help="results file name (without extension)")
    ap.add_argument("--chunks", default="", help="groups x tokens of the scanchunk section's chunks, e.g. "
                                                 "1x1048576,4x131072 (default: SCAN_CHUNKS)")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(harness.expand_preset(sys.argv[1:] if argv is None else argv, PRESETS))
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"--sections: unknown {unknown}; choose from {list(SECTIONS)}")
    dev = jax.devices()[0]
    res = {
        "machine": {"device": dev.device_kind, "platform": platform.platform(), "python": platform.python_version()},
        "jax": jax.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "copy": copy_rate(),
    }
    print("copy", res["copy"], flush=True)
    if "scan" in sections:
        res["scan_check"] = check_scans()
        print("check", res["scan_check"], flush=True)
        res["scan"] = []
        res["plan_active_channels"] = {}
        for n in map(int, args.sizes.split(",")):
            rows, stats = scan_cases(n, tune=args.tune)
            res["scan"] += rows
            res["plan_active_channels"][n] = stats
            for r in rows:
                print(f"{r['kernel']:22s} n={n:7d} lanes={r['lanes']:2d} tile={r['tile']:5d} w={r['num_warps']} "
                      f"{r['median_ms']:.4f} ms [{r['min_ms']:.4f},{r['max_ms']:.4f}] {r['GBps']:.0f} GB/s "
                      f"authors {r['authors_ms']}", flush=True)
    os.makedirs(args.out, exist_ok=True)

    def save():  # after every section, so a run stopped at its time limit keeps what it measured
        with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
            json.dump(res, f, indent=1)
        write_report(res, args.out, args.name)

    save()
    if "scanchunk" in sections:
        res["scan_chunk"] = scan_chunk_cases(parse_chunks(args.chunks) if args.chunks else SCAN_CHUNKS)
        save()
    if "topk" in sections:
        res["topk"] = topk_cases(tune=args.tune)
        save()
    if "topksplit" in sections:
        res["topk_split"] = topk_split_cases()
        save()
        save()
    if "gather" in sections:
        res["gather"] = gather_cases(tune=args.tune)
        save()
    if "rowfetch" in sections:
        res["row_fetch"] = rowfetch_cases(tuple(map(int, args.rowfetch_sizes.split(","))),
                                          ROWFETCH_CONFIGS if args.tune else ((32, 4),))
        save()
    if "roworder" in sections:
        res["row_order"] = roworder_cases()
        save()
    if "rowlayout" in sections:
        res["row_layout"] = rowlayout_cases(tuple(map(int, args.rowfetch_sizes.split(","))))
        save()


def _section(title, notes, columns, rows):
    """A report section: ``## title``, each note as a paragraph, then a markdown table of ``columns`` over ``rows``
    (one list of cells per row)."""
    lines = [f"## {title}", ""]
    for note in notes:
        lines += [note, ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(map(str, cells)) + " |" for cells in rows] + [""]


def _ms(r):
    """The median and [min, max] cells of a timing."""
    return [f"{r['median_ms']:.4f}", f"[{r['min_ms']:.4f}, {r['max_ms']:.4f}]"]


def write_report(res, out, name="kernels_h200"):
    L = [f"# Kernel benchmarks ({res['machine']['device']})", "",
         f"JAX {res['jax']}, {res['date']}. Median of repeats of a jitted fori_loop (ms per call), [min, max].",
         f"HBM copy rate (read+write, 1 GiB): {res['copy']['GBps']:.0f} GB/s.", ""]
    if "scan" in res:
        L += _section(
            "Scans (HBM-resident, batch 4 x 8 KV heads, G=4, D=128)",
            [f"Correctness on the GPU: {res['scan_check']}; mean active channels per plan: {res['plan_active_channels']}.",
             "lanes: consecutive tokens a thread owns in the plane scan (8, 16 or 32; 0 in rows of the nibble scans and in "
             "rows of the blocked kernel, since removed, in older results)."],
            ["kernel", "n", "lanes", "tile", "warps", "ms (median)", "[min, max]", "GB/s (reads + f32 scores)", "authors' ms"],
            ([r["kernel"], r["n"], r.get("lanes", 0), r["tile"], r["num_warps"], *_ms(r),
              f"{r['GBps']:.0f}", r["authors_ms"]] for r in res["scan"]))
    if "scan_chunk" in res:
        L += _section(
            "Scan of one pipelined chunk (Fathom 48, staged planes of the chunk's groups, HBM-resident, G=4, D=128)",
            ["The chunk scans of the decode step: 1 group of 1M tokens (batch 1 in 8 chunks), 4 and 32 groups of 128k "
             "(batch 1 and 8 in 2 chunks). `same bits`: scores equal to the first configuration's bit for bit."],
            ["groups", "n", "tile", "lanes", "warps", "us (median)", "[min, max]", "same bits"],
            ([r["groups"], r["n"], r["tile"], r["lanes"], r["num_warps"], f"{r['median_ms'] * 1e3:.1f}",
              f"[{r['min_ms'] * 1e3:.1f}, {r['max_ms'] * 1e3:.1f}]", r["same_bits"]] for r in res["scan_chunk"]))
    if "gather" in res:
        L += _section(
            "Run gather vs run size (8 KV heads x 128 channels x 4 planes)", [],
            ["kernel", "source", "run bytes", "chunk, warps", "total MB", "ms", "GB/s"],
            ([r["kernel"], r["source"], r["run_bytes"], f"{r['chunk']}, {r['num_warps']}" if "chunk" in r else "",
              f"{r['bytes']/1e6:.1f}", f"{r['median_ms']:.3f}", f"{r['GBps']:.1f}"] for r in res["gather"]))
    if "topk" in res:
        L += _section(
            "Top-k (4 sink + 32 local + top-476), [32, n], k = 512", [],
            ["method", "n", "ms", "[min, max]", "same set as reference"],
            ([r["kernel"], r["n"], *_ms(r), r["same_set_as_reference"]] for r in res["topk"]))
    if "topk_split" in res:
        L += _section(
            "Top-k with split rows (fused path; k = 512; a decode cache's rows, length n - 63)",
            ["`buckets / P`: each row's bucket selection over P programs, then one merging their survivors; "
             "`tokens / P` likewise for the token selection among the candidate buckets (1: one program per row)."],
            ["n", "rows", "buckets / P", "tokens / P", "ms", "[min, max]", "same set as reference"],
            ([r["n"], r["rows"], r["bucket_splits"], r["token_splits"], *_ms(r), r["same_set_as_reference"]]
             for r in res["topk_split"]))
    if "union" in res:
        L += _section(
            "Union of a group's selections (G = 4 heads x k = 512 slots, Pallas top-k output at 128k)",
            ["`sort`: the G k slots sorted (one XLA sort); `sorted lists`: the heads' increasing lists searched "
             "(``group_union(sorted_heads=True)``)."],
            ["groups", "union by", "ms", "[min, max]", "same set and memberships"],
            ([r["groups"], "sorted lists" if r["sorted_heads"] else "sort", *_ms(r), r["same_as_sorted"]]
             for r in res["union"]))
    if "row_fetch" in res:
        L += _section(
            "Row fetch (2048 rows x 8 KV heads, K and V, bf16, Dh = 128)",
            ["rows: `repeated` = every timed call fetches the same rows; `fresh` = each call its own random set."],
            ["source", "n", "pattern", "rows", "rows/program", "warps", "ms", "GB/s", "rows/s", "exact"],
            ([r["source"], r.get("n", 131072), r.get("pattern", "random"), r.get("rowset", "repeated"), r.get("rows", 32),
              r.get("num_warps", 4), f"{r['median_ms']:.4f}", f"{r['GBps']:.1f}", f"{r['rows_per_s']:.3g}", r["exact"]]
             for r in res["row_fetch"]))
    if "row_layout" in res:
        L += _section(
            "Row fetch layout (2048 fresh rows per call x 8 KV heads, K and V, bf16, Dh = 128, from pinned_host)",
            ["`split`: K and V as two arrays (two 256-byte runs per token); `interleaved`: one `[n, 2 Dh]` array "
             "(one 512-byte run per token)."],
            ["layout", "n", "ms", "[min, max]", "GB/s", "exact"],
            ([r["layout"], r["n"], *_ms(r), f"{r['GBps']:.1f}", r["exact"]] for r in res["row_layout"]))
    if "row_order" in res:
        L += _section(
            "Row fetch order (2048 fresh rows per call per group, one 512-byte K/V run each, from pinned_host)",
            ["`programs` 0: one program per 32 rows (every group's rows in flight at once); N: N persistent programs "
             "walking the rows group by group."],
            ["groups", "n", "K/V GiB", "programs", "ms", "[min, max]", "GB/s", "exact"],
            ([r["groups"], r["n"], f"{r['groups'] * r['n'] * 512 / 2**30:.1f}", r["programs"], *_ms(r),
              f"{r['GBps']:.1f}", r["exact"]] for r in res["row_order"]))
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(L))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if "scan" not in res:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    names = ["sparq_r16", "nibble_32", "full_4bit", "fathom_48", "fathom_64"]
    ns = sorted({r["n"] for r in res["scan"]})
    for i, n in enumerate(ns):
        ours = [min((r["median_ms"] for r in res["scan"] if r["kernel"] == k and r["n"] == n), default=np.nan) for k in names]
        theirs = [AUTHORS.get(n, {}).get(k, np.nan) for k in names]
        x = np.arange(len(names)) + i * 0.4
        ax.bar(x, ours, 0.2, label=f"ours n={n}")
        ax.bar(x + 0.2, theirs, 0.2, label=f"authors n={n}", alpha=0.6)
    ax.set_xticks(np.arange(len(names)) + 0.3)
    ax.set_xticklabels(names)
    ax.set_ylabel("ms per layer")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{name}.png"), dpi=100)


if __name__ == "__main__":
    main()
