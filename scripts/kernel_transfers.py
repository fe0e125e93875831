"""The kernel benchmark's transfers from host memory: the run gather of plane runs and the row fetch of K/V rows from
``pinned_host`` (against HBM and ``device_put``), by run size, context, index pattern, layout and grid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import row_fetch as RF
from pallas_kernels import run_gather as RG
from pallas_kernels.operands import RunList, StorePlanes
from scripts.harness import time_ms, timeit_args

GATHER_CONFIGS = ((2048, 4), (1024, 4), (4096, 4), (8192, 4), (2048, 8), (4096, 8), (8192, 8), (16384, 8))  # chunk, warps
ROWFETCH_CONFIGS = ((32, 4), (16, 4), (64, 4), (64, 8), (128, 8))  # rows per program, warps; --tune tries them all
ROWORDER_CASES = ((8, 1 << 20), (64, 131072), (8, 131072))  # (groups, n): 4 GiB, 4 GiB and 0.5 GiB of K/V rows
ROWORDER_PROGRAMS = (0, 66, 132, 264)


def _host(x):
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))


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
                    runs = RunList(ch + (c > 1e30).astype(jnp.int32), dep)
                    p = RG.run_gather(StorePlanes(planes, scales), runs, config=config).planes
                    return c + p[0, 0, 0, 0].astype(jnp.float32) * 1e-30
                r = timeit_args(step, jnp.zeros((), jnp.float32), (planes, scales), reps=min(20, iters), repeats=3)
                r.update(kernel="run_gather", source=where, run_bytes=run_kb * 1024, bytes=nbytes, chunk=chunk,
                         num_warps=warps)
                r["GBps"] = nbytes / (r["median_ms"] * 1e-3) / 1e9
                out.append(r)
                print(f"run_gather {where:11s} run={run_kb * 1024:7d}B chunk={chunk:5d} w={warps} "
                      f"{r['median_ms']:.3f} ms {r['GBps']:.1f} GB/s", flush=True)
        host = _host(planes_np)
        to_device = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
        r = {"kernel": "device_put", "source": "pinned_host", "run_bytes": run_kb * 1024, "bytes": planes_np.nbytes,
             **time_ms(lambda: jax.device_put(host, to_device), 5, warmup=False)}
        r["GBps"] = r["bytes"] / (r["median_ms"] * 1e-3) / 1e9
        out.append(r)
        print(f"device_put  pinned_host run={run_kb * 1024:7d}B {r['median_ms']:.3f} ms {r['GBps']:.1f} GB/s", flush=True)
        del host
    return out


def rowfetch_cases(sizes=(131072,), configs=ROWFETCH_CONFIGS[:1]):
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
                ref = RF.row_fetch_reference(RF.StoredRows(k_hbm, v_hbm), idx)[0]
                for rows, warps in (configs if where == "pinned_host" else configs[:1]):
                    cfg = RF.RowFetchConfig(rows=rows, num_warps=warps)
                    ok = bool(jnp.array_equal(RF.row_fetch(RF.StoredRows(k_, v_), idx, config=cfg)[0], ref))

                    def step(c, k_, v_, cfg=cfg, idx=idx):
                        got = RF.row_fetch(RF.StoredRows(k_, v_), idx + (c > 1e30).astype(jnp.int32), config=cfg)[0]
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
        want = RF.row_fetch_reference(RF.StoredRows(kv_hbm), idx)[0]
        for layout, (a, b) in layouts.items():
            got = RF.row_fetch(RF.StoredRows(a, b), idx)
            got = got[0] if b is None else jnp.concatenate([got[0], got[1]], axis=-1)
            ok = bool(jnp.array_equal(got, want))
            r = _time_fresh_rows(a, b, n, bh, s, RF.RowFetchConfig(), reps=reps)
            out.append(r | {"kernel": "row_fetch_layout", "layout": layout, "source": "pinned_host", "n": n,
                            "exact": ok})
            print(f"row_fetch layout={layout:11s} n={n:8d} fresh {r['median_ms']:.4f} ms "
                  f"[{r['min_ms']:.4f}, {r['max_ms']:.4f}] {r['GBps']:.1f} GB/s exact={ok}", flush=True)
        del layouts, kv_hbm
    return out


def roworder_cases(cases=ROWORDER_CASES, programs=ROWORDER_PROGRAMS):
    """Fresh rows per call (2048 per group, one 512-byte K/V run each) from host memory: one program per 32 rows
    (every group's rows in flight at once) against persistent programs walking the groups one after another."""
    out = []
    dh, s = 128, 2048
    for bh, n in cases:
        kv_hbm = jax.random.normal(jax.random.key(n + bh), (bh, n, 2 * dh), jnp.bfloat16)
        kv = _host(kv_hbm)
        idx = jnp.asarray(np.sort(np.random.default_rng(5).choice(n, (bh, s)), axis=-1), jnp.int32)
        want = RF.row_fetch_reference(RF.StoredRows(kv_hbm), idx)[0]
        del kv_hbm
        for p in programs:
            cfg = RF.RowFetchConfig(programs=p)
            ok = bool(jnp.array_equal(RF.row_fetch(RF.StoredRows(kv), idx, config=cfg)[0], want))
            r = _time_fresh_rows(kv, None, n, bh, s, cfg)
            out.append(r | {"kernel": "row_fetch_order", "source": "pinned_host", "groups": bh, "n": n, "programs": p,
                            "exact": ok})
            print(f"row_fetch groups={bh:3d} n={n:8d} programs={p:4d} fresh {r['median_ms']:.4f} ms "
                  f"[{r['min_ms']:.4f}, {r['max_ms']:.4f}] {r['GBps']:.1f} GB/s exact={ok}", flush=True)
        del kv
    return out


def _time_fresh_rows(k_, v_, n, bh, s, cfg, reps=20, repeats=3):
    """ms per row fetch when each of ``reps`` chained calls fetches its own random sorted row set of ``bh x s`` rows,
    and their GB/s (a row: its bytes in ``k_`` and, where given, ``v_``)."""
    rng = np.random.default_rng(11)
    sets = jnp.asarray(np.sort(rng.choice(n, (reps, bh, s)), axis=-1), jnp.int32)

    @jax.jit
    def run(c, k_, v_, sets):
        for i in range(reps):
            got = RF.row_fetch(RF.StoredRows(k_, v_), sets[i] + (c > 1e30).astype(jnp.int32), config=cfg)[0]
            c = c + got[0, 0, 0].astype(jnp.float32) * 1e-30
        return c

    c0 = jnp.zeros((), jnp.float32)
    r = time_ms(lambda: run(c0, k_, v_, sets), repeats, reps)
    nbytes = bh * s * sum(x.shape[-1] * x.dtype.itemsize for x in (k_, v_) if x is not None)
    return r | {"rowset": "fresh", "slots": bh * s, "bytes": nbytes, "GBps": nbytes / (r["median_ms"] * 1e-3) / 1e9}
