"""The kernel benchmark's HBM-resident kernels: the plane and nibble scans (against the authors' Triton kernels) and
the top-k selection (against ``lax.top_k``), each timed by :func:`scripts.harness.timeit`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import importance, plan_bisection
from pallas_kernels import nibble_scan as NS
from pallas_kernels import plane_scan as PS
from pallas_kernels import topk as TK
from pallas_kernels.operands import RunList, StorePlanes
from scripts.harness import timeit

AUTHORS = {  # DESIGN.md: the authors' Triton kernels on this H200 (ms), batch 4 x 8 KV heads, G=4, D=128
    32768: {"sparq_r16": 0.024, "nibble_32": 0.056, "full_4bit": 0.156, "fathom_48": 0.048, "fathom_64": 0.058},
    131072: {"sparq_r16": 0.091, "nibble_32": 0.158, "full_4bit": 0.549, "fathom_48": 0.171, "fathom_64": 0.210},
}
LOGVAR_STD = 1.25  # log-normal channel variances: ~39 active channels at a budget of 48 (DESIGN.md)


def scan_inputs(n, *, batch=4, heads=8, groups=4, d=128, seed=0):
    rng = np.random.default_rng(seed)
    w = n // 32
    planes = jnp.asarray(rng.integers(0, 2**32, (batch, heads, d, 4, w), dtype=np.uint32))
    scales = jnp.asarray(rng.uniform(0.5, 2.0, (batch, heads, d, n // 64)).astype(np.float16))
    length = jnp.full((batch, heads), n, jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, heads, groups, d)), jnp.float32)
    var = jnp.asarray(np.exp(LOGVAR_STD * rng.standard_normal((batch, heads, d))), jnp.float32)
    return q, planes, scales, length, var


def scan_cases(n, tune=False, budgets=(32, 48, 64), nibble=True):
    q, planes, scales, length, var = scan_inputs(n)
    g = importance(q, var)
    store = StorePlanes(planes, scales)
    bh = 4 * 8
    out = []
    plan_stats = {}
    cfgs = [PS.PlaneScanConfig(), PS.PlaneScanConfig(tile=1024, lanes=32), PS.PlaneScanConfig(tile=512, lanes=8,
                                                                                              num_warps=2)]
    if n >= 131072:
        cfgs.insert(1, PS.PlaneScanConfig(tile=1024, lanes=16, num_warps=2))
    if tune and n >= 131072:
        cfgs += [PS.PlaneScanConfig(tile=2048, lanes=32, num_warps=2), PS.PlaneScanConfig(tile=256, lanes=8)]
    cfgs += F16X2_CONFIGS
    for budget in budgets:
        plan = plan_bisection(g, budget)
        runs = PS.active_channels(plan.depths)
        active = plan_stats[budget] = float(jnp.mean(jnp.sum(plan.depths > 0, -1)))
        bits = float(jnp.mean(plan.bits_per_token))
        nbytes = bh * n * bits / 8 + bh * 4 * n * 4  # reads (codes + scales) + f32 scores written
        exact = PS.plane_scan(q, store, length, runs, config=cfgs[0])  # the f32 scores the f16x2 rows are held to
        bound = PS.f16x2_error_bound(q, store, runs)
        for cfg in cfgs:
            r = _time_scan(lambda c: PS.plane_scan(q + c, store, length, runs, config=cfg))
            r.update(kernel=f"fathom_{budget}", n=n, **_scan_config_fields(cfg), active_channels=active,
                     bits_per_token=bits, bytes=nbytes)
            if cfg.math != "f32":
                r.update(selection_against_f32(PS.plane_scan(q, store, length, runs, config=cfg), exact, bound))
            out.append(r)
        del exact, bound
    nib = NS.pack_nibbles(planes)
    for name, r_ch in (("sparq_r16", 16), ("nibble_32", 32), ("full_4bit", 128)) if nibble else ():
        ch = jnp.broadcast_to(jnp.arange(r_ch, dtype=jnp.int32), (4, 8, r_ch))
        bits = r_ch * 4 + r_ch * 16 / 64
        nbytes = bh * n * bits / 8 + bh * 4 * n * 4
        config = NS.NibbleScanConfig(tile=512, num_warps=1)
        r = _time_scan(lambda c: NS.nibble_scan(q + c, nib, scales, length, ch, config=config))
        r.update(kernel=name, n=n, variant="nibble", lanes=0, rows=0, tile=config.tile, num_warps=config.num_warps,
                 bits_per_token=bits, bytes=nbytes)
        out.append(r)
        if tune and r_ch == 32 and n >= 131072:  # the same scan from the plane store: the plane scan at depth 4
            cfg = PS.PlaneScanConfig(tile=2048, num_warps=2)
            full = RunList(ch, jnp.full(ch.shape, 4, jnp.int32), sorted=True)
            r = _time_scan(lambda c: PS.plane_scan(q + c, store, length, full, config=cfg))
            r.update(kernel="nibble_32_from_planes", n=n, **_scan_config_fields(cfg), bits_per_token=bits, bytes=nbytes)
            out.append(r)
    for r in out:
        r["GBps"] = r["bytes"] / (r["median_ms"] * 1e-3) / 1e9
        r["authors_ms"] = AUTHORS.get(n, {}).get(r["kernel"])
    return out, plan_stats


def _time_scan(scan) -> dict:
    """:func:`timeit` of ``scan(c)`` (the scan of the queries nudged by ``c`` [4, 8, 1, 1]: each iteration's by the
    last's scores, so that nothing is hoisted)."""
    return timeit(lambda c: c + 1e-30 * scan(c)[..., :1, :1].sum(axis=(-1, -2))[..., None, None],
                  jnp.zeros((4, 8, 1, 1), jnp.float32), iters=100)


# The packed-f16 scan's launch shapes (a thread owns a word: tile >= 1024).
F16X2_CONFIGS = tuple(PS.PlaneScanConfig(tile=t, num_warps=w, math="f16x2")
                      for t, w in ((1024, 1), (2048, 2), (4096, 4)))


def _scan_config_fields(cfg):
    return {"variant": "lanes" if cfg.math == "f32" else cfg.math, "lanes": cfg.lanes, "rows": 0, "tile": cfg.tile,
            "num_warps": cfg.num_warps}


def selection_against_f32(scores, exact, bound, k=512):
    """The top-``k`` of ``scores`` against that of the f32 ``exact`` scores, per row: tokens that differ, and how many
    of them are near-ties (their exact score within twice the f16x2 error bound of the row's k-th exact score)."""
    scores, exact = np.asarray(scores), np.asarray(exact)
    bound = np.broadcast_to(np.asarray(bound)[..., None, :], exact.shape)
    differ = ties = 0
    rows = exact.reshape(-1, exact.shape[-1])
    for got, ref, b in zip(scores.reshape(rows.shape), rows, bound.reshape(rows.shape)):
        mine, theirs = np.argpartition(-got, k)[:k], np.argpartition(-ref, k)[:k]
        gone = np.setdiff1d(theirs, mine)
        kth = np.partition(ref, -k)[-k]
        differ += len(gone)
        ties += int(np.sum(np.abs(ref[gone] - kth) <= 2 * b[gone]))
    return {"topk_rows": len(rows), "topk_k": k, "topk_differ": differ, "topk_differ_near_ties": ties,
            "max_err_over_bound": float(np.max(np.abs(scores - exact) / np.maximum(bound, 1e-30)))}


# One chunk of the pipelined decode step (fathom_jax.placement): the scan of the staged planes of a few groups, which
# sits between the layer's last plane transfer and its top-k. (groups, n): Qwen3-8B shapes at batch 1, 8 KV heads in
# 8 chunks at 1M and in 2 at 128k; batch 8 at 128k in 2 chunks.
SCAN_CHUNKS = ((1, 1 << 20), (4, 1 << 17), (32, 1 << 17))
SCAN_CHUNK_CONFIGS = tuple(PS.PlaneScanConfig(tile=t, lanes=l, num_warps=w)
                           for t, l, w in ((512, 16, 1), (256, 8, 1), (1024, 16, 2), (1024, 32, 1))) + F16X2_CONFIGS


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
        plan = plan_bisection(importance(q, var), budget)
        runs = PS.active_channels(plan.depths)
        ch = runs.channels
        staged = StorePlanes(jnp.take_along_axis(planes, ch[..., None, None], 1),
                             jnp.take_along_axis(scales, ch[..., None], 1))
        qs = jnp.take_along_axis(q, ch[:, None, :], axis=-1)
        slots = runs.slots()
        active = float(jnp.mean(jnp.sum(runs.depths > 0, -1)))
        bound = PS.f16x2_error_bound(qs, staged, slots)
        first = None
        for cfg in configs:
            scan = jax.jit(lambda qq, cfg=cfg: PS.plane_scan(qq, staged, length, slots, config=cfg))
            got = np.asarray(scan(qs))
            first = got if first is None else first
            step = lambda c, cfg=cfg: c + 1e-30 * PS.plane_scan(
                qs + c, staged, length, slots, config=cfg)[:, :1, :1].sum()
            r = timeit(step, jnp.zeros((), jnp.float32), iters=100)
            r.update(kernel=f"fathom_{budget}_chunk", groups=groups, n=n, **_scan_config_fields(cfg),
                     active_channels=active, same_bits=bool(np.array_equal(got, first)))
            if cfg.math != "f32":
                r.update(selection_against_f32(got, first, bound))
            out.append(r)
            print(f"scan chunk groups={groups:2d} n={n:7d} tile={cfg.tile:4d} lanes={cfg.lanes:2d} w={cfg.num_warps} "
                  f"{r['median_ms'] * 1e3:7.1f} us [{r['min_ms'] * 1e3:.1f}, {r['max_ms'] * 1e3:.1f}] "
                  f"same bits {r['same_bits']}", flush=True)
    return out


def check_scans():
    """Kernel == reference on the GPU at a small odd size (fresh random data)."""
    q, planes, scales, length, var = scan_inputs(1984, batch=2, heads=3, seed=7)
    length = jnp.asarray([[1984, 1000, 65], [7, 1984, 1500]], jnp.int32)
    plan = plan_bisection(importance(q, var), 48)
    store, runs = StorePlanes(planes, scales), PS.active_channels(plan.depths)
    b = PS.plane_scan_reference(q, store, length, runs)
    rel = lambda x, y: float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))
    e = {f"plane_scan_lanes{lanes}_rel_err": rel(PS.plane_scan(
        q, store, length, runs, config=PS.PlaneScanConfig(lanes=lanes, tile=32 * lanes, num_warps=2)), b)
        for lanes in (8, 16, 32)}
    got = PS.plane_scan(q, store, length, runs, config=PS.PlaneScanConfig(math="f16x2"))
    bound = PS.f16x2_error_bound(q, store, runs)[..., None, :]
    valid = jnp.arange(got.shape[-1]) < length[..., None, None]
    e["plane_scan_f16x2_rel_err"] = rel(got, b)
    e["plane_scan_f16x2_max_err_over_bound"] = float(jnp.max(jnp.where(valid, jnp.abs(got - b) / bound, 0.0)))
    nib = NS.pack_nibbles(planes)
    ch16 = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 3, 16))
    c = NS.nibble_scan(q, nib, scales, length, ch16)
    d = NS.nibble_scan_reference(q, nib, scales, length, ch16)
    return {**e, "nibble_scan_rel_err": rel(c, d)}


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
        fns = [(name, lambda s, c=c: TK.topk_select(s, length, k=k, implementation="triton", config=c))
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
                fn = lambda s, cfg=cfg: TK.topk_select(s, length, k=k, implementation="triton", config=cfg)  # noqa: E731
                same = bool(jnp.array_equal(fn(scores), want))
                step = lambda c, fn=fn: c + fn(scores + c).astype(jnp.float32)[:, :1] * 1e-30  # noqa: E731
                t = timeit(step, jnp.zeros((r, 1), jnp.float32), iters=50, repeats=3)
                t.update(kernel="topk_split", n=n, k=k, rows=r, bucket_splits=bs, token_splits=ts,
                         same_set_as_reference=same)
                out.append(t)
                print(f"topk split n={n:8d} rows={r:2d} buckets/{bs:2d} tokens/{ts:2d} {t['median_ms']:.4f} ms "
                      f"[{t['min_ms']:.4f}, {t['max_ms']:.4f}] same={same}", flush=True)
    return out
