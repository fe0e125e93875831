"""Offloaded sparse decoding of a Qwen3-8B-shaped model: results/offload_<tag>.{json,md,png}.

The K/V cache and the key index of every layer live in ``pinned_host`` memory, stacked by layer; HBM holds
the weights, the queries and the selected rows. One compiled program per decode step (36 layers under
``lax.scan``), one per attention-only step (the paper's terms: no weight GEMMs).

Caches are synthetic where no prefill is run: each layer's keys are drawn with log-normal channel scales
(log-variance std 1.25, as the kernel benchmark: ~39 active channels at a budget of 48) and written through
the same path as prefill (the index is built from them, so the planes are real codes); the calibration
variance is the drawn one. Where the host cannot hold every layer's K/V rows (1M tokens on a 128 GiB host),
all layers share one row buffer while each keeps its own planes (``shared_kv`` in the results): the bytes
a step moves are the same.

    python3 scripts/bench_offload.py --out $OUT                      # the default sections (one H200)
    python3 scripts/bench_offload.py --mesh 2 --tag h200x2 --out $OUT   # over two GPUs
    JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python3 scripts/bench_offload.py --mesh 2 \
        --out $OUT                                                   # one process per host (fathom_jax.distributed)
    python3 scripts/bench_offload.py --smoke --out /tmp/smoke          # tiny shapes, any backend (CI-size)
    python3 scripts/bench_offload.py --merge results/offload_h200 a.json b.json   # one file from several runs
    python3 scripts/bench_offload.py --preset attn --out $OUT        # the run behind a committed table (PRESETS)

Sections (``--sections``): link, attn, full, profile, batch, control, dense, prefill; ``attnprofile`` adds a
profiler breakdown (categories and the costliest kernels) to every attention-only row; ``attnbatch``: attention-only
rows at 128k for each of ``--batches``.

K/V row formats (``--rows model,k8v8``; an entry ``FORMAT@SHARE`` sets that format's ``--share-kv-from``): one set
of rows each in the attn, attnbatch, full and batch sections, over a cache of its own; each row records its format
(``rows``), its row bytes per token and per step, and its host bytes per token (as held, and with every layer's own
rows).

A row cache (``--row-cache SLOTS``, :class:`fathom_jax.decode.RowCache`) pays only when a step reselects rows
of the steps before it: ``--query-drift RHO`` gives every attention-only step new queries, drifting from the last
step's (AR(1); 0.95 leaves ~37% of the rows new each step, what SmolLM2 measured on real text) instead of one query
set repeated. The report's row-cache table puts each such row beside the same step without a cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import math
import os
import re
import resource
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import harness  # noqa: E402
from fathom_jax import calibrate, decode, distributed, methods  # noqa: E402
from fathom_jax.decode import StepConfig  # noqa: E402
from fathom_jax.decode.rows import RowLayout, row_format  # noqa: E402
from fathom_jax.models import LlamaConfig, LlamaForCausalLM, generation  # noqa: E402
from fathom_jax.models.attention import CacheShape  # noqa: E402
from fathom_jax.placement import Placement, attach_bulk, device_mesh, split_bulk  # noqa: E402
from pallas_kernels.topk import TopkConfig  # noqa: E402

QWEN3_8B = LlamaConfig(vocab=151936, hidden=4096, intermediate=12288, n_layers=36, n_heads=32, n_kv_heads=8,
                       head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True, max_position_embeddings=1 << 20,
                       family="qwen3")
SMOKE = LlamaConfig(vocab=512, hidden=64, intermediate=128, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=64,
                    rope_theta=1e6, qk_norm=True, family="qwen3")
LOGVAR_STD = 1.25
METHODS = {  # label -> spec
    "Fathom 48": "fathom:48", "Fathom 64": "fathom:64", "SparQ r=16": "sparq:16",
    "32-channel (SparQ r=32)": "sparq:32", "full 4-bit": "full4",
}
AUTHORS_MS = {  # DESIGN.md: the authors' implementation on the same H200 (attention only, 36 layers, batch 1)
    131072: {"Fathom 48": 19.3, "Fathom 64": 21.5, "SparQ r=16": 19.9, "32-channel (SparQ r=32)": 27.3},
    1 << 20: {"Fathom 48": 104.8, "Fathom 64": 120.6, "SparQ r=16": 106.4, "32-channel (SparQ r=32)": 161.1},
}

# `--preset NAME`: the argument list of the run behind a committed table (results/README.md names each table's
# presets, their environment and the --merge that joins them); arguments after it override it (--out, --tag, ...).
_F4 = '--methods "Fathom 48,Fathom 64,SparQ r=16,32-channel (SparQ r=32)"'
_F3 = '--methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)"'
_F48, _F48_32 = '--methods "Fathom 48"', '--methods "Fathom 48,32-channel (SparQ r=32)"'
_WHILE = "xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE"
PRESETS = harness.presets({
    # results/offload_h200.*, one H200
    "attn": f"--tag h200_attn --read staged --sections link,attn --contexts 1m,128k {_F4} --share-kv-from 1m "
            "--time-budget 280",
    "attn-index-writes-1m": f"--tag h200_writes_1m --read staged --sections link,attn --contexts 1m {_F3} "
                            "--index-writes every_step,full_blocks --share-kv-from 1m --time-budget 140",
    "attn-index-writes-128k": f"--tag h200_writes_128k --read staged --sections attn,full --contexts 128k "
                              f"--full-contexts 128k {_F3} --index-writes every_step,full_blocks --time-budget 90",
    "direct-reads": "--tag h200_direct --read direct --sections link,attn --contexts 1m,128k --time-budget 280",
    "contexts-32k-512k": f"--tag h200_32k_512k --read staged {_F4} --sections attn,dense --contexts 512k,128k,32k "
                         "--attn-contexts 512k,32k --share-kv-from 512k --time-budget 550",
    "full-1m": f"--tag h200_full_1m --read staged --sections full,profile --contexts 1m --full-contexts 1m {_F48} "
               "--share-kv-from 1m --time-budget 120",
    "full-3methods": f"--tag h200_full_3 --read staged {_F3} --sections attn,full,profile,batch,prefill,control,dense "
                     "--contexts 1m,128k --attn-contexts 1m,128k --full-contexts 1m --share-kv-from 1m --time-budget 290",
    "full-batches": f"--tag h200_batches {_F48} --sections link,attn,attnprofile,full,profile,batch --contexts 1m,128k "
                    "--attn-contexts 128k --full-contexts 1m,128k --batches 8,4 --share-kv-from 512k --time-budget 400",
    "full-batches-128k": f"--tag h200_batches_128k {_F48} --read staged --sections link,full,batch --contexts 128k "
                         "--batches 4,8 --time-budget 320",
    "full-batch8": f"--tag h200_batch8 --read staged --sections link,full,batch,profile --contexts 128k "
                   f"--full-contexts 128k --batches 8 {_F48} --fetch-programs auto,132 --share-kv-from 512k "
                   "--time-budget 190",
    "prefill": f"--tag h200_prefill --read staged {_F48} --sections prefill,batch --contexts 128k --batches 8 "
               "--share-kv-from 512k --time-budget 155",
    "hbm-control": f"--tag h200_control {_F48} --read staged --sections batch,control --contexts 128k --batches 8,1 "
                   "--time-budget 270",
    # results/pipeline_h200.md (the pipeline rows are in offload_h200 as well)
    "pipeline-1m": f"--tag h200_pipeline_1m --read staged {_F3} --index-writes every_step,full_blocks "
                   "--pipeline auto,1/0 --sections link,attn,attnprofile --contexts 1m --share-kv-from 1m "
                   "--time-budget 270",
    "pipeline-128k": f"--tag h200_pipeline_128k --read staged {_F3} --index-writes every_step,full_blocks "
                     "--pipeline auto,1/0 --sections link,attn --contexts 128k --time-budget 220",
    "pipeline-chunks": f"--tag h200_chunks --read staged {_F48} --index-writes full_blocks "
                       "--pipeline 1,1/132,2/132,4/132,8/0,8/132,8/264 --sections link,attn,attnprofile "
                       "--contexts 1m,128k --share-kv-from 1m --time-budget 390",
    "pipeline-programs": f"--tag h200_programs --read staged {_F48} --index-writes full_blocks "
                         "--pipeline 1,8/132,8/66,8/33,4/66,2/66 --sections link,attn,attnprofile --contexts 1m,128k "
                         "--share-kv-from 1m --time-budget 290",
    # results/decode_step_h200.md (rows merged into offload_h200 too)
    "topk-fetch-programs": f"--tag h200_topk_fetch --read staged --sections link,attn --contexts 1m {_F48} "
                           "--fetch-programs auto,0 --topk auto,single --share-kv-from 1m --time-budget 190",
    "weight-gemms": f"--tag h200_weights --read staged --sections link,full,batch --contexts 128k --full-contexts 128k "
                    f"--batches 8 {_F48} --share-kv-from 512k --time-budget 160 "  # the Triton control, then the default
                    '--xla-options "xla_gpu_enable_triton_gemm=true,xla_gpu_enable_dynamic_slice_fusion=false;none"',
    # results/step_options_h200.md, results/tail_h200.* (traces of layer-unroll-profile)
    "layer-unroll": f"--tag h200_unroll --read staged --sections attn --contexts 1m,128k {_F48} --share-kv-from 1m "
                    "--layer-unroll 1,2,4,6 --time-budget 280",
    "layer-unroll-profile": f"--tag h200_unroll_profile --read staged --sections attn,attnprofile --contexts 1m,128k "
                            f"{_F48} --share-kv-from 1m --layer-unroll 2,4 --time-budget 220",
    "layer-unroll-full": f"--tag h200_unroll_full --read staged --sections full --contexts 128k --full-contexts 128k "
                         f"{_F48} --layer-unroll 1,4 --time-budget 220",
    "command-buffer-loop": f"--tag h200_while --read staged --sections attn --contexts 1m,128k {_F48} --share-kv-from 1m "
                           f'--xla-options "{_WHILE};{_WHILE},xla_gpu_command_buffer_unroll_loops=true" --time-budget 220',
    "chunks-fetch-programs": f"--tag h200_chunks_fetch --read staged --sections attn --contexts 1m,128k {_F48} "
                             "--share-kv-from 1m --layer-unroll 2 --pipeline auto,4,8 --fetch-programs 66,132 "
                             "--time-budget 400",
    "topk-programs": f"--tag h200_topk --read staged --sections attn --contexts 1m,128k {_F48} --share-kv-from 1m "
                     "--topk auto,b8t4,b16t4,b8t8,bautot8 --time-budget 160",
    # results/row_cache_h200/
    "row-cache-1m": f"--tag h200_row_cache_1m --read staged --sections link,attn --contexts 1m,128k {_F48} "
                    "--share-kv-from 1m --query-drift 0.95 --row-cache 0,16384 --time-budget 190",
    "row-cache-batch8": f"--tag h200_row_cache_b8 --read staged --sections link,attnbatch,attn,batch,attnprofile "
                        f"--contexts 128k --attn-contexts 128k --batches 8 {_F48} --share-kv-from 512k "
                        "--query-drift 0.95 --row-cache 0,16384 --time-budget 390",
    # results/fetch_order_h200/ (the default fetch order) and results/scan_unroll_h200/ (the default scan)
    "fathom48": f"--tag h200_f48 --read staged --sections link,attn --contexts 1m,128k {_F48} --share-kv-from 1m "
                "--time-budget 160",
    "attn-profile-1m": f"--tag h200_profile_1m --read staged --sections attn,attnprofile --contexts 1m {_F48} "
                       "--share-kv-from 1m --time-budget 140",
    # results/offload_h200.* resident planes (issue 33; the p = 0 rows also re-measure the default step)
    "tiers-1m": f"--tag h200_tiers_1m --sections link,attn --contexts 1m {_F4} --resident-planes 0,1 "
                "--share-kv-from 1m --time-budget 350",
    "tiers-128k": f"--tag h200_tiers_128k --sections link,attn --contexts 128k {_F4} --resident-planes 0,1 "
                  "--share-kv-from 1m --time-budget 190",
    "tiers-p24": '--tag h200_tiers_p24 --sections attn --contexts 1m,128k --methods "Fathom 48,Fathom 64" '
                 "--resident-planes 2,4 --share-kv-from 1m --time-budget 210",
    "tiers-profile": f"--tag h200_tiers_profile --sections attn,attnprofile --contexts 1m {_F48} --resident-planes 1 "
                     "--share-kv-from 1m --time-budget 140",
    "tiers-chunks": f"--tag h200_tiers_chunks --sections link,attn --contexts 1m {_F48} --resident-planes 1,2,4 "
                    "--pipeline 8,2,1 --share-kv-from 1m --time-budget 420",
    # K/V row formats (issue 32): every layer's (every session's) own rows in 8-bit K and V, beside bf16 rows; the pinned
    # host cap must hold them (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, README). bf16 rows of every layer at 1M (167 GB) do
    # not fit the 128 GiB host: their row, shared by every layer, is the committed baseline (offload_h200). At 128k
    # batch 8, bf16 own rows (175 GB) do not fit either: bf16 is measured shared as the control, after k8v8 (the
    # larger cache first: the allocator's regions, once pinned, are kept).
    "rows-1m": f"--tag h200_rows_1m --sections link,attn,full --contexts 1m --attn-contexts 1m --full-contexts 1m "
               f"{_F48} --rows k8v8 --share-kv-from none --time-budget 200",
    "rows-1m-tiers": f"--tag h200_rows_1m_tiers --sections link,attn,full --contexts 1m --attn-contexts 1m "
                     f"--full-contexts 1m {_F48} --rows k8v8 --resident-planes 1 --share-kv-from none --time-budget 200",
    "rows-128k-batch": f"--tag h200_rows_128k_b8 --sections link,attnbatch,batch --contexts 128k --batches 8 {_F48} "
                       "--rows k8v8@none,model@512k --share-kv-from none --time-budget 280",
    "tiers-batch8": f"--tag h200_tiers_b8 --sections link,attnbatch,batch --contexts 128k --batches 8 {_F48} "
                    "--rows k8v8 --resident-planes 1 --pipeline 2,1 --share-kv-from none --time-budget 300",
    "rows-128k-batches": f"--tag h200_rows_128k_batches --sections link,batch --contexts 128k --batches 8,4,2,1 "
                         f"{_F48} --rows k8v8 --resident-planes 0,1 --share-kv-from none --time-budget 540",
    # results/offload_h200x2.*, the two-H200 machine (every layer's own K/V: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, README)
    "x2-1m-1gpu": f"--tag h200x2_1m_1gpu --mesh 1 --read staged --sections link,attn --contexts 1m {_F48_32} "
                  "--index-writes every_step,full_blocks --share-kv-from none --time-budget 230",
    "x2-1m-2gpu": f"--tag h200x2_1m_2gpu --mesh 2 --read staged --sections link,attn --contexts 1m {_F48_32} "
                  "--index-writes every_step,full_blocks --share-kv-from none --time-budget 310",
    "x2-512k-1gpu": f"--tag h200x2_512k_1gpu --mesh 1 --sections attn --contexts 512k {_F48} --read staged "
                    "--share-kv-from none --time-budget 210",
    "x2-512k-2gpu": f"--tag h200x2_512k_2gpu --mesh 2 --sections link,attn --contexts 512k {_F48} --read staged "
                    "--share-kv-from none --time-budget 270",
    "x2-shared-1gpu": f"--tag h200x2_shared_1gpu --mesh 1 --read staged --sections link,attn --contexts 1m,128k {_F48_32} "
                      "--share-kv-from 1m --time-budget 140",
    "x2-shared-2gpu": f"--tag h200x2_shared_2gpu --mesh 2 --read staged --sections link,attn --contexts 1m,128k "
                      f"{_F48_32} --share-kv-from 1m --time-budget 160",
})


def parse_ctx(text: str) -> int:
    text = text.lower()
    mult = {"k": 1024, "m": 1 << 20}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "km" else text) * mult)


class Run:
    """Results accumulate in one JSON written after every measurement (a run stopped at its time limit keeps
    what it measured); each section is guarded so one failure does not end the run."""

    def __init__(self, args):
        self.args = args
        self.t0 = time.time()
        self.path = os.path.join(args.out, f"offload_{args.tag}.json")
        self.res = {"machine": harness.machine(), "command": " ".join(sys.argv), "config": vars(args).copy(),
                    "rows": [], "errors": [], "notes": []}
        self.res["config"]["model"] = dataclasses.asdict(args.config)
        if isinstance(getattr(args, "rows", None), list):  # --rows entries by name (their RowFormat is the name's)
            self.res["config"]["rows"] = [{"name": r["name"], "share_kv_from": r["share_kv_from"]} for r in args.rows]

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


# ----------------------------------------------------------------------------------------------
# Synthetic caches


def synthetic_calibration(cfg, seed=0):
    rng = np.random.default_rng(seed)
    shape = (cfg.n_layers, cfg.n_kv_heads)
    scale = np.exp(0.5 * LOGVAR_STD * rng.standard_normal(shape + (cfg.head_dim,))).astype(np.float32)
    eye = np.broadcast_to(np.eye(cfg.head_dim, dtype=np.float32), shape + (cfg.head_dim, cfg.head_dim))
    calib = calibrate.from_arrays(variance=scale**2, mean=np.zeros_like(scale), basis=eye, eigenvalues=scale**2,
                                  ds_order=np.argsort(-scale, axis=-1), loki_basis=eye)
    return calib, scale


SINGLE_TOPK = TopkConfig(bucket_splits=1, token_splits=1)  # one program per row per selection (before 2026-12-01)


def topk_config(name: str) -> TopkConfig | None:
    """A ``--topk`` entry's configuration: ``auto`` (None: the kernels' defaults), ``single`` or ``bBtT``
    (``TopkConfig(bucket_splits=B, token_splits=T)``, B = auto or a power of two)."""
    if name == "auto":
        return None
    if name == "single":
        return SINGLE_TOPK
    split = re.fullmatch(r"b(auto|\d+)t(\d+)", name)
    if not split:
        raise ValueError(f"--topk entries are auto, single or bBtT (TopkConfig(bucket_splits=B, token_splits=T), "
                         f"B = auto or a power of two), got {name!r}")
    buckets = split.group(1)
    return TopkConfig(bucket_splits=buckets if buckets == "auto" else int(buckets), token_splits=int(split.group(2)))


def topk_name(config: TopkConfig | None) -> str:
    """The ``--topk`` entry of a configuration (:func:`topk_config` inverted)."""
    if config is None:
        return "auto"
    return "single" if config == SINGLE_TOPK else f"b{config.bucket_splits}t{config.token_splits}"


def hook(spec, cfg, calib, k, placement, implementation, variant=None, *, batch=1, context=None, rows=None):
    """The hook of a method spec, bound to a cache of ``batch`` sequences of ``context`` (+ 64) tokens; ``variant``:
    StepConfig fields (``topk`` a ``--topk`` entry), on top of ``--read``'s; ``rows``: the K/V row format (None: the
    model dtype; a ``--rows`` entry's ``format``)."""
    method = methods.parse(spec)
    variant = dict(variant or {})
    variant["topk"] = topk_config(variant.pop("topk", "auto"))
    variant["xla_options"] = dict(variant.get("xla_options", ()))
    attn = decode.SparseAttention(method, k, calibration=calib if method.needs_calibration else None,
                                  placement=placement, implementation=implementation, step=StepConfig(**variant),
                                  rows=rows)
    return attn if context is None else attn.bind(cache_shape(cfg, batch, context))


def cache_shape(cfg, batch: int, context: int) -> CacheShape:
    return CacheShape(layers=cfg.n_layers, batch=batch, kv_heads=cfg.n_kv_heads, capacity=context + 64,
                      head_dim=cfg.head_dim, dtype=jnp.bfloat16)


def _fill_fn(cfg, context, attn, layer, key, scale, cache):
    """One layer's synthetic keys (``scale`` the channels' scales per group) and values, written as a prefill would."""
    b, hkv, d = cache.batch, cfg.n_kv_heads, cfg.head_dim
    k1, k2 = jax.random.split(key)
    keys = jax.random.normal(k1, (b, hkv, context, d), jnp.float32) * scale.reshape(b, hkv, 1, d)
    values = jax.random.normal(k2, (b, hkv, context, d), jnp.bfloat16)
    return None, attn.write_prompt(cache, layer, keys.astype(jnp.bfloat16), values, jnp.full((b,), context, jnp.int32))


def build_cache(attn, cfg, scale, *, context, batch, shared_kv, seed=0):
    """A cache holding ``context`` tokens per sequence, room for 64 more, filled layer by layer (``attn`` bound to
    its shape)."""
    cache = attn.init_cache(cache_shape(cfg, batch, context), shared_kv=shared_kv)
    r, d = batch * cfg.n_kv_heads, cfg.head_dim
    scale_r = jnp.asarray(np.tile(scale, (1, batch, 1)).reshape(cfg.n_layers, r, d))
    fill = attn.program(_fill_fn, cache, static=(cfg, context))  # donated; in host memory written in place
    key = jax.random.key(seed)
    for layer in range(cfg.n_layers):
        _, cache = fill(jnp.int32(layer), jax.random.fold_in(key, layer), scale_r[layer], cache=cache)
    cache = attn.start_decode(cache, jnp.full((batch,), context, jnp.int32))
    return jax.block_until_ready(cache)


def step_bytes(attn, cfg, calib, q, *, context, k):
    """Bytes a step reads: the planned planes + scales of every layer and the selected rows, and of those what crosses
    the link (with resident planes: only the planes below each layer's resident count stay in HBM, with the scales).
    A selected row is what the hook's row layout stores per token (K and V: ``2 Dh`` bf16 values, or a compressed
    format's words with their scales)."""
    method = attn.method
    row_bytes = RowLayout.of(attn.rows, cfg.head_dim, jnp.bfloat16).row_bytes
    resident = attn.placement.resident(cfg.n_layers)
    bits, link_bits = [], []
    for layer in range(cfg.n_layers):
        c = attn.corpus_calibration(layer, q.shape[1])
        read = method.read(q[layer], None, c) if method.name != "fathom_klt" else None
        bits.append(np.asarray(read.bits))
        depths = np.asarray(getattr(read, "depths", np.zeros((1, 1))))
        if resident[layer]:  # planes below the resident count and every scale are read in HBM
            link_bits.append(np.maximum(depths - resident[layer], 0).sum(-1).astype(np.float64))
        else:
            link_bits.append(np.asarray(read.bits, np.float64))
    bits = np.stack(bits)  # [L, R]
    r = q.shape[1]
    g = q.shape[2]
    if method.name == "dense":  # reads every K and V row, selects nothing
        kv = float(cfg.n_layers * r * context * row_bytes)
        return {"bits_per_token": float(bits.mean()) * 2, "scan_bytes": kv, "link_scan_bytes": kv, "row_bytes_max": 0.0}
    scan = float(bits.sum() * context / 8)
    link = float(np.sum([b.sum() for b in link_bits]) * context / 8)
    rows = float(cfg.n_layers * r * min(g * k, context) * row_bytes)  # union upper bound
    return {"bits_per_token": float(bits.mean()), "scan_bytes": scan, "link_scan_bytes": link, "row_bytes_max": rows}


# ----------------------------------------------------------------------------------------------
# Sections


def link_section(run: Run):
    mesh = run.args.placement.mesh  # this process's devices of the mesh (each host measures its own links)
    devices = jax.local_devices()[:1] if mesh is None else [d for d in mesh.devices.flat
                                                            if d.process_index == jax.process_index()]
    run.res["link"] = harness.host_to_device_rate(run.args.link_bytes, devices=devices)
    run.res["hbm_copy"] = harness.hbm_copy_rate()
    print("link", run.res["link"], "hbm", run.res["hbm_copy"]["GBps"], flush=True)
    run.save()


def random_step_inputs(cfg, batch, seed=1):
    rng = np.random.default_rng(seed)
    r = batch * cfg.n_kv_heads
    q = jnp.asarray(rng.standard_normal((cfg.n_layers, r, cfg.group_size, cfg.head_dim)), jnp.float32)
    key = jnp.asarray(rng.standard_normal((cfg.n_layers, r, cfg.head_dim)), jnp.bfloat16)
    value = jnp.asarray(rng.standard_normal((cfg.n_layers, r, cfg.head_dim)), jnp.bfloat16)
    return q, key, value


def drifting_queries(q, rho: float, count: int = 64, seed: int = 2) -> list:
    """``count`` query sets, each ``rho`` times the one before plus ``sqrt(1 - rho^2)`` fresh noise (an AR(1) drift,
    stationary: every set has ``q``'s distribution). Real decode steps reselect most rows of the step before; one
    repeated set would let a row cache hit every row. rho = 0.95 leaves ~37% of a group's rows new to each step
    (numpy, 128k tokens, k = 512: results/logs/query_drift_numpy_2026-12-01.txt), as SmolLM2 measured on real text
    (results/row_reuse_smollm2_4k.md)."""
    rng = np.random.default_rng(seed)
    out, cur = [], np.asarray(q, np.float32)
    for _ in range(count):
        cur = rho * cur + np.sqrt(1 - rho * rho) * rng.standard_normal(cur.shape).astype(np.float32)
        out.append(jnp.asarray(cur))
    return out


def without_row_cache(cache):
    return dataclasses.replace(cache, row_cache=None)


def with_row_cache(cache, attn):
    """``cache`` with an empty row cache of ``attn``'s slots, or none (every row starts from the same shared cache,
    built for the first hook's layout)."""
    slots = attn.step.row_cache
    row_cache = None
    if slots:
        row_cache = decode.empty_row_cache(jnp.zeros, n_layers=cache.n_layers,
                                           groups=cache.groups, slots=slots, width=cache.layout.width,
                                           dtype=cache.layout.storage_dtype)
    return dataclasses.replace(cache, row_cache=row_cache)


def row_cache_fields(cache, link_gbps: float, scan_bytes: float) -> dict:
    """A step's row-cache counts from the cache it left (its last step): the fraction of rows taken from the slots,
    the row bytes fetched and the link floor with only those rows."""
    rc = cache.row_cache
    if rc is None:
        return {}
    hits, fetched = int(distributed.to_host(rc.hits).sum()), int(distributed.to_host(rc.fetched).sum())
    row_bytes = fetched * cache.layout.row_bytes  # each row: its K and V
    return {"row_hit_fraction": hits / max(1, hits + fetched), "row_bytes_fetched": float(row_bytes),
            "link_floor_fetched_ms": (scan_bytes + row_bytes) / (link_gbps * 1e9) * 1e3}


def host_fields(cache, placement) -> dict:
    """A cache's bytes per token, layer and KV head (over ``layers x batch x KV heads x capacity``) from its own arrays:
    ``host_bytes_per_token`` as held in host memory (with ``shared_kv`` the one row buffer counted once, so less than
    a cache of every layer's own rows would take), ``host_bytes_per_token_own`` with every layer's own rows (the
    layout's ``row_bytes`` plus the index's host bytes per token), ``index_bytes_per_token`` (planes and scales
    wherever they live), and ``row_bytes_per_token`` (what the row fetch moves per selected token). In device memory
    (the HBM control) nothing is on the host: the host figures are None."""
    held = cache.nbytes()
    tokens = cache.n_layers * cache.groups * cache.capacity
    index_host = sum(v for name, v in held.items() if name != "kv" and not name.endswith("_hbm"))
    index_all = sum(v for name, v in held.items() if name != "kv")
    out = {"row_bytes_per_token": cache.layout.row_bytes, "index_bytes_per_token": index_all / tokens,
           "host_bytes_per_token": None, "host_bytes_per_token_own": None}
    if placement.offloaded:
        out["host_bytes_per_token"] = (held["kv"] + index_host) / tokens
        out["host_bytes_per_token_own"] = cache.layout.row_bytes + index_host / tokens
    return out


def parse_rows(text: str, share_kv_from: int | None) -> list[dict]:
    """``--rows`` entries, one set of rows each: ``FORMAT`` or ``FORMAT@SHARE`` (FORMAT: ``model`` for rows in the
    model dtype, or a row format with per-token scales such as ``k8v8``, :func:`fathom_jax.decode.rows.row_format`;
    SHARE: this format's ``--share-kv-from``, a context or ``none``). Each: ``name`` (``model`` or the format's spec),
    ``format`` (None or the RowFormat), ``share_kv_from`` (None: every layer its own rows)."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        spec, at, share = entry.partition("@")
        fmt = row_format(spec)  # ValueError on an unknown spec or a format with per-block scales
        share_from = share_kv_from
        if at:
            share_from = None if share.strip().lower() in ("", "none") else parse_ctx(share.strip())
        out.append({"name": "model" if fmt is None else fmt.spec, "format": fmt, "share_kv_from": share_from})
    if not out:
        raise ValueError("no row format given")
    names = [r["name"] for r in out]
    if len(set(names)) != len(names):
        raise ValueError(f"a row format is given twice: {names}")
    return out


def default_rows(args) -> dict:
    """The ``--rows`` entry of the model dtype with the run's ``--share-kv-from`` (sections that take no ``--rows``)."""
    return {"name": "model", "format": None, "share_kv_from": args.share_kv_from}


def rows_tag(rows: dict) -> str:
    """A section name's suffix naming a row format (none for the model dtype)."""
    return "" if rows["name"] == "model" else f" rows {rows['name']}"


def link_rate(run) -> float:
    link = run.res.get("link", {})
    if "all" in link:
        return link["all"]["GBps"]
    rates = [v["GBps"] for v in link.values()]
    return float(np.mean(rates)) if rates else float("nan")


# (rows of runs before an option existed ran these; before 2026-12-01 every layer's writes came after the scan; the
# GPU streams and writes after the scan are measured options since deleted, kept for their rows)
SPLIT_DEFAULTS = {"streams": 1, "index_writes": "every_step", "pipeline": 1, "gather_programs": 0, "scan_writes": False,
                  "fetch_programs": 0, "topk": "single", "xla_options": "", "layer_unroll": 1, "row_cache": 0,
                  "resident_planes": 0, "rows": "model"}


def options_text(options) -> str:
    return ",".join(f"{k}={v}" for k, v in dict(options).items())


def split_fields(attn) -> dict:
    """The options a row varies (the columns of the report), as the bound hook's resolved step runs them."""
    run = attn.run
    return {"streams": 1, "index_writes": run.index_writes, "pipeline": run.chunks,
            "gather_programs": getattr(run.reader, "programs", 0), "fetch_programs": run.fetcher.programs,
            "layer_unroll": run.layer_unroll, "row_cache": run.row_cache, "scan_writes": run.in_place,
            "topk": topk_name(run.topk), "xla_options": options_text(attn.step.xla_options),
            "read": attn.step.read, "rows": "model" if attn.rows is None else attn.rows.spec}


def variant_tag(split: dict) -> str:
    return (f"s{split['streams']}_{split['index_writes']}_p{split['pipeline']}_g{split['gather_programs']}"
            f"_f{split.get('fetch_programs', 0)}_{split.get('topk', 'single')}" + ("_w" if split.get("scan_writes") else "")
            + ("_x" if split.get("xla_options") else "") + (f"_u{split['layer_unroll']}" if split.get("layer_unroll", 1) > 1 else "")
            + (f"_c{split['row_cache']}" if split.get("row_cache") else "")
            + (f"_r{split['rows']}" if split.get("rows", "model") != "model" else ""))


def writes_text(r: dict) -> str:
    """A row's index writes, and ``in scan`` where each layer wrote inside the layer scan."""
    return r.get("index_writes", "every_step") + (" in scan" if r.get("scan_writes") else "")


def split_text(r: dict) -> str:
    """How a row's layer was split: ``""`` (one chunk), ``streams 2``, ``pipeline 8 (gather 132)``, and the kernels'
    options that differ from the earlier runs' (``fetch 66``: persistent row-fetch programs; ``top-k split``: each
    row's selections over several programs; ``xla: ...``: extra XLA options)."""
    if r.get("streams", 1) > 1:
        text = f"streams {r['streams']}"
    elif r.get("pipeline", 1) > 1:
        programs = r.get("gather_programs", 0)
        text = f"pipeline {r['pipeline']}" + (f" (gather {programs})" if programs else "")
    else:
        text = f"gather {r['gather_programs']}" if r.get("gather_programs") else ""
    extra = ([f"rows {r['rows']}"] if r.get("rows", "model") != "model" else []) + \
            ([f"resident planes {r['resident_planes']}"] if r.get("resident_planes") else []) + \
            ([f"fetch {r['fetch_programs']}"] if r.get("fetch_programs") else []) + \
            (["top-k split"] if r.get("topk", "single") != "single" else []) + \
            ([f"{r['layer_unroll']} layers per loop iteration"] if r.get("layer_unroll", 1) > 1 else []) + \
            ([f"row cache {r['row_cache']} slots"] if r.get("row_cache") else []) + \
            ([f"xla: {r['xla_options']}"] if r.get("xla_options") else [])
    return "; ".join([text] * bool(text) + extra)


def parse_variants(read: str, index_writes: str, pipeline: str, fetch: str = "auto", topk: str = "auto",
                   xla: str = "none", unroll: str = "1", row_cache: str = "0") -> list[dict]:
    """Every combination of the step configurations the lists give (one row each): ``--index-writes``,
    ``--pipeline`` (entries ``auto``, ``N`` or ``N/P``: N chunks, P persistent gather programs, "auto" where not
    given), ``--fetch-programs``, ``--topk``, ``--xla-options``, ``--layer-unroll``, ``--row-cache``; ``--read`` for
    all. Each is a set of :class:`fathom_jax.decode.StepConfig` fields, checked here."""
    pipes = []
    for item in pipeline.split(","):
        n, _, programs = item.partition("/")
        pipes.append((n if n == "auto" else int(n), "auto" if programs in ("", "auto") else int(programs)))
    out = [dict(read=read, index_writes=w, pipeline=n, gather_programs=g) for w in index_writes.split(",")
           for n, g in pipes]
    fetches = [x if x == "auto" else int(x) for x in fetch.split(",")]
    for name in topk.split(","):
        topk_config(name)  # a bad entry fails here, before anything runs
    option_sets = []
    for item in xla.split(";"):  # "none" or name=value,name=value (a value may hold commas: a list of enums)
        pairs = {} if item in ("", "none") else dict(kv.split("=", 1) for kv in re.split(r",(?=xla_)", item))
        option_sets.append(tuple((k, {"true": True, "false": False}.get(v.lower(), v)) for k, v in pairs.items()))
    unrolls = [int(u) for u in unroll.split(",")]
    if any(u < 1 for u in unrolls):
        raise ValueError(f"--layer-unroll entries are ints >= 1, got {unroll!r}")
    slots = [int(c) for c in row_cache.split(",")]
    if any(c < 0 for c in slots):
        raise ValueError(f"--row-cache entries are ints >= 0 (0: no row cache), got {row_cache!r}")
    out = [v | {"fetch_programs": f, "topk": t, "xla_options": x, "layer_unroll": u, "row_cache": c} for f in fetches
           for t in topk.split(",") for x in option_sets for u in unrolls for c in slots for v in out]
    for v in out:  # a bad entry fails here, before anything runs
        StepConfig(**(v | {"topk": topk_config(v["topk"]), "xla_options": dict(v["xla_options"])}))
    return list({tuple(v.items()): v for v in out}.values())


def attention_rows(run: Run, cfg, calib, scale, context, labels, *, batch=1, placement=None, tag="", rows=None):
    """Attention-only steps of several methods over one synthetic cache (all plane methods share it); ``rows``: a
    ``--rows`` entry (the K/V row format and its ``--share-kv-from``; default the model dtype)."""
    args = run.args
    placement = placement or args.placement
    rows = rows or default_rows(args)
    shared = rows["share_kv_from"] is not None and batch * context >= rows["share_kv_from"]
    first = hook(METHODS[labels[0]], cfg, calib, args.k, placement, args.implementation, batch=batch, context=context,
                 rows=rows["format"])
    t = time.time()
    cache = build_cache(first, cfg, scale, context=context, batch=batch, shared_kv=shared)
    fill_s = time.time() - t
    q, key, value = random_step_inputs(cfg, batch)
    # Every row starts from the same `context` tokens: the small leaves (lengths, raw tails) are put back before
    # each row (a cache sized for 64 more tokens filled up after three rows, and later rows' writes fell outside
    # it: before 2026-11-30 (run o5) rows after the first ~64 steps read a full cache).
    bulk = cache.bulk()
    start = jax.tree.map(jnp.copy, split_bulk(cache, bulk)[0])
    queries = drifting_queries(q, args.query_drift) if args.query_drift is not None else [q]
    variants = args.variants if placement.offloaded else [{}]
    for label, variant in ((m, v) for m in labels for v in variants):
        if run.left() < 30:
            run.res["errors"].append({"section": f"attn {label} {context}", "error": "skipped: time budget spent"})
            break
        attn = hook(METHODS[label], cfg, calib, args.k, placement, args.implementation, variant, batch=batch,
                    context=context, rows=rows["format"])
        split = split_fields(attn)
        cache = with_row_cache(attach_bulk(jax.tree.map(jnp.copy, start), without_row_cache(cache), bulk), attn)
        steps = itertools.count()

        def call(state, attn=attn, steps=steps):
            q_t = queries[next(steps) % len(queries)]
            out, c = decode.attention_step(q_t, key, value, state[1], attn)
            return out, c

        try:
            r, state = harness.timeit_calls(call, (None, cache), n=args.steps, repeats=args.repeats)
        except Exception as e:  # noqa: BLE001
            run.res["errors"].append({"section": f"attn {label} {context}{rows_tag(rows)}",
                                      "error": f"{type(e).__name__}: {e}"[:2000],
                                      "traceback": traceback.format_exc()[-4000:]})
            print(f"[attn {label} {context}] FAILED {e}"[:600], flush=True)
            return None
        cache = state[1]
        profile = None
        if "attnprofile" in args.sections:
            trace = os.path.join(args.out, "traces", f"attn_{context}_{label.split()[0]}_{batch}_{placement.memory}_{variant_tag(split)}")
            try:
                profile, state = harness.profile_breakdown(call, state, trace)
                cache = state[1]
            except Exception as e:  # noqa: BLE001
                run.res["errors"].append({"section": "attnprofile", "error": f"{type(e).__name__}: {e}"[:2000]})
        nbytes = step_bytes(attn, cfg, calib, q, context=context, k=args.k)
        floor_ms = (nbytes["link_scan_bytes"] + nbytes["row_bytes_max"]) / (link_rate(run) * 1e9) * 1e3
        held = cache.nbytes()
        tiers = {"resident_planes": placement.resident_planes,
                 "index_host_bytes": float(sum(n for kind, n in held.items()
                                               if kind != "kv" and not kind.endswith("_hbm"))),
                 "index_hbm_bytes": float(held.get("planes_hbm", 0))}
        if not placement.offloaded:  # the HBM control: no link traffic
            floor_ms = float("nan")
        cached = row_cache_fields(cache, link_rate(run), nbytes["scan_bytes"])
        run.add({"kind": "attention", "method": label, "context": context, "batch": batch, "memory": placement.memory,
                 "mesh": placement.num_shards, **split, **tiers, "shared_kv": shared, "query_drift": args.query_drift,
                 **cached, **host_fields(cache, placement),
                 "fill_s": fill_s,
                 "host_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, **r, **nbytes,
                 "link_floor_ms": floor_ms, "fraction_of_link": floor_ms / r["median_ms"],
                 "tokens_per_s": batch / (r["median_ms"] * 1e-3),
                 "authors_ms": AUTHORS_MS.get(context, {}).get(label) if batch == 1 and placement.num_shards == 1 else None,
                 "tag": tag, **({"profile": profile} if profile else {})})
    return cache


def random_model(cfg, placement):
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)

    @jax.jit
    def init(key):
        leaves, tree = jax.tree_util.tree_flatten_with_path(state)
        out = []
        for i, (path, leaf) in enumerate(leaves):
            name = jax.tree_util.keystr(path)
            if "norm" in name:
                out.append(jnp.ones(leaf.shape, leaf.dtype))
            else:
                out.append((0.02 * jax.random.normal(jax.random.fold_in(key, i), leaf.shape, jnp.float32)).astype(leaf.dtype))
        return jax.tree_util.tree_unflatten(tree, out)

    params = placement.replicate(init(jax.random.key(0)))
    return nnx.merge(graphdef, params)


def full_rows(run: Run, model, cfg, calib, scale, context, labels, *, batch=1, profile=False, placement=None,
              rows=None):
    """Full decode steps of several methods over one synthetic cache; ``rows`` as :func:`attention_rows`."""
    args = run.args
    placement = placement or args.placement
    rows = rows or default_rows(args)
    shared = rows["share_kv_from"] is not None and batch * context >= rows["share_kv_from"]
    first = hook(METHODS[labels[0]], cfg, calib, args.k, placement, args.implementation, batch=batch, context=context,
                 rows=rows["format"])
    cache = build_cache(first, cfg, scale, context=context, batch=batch, shared_kv=shared)
    bulk = cache.bulk()
    start = jax.tree.map(jnp.copy, split_bulk(cache, bulk)[0])  # every row from `context` tokens (see attention_rows)
    tokens = jnp.zeros((batch,), jnp.int32)
    for label, variant in ((m, v) for m in labels for v in args.variants):
        attn = hook(METHODS[label], cfg, calib, args.k, placement, args.implementation, variant, batch=batch,
                    context=context, rows=rows["format"])
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
            trace = os.path.join(args.out, "traces", f"full_{context}_{label.split()[0]}_{batch}_{variant_tag(split)}")
            try:
                bd, state = harness.profile_breakdown(call, state, trace)
                cache = state[1]
                row["profile"] = bd
                row["wall_over_device"] = bd["wall_ms_per_step"] / bd["device_span_ms_per_step"]
            except Exception as e:  # noqa: BLE001
                run.res["errors"].append({"section": "profile", "error": f"{type(e).__name__}: {e}"[:2000]})
        run.add(row)
    return cache


def prefill_section(run: Run, model, cfg, calib, context):
    args = run.args
    attn = hook("fathom:48", cfg, calib, args.k, args.placement, args.implementation, {"read": args.read})
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
    r = cfg.n_kv_heads
    keys = jax.random.normal(jax.random.key(1), (r, context, cfg.head_dim), jnp.float32)
    from fathom_jax.index import build_index

    build = jax.jit(lambda k: build_index(k, None, attn.method.parts, capacity=context + 64))
    jax.block_until_ready(build(keys))
    t = time.time()
    for _ in range(3):
        jax.block_until_ready(build(keys))
    index_s = (time.time() - t) / 3 * cfg.n_layers
    run.add({"kind": "prefill", "context": context, "first_s": times[0], "prefill_s": times[1],
             "index_build_s": index_s, "index_share": index_s / times[1], "memory": args.placement.memory})


def merge(paths, out_prefix):
    """One results file from several runs of this script (device calls are limited to 10 minutes each)."""
    import json

    parts = [json.load(open(p)) for p in paths]
    res = dict(parts[0])
    res["runs"] = [run for p in parts for run in (p.get("runs") or [{"command": p["command"], "machine": p["machine"],
                                                                   "wall_seconds": p.get("wall_seconds")}])]
    for p in parts:  # each run's read mode and mesh travel with its rows
        for row in p.get("rows", []):
            prof = row.get("profile", {}).get("ms_per_step", {})
            if "scan (reads host planes)" in prof:  # the category's first name; staged runs' scan reads HBM
                prof["plane scan kernel"] = prof.pop("scan (reads host planes)")
            row.setdefault("read", p["config"].get("read"))
            row.setdefault("run_date", p["machine"]["date"])
    for p in parts:  # an error names the run it came from (a later run may have measured that section)
        for err in p.get("errors", []):
            err.setdefault("run_date", p["machine"]["date"])
    res["errors"] = [x for p in parts for x in p.get("errors", [])]
    res["notes"] = list(dict.fromkeys(x for p in parts for x in p.get("notes", [])))  # in order, once each
    # A later run of the same measurement (same kind, method, shapes, placement) supersedes an earlier one.
    latest: dict[tuple, dict] = {}
    for row in (x for p in parts for x in p.get("rows", [])):
        for name, value in SPLIT_DEFAULTS.items():  # runs before an option existed ran its default
            row.setdefault(name, value)
        if row["kind"] == "full":  # full steps before 2026-12-01 copied each layer's weights out of the stacks
            row.setdefault("weight_gemms", "copied")
        key = tuple(str(row.get(f)) for f in ("kind", "method", "context", "batch", "memory", "read", "mesh",
                                              *SPLIT_DEFAULTS, "shared_kv", "tag", "weight_gemms"))
        if key not in latest or row["run_date"] >= latest[key]["run_date"]:
            older = latest.get(key)
            if older is not None and "profile" in older and "profile" not in row:  # the newest profile stays, dated
                row = row | {"profile": older["profile"], "profile_run_date": older.get("profile_run_date",
                                                                                         older["run_date"])}
            latest[key] = row
    superseded = sum(len(p.get("rows", [])) for p in parts) - len(latest)
    res["rows"] = list(latest.values())
    tail = " rows of earlier runs superseded by later runs of the same measurement"
    earlier = [note for note in res["notes"] if note.endswith(tail) and note.split(" ", 1)[0].isdigit()]
    superseded += sum(int(note.split(" ", 1)[0]) for note in earlier)  # a merged file merged again: one count
    res["notes"] = [note for note in res["notes"] if note not in earlier]
    if superseded:
        res["notes"].append(f"{superseded}{tail}")
    for key in ("link", "hbm_copy"):
        res[key] = next((p[key] for p in parts if key in p), None) or {}
    res["links"] = [link for p in parts for link in (p.get("links") or ([{"command": p["command"], "link": p["link"]}]
                                                                       if p.get("link") else []))]
    res["command"] = "; ".join(p["command"] for p in parts)
    latest_link = max((p for p in parts if p.get("link")), key=lambda p: p["machine"]["date"], default=None)
    if latest_link is not None:  # floors of the newest rows use the newest link measurement
        res["link"] = latest_link["link"]
    res["machine"] = max((p["machine"] for p in parts), key=lambda m: m["date"])  # the header names the newest run
    link = res["link"].get("all", next(iter(res["link"].values()), {})).get("GBps")
    for row in res["rows"]:  # the link floor of rows measured in a run without the link section
        floor = row.get("link_floor_ms", float("nan"))
        if row["kind"] == "attention" and row["memory"] == "pinned_host" and link and math.isnan(floor):
            row["link_floor_ms"] = (row.get("link_scan_bytes", row["scan_bytes"]) + row["row_bytes_max"]) / (link * 1e9) * 1e3
            row["fraction_of_link"] = row["link_floor_ms"] / row["median_ms"]
    harness.write_json(out_prefix + ".json", res)
    write_report(res, out_prefix)


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--merge":  # --merge OUT_PREFIX IN.json ...
        return merge(sys.argv[3:], sys.argv[2])
    argv = harness.expand_preset(sys.argv[1:] if argv is None else argv, PRESETS)
    distributed.initialize()  # one process per host, from the environment (fathom_jax.distributed); else a no-op
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results")
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--contexts", default="32k,128k,512k,1m")
    ap.add_argument("--attn-contexts", default=None, help="contexts of the attention-only section (default --contexts)")
    ap.add_argument("--full-contexts", default=None, help="contexts of the full-step section (default: the largest and 128k)")
    ap.add_argument("--sections", default="link,attn,full,profile,batch,control,dense,prefill")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--batches", default="4,8", help="batch sizes of the batch section")
    ap.add_argument("--mesh", type=int, default=1, help="GPUs in the mesh (the group axis is split over them; "
                                                        "across processes, of every process)")
    ap.add_argument("--share-kv-from", default="512k", help="contexts from this size share one K/V row buffer")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--read", default="staged", choices=["direct", "staged"])
    ap.add_argument("--index-writes", default="every_step",
                    help="every_step and/or full_blocks (a list: one row each): when steps write the newest plane block")
    ap.add_argument("--pipeline", default="auto",
                    help="chunks per layer with chained plane transfers: auto, N or N/P with P persistent gather "
                         "programs (a list: one row each; 1/0 = one chunk, one program per copied chunk of a run)")
    ap.add_argument("--fetch-programs", default="auto",
                    help="persistent programs of the row fetch: auto or N, 0 = one program per 32 rows (a list)")
    ap.add_argument("--topk", default="auto", help="auto (the kernels' defaults), single (one program per row per "
                                                   "selection, the top-k before 2026-12-01) and/or bBtT (B programs per "
                                                   "row of the bucket selection, T of the token selection) (a list)")
    ap.add_argument("--xla-options", default="none",
                    help="extra XLA options of the step programs: none or name=value,... (a ';'-separated list)")
    ap.add_argument("--layer-unroll", default="1",
                    help="layers per iteration of the step's layer scan (a list: one row each)")
    ap.add_argument("--row-cache", default="0",
                    help="device-memory row-cache slots per layer and group (StepConfig.row_cache; a list: one row "
                         "each; 0: none)")
    ap.add_argument("--resident-planes", default="0",
                    help="planes of every channel kept in HBM (Placement.resident_planes), a ','-separated list: one set "
                         "of rows each (sections attn, attnbatch, batch), over a cache of its own (0: the whole index in "
                         "host memory; 4: the whole index in HBM)")
    ap.add_argument("--rows", default="model",
                    help="K/V row formats, a ','-separated list: one set of rows each (sections attn, attnbatch, full, "
                         "batch), over a cache of its own. Each FORMAT or FORMAT@SHARE: model (the model dtype, bf16) or "
                         "a format with per-token scales (k8v8, k8v4g32a, ...: fathom_jax.decode.rows); SHARE overrides "
                         "--share-kv-from for that format (a context or none)")
    ap.add_argument("--query-drift", type=float, default=None,
                    help="attention-only rows: each step's queries drift from the last by AR(1) with this coefficient "
                         "(0.95: ~37%% new rows per step); default: one query set repeated")
    ap.add_argument("--link-bytes", type=int, default=2 << 30)
    ap.add_argument("--time-budget", type=float, default=540.0, help="seconds; sections past it are skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the whole script)")
    ap.add_argument("--implementation", default="pallas", choices=["pallas", "xla"],
                    help="the kernels: pallas (what the benchmark measures; interpreted on a CPU) or xla (a quick CPU "
                         "check of the script; device memory only)")
    args = ap.parse_args(argv)
    args.config = SMOKE if args.smoke else QWEN3_8B
    args.contexts = [parse_ctx(c) for c in args.contexts.split(",")]
    args.attn_contexts = [parse_ctx(c) for c in args.attn_contexts.split(",")] if args.attn_contexts else args.contexts
    if args.full_contexts:
        args.full_contexts = [parse_ctx(c) for c in args.full_contexts.split(",")]
    else:
        args.full_contexts = sorted({max(args.contexts)} | ({131072} & set(args.contexts)), reverse=True)
    args.share_kv_from = None if args.share_kv_from in ("", "none") else parse_ctx(args.share_kv_from)
    args.sections = args.sections.split(",")
    try:
        args.variants = parse_variants(args.read, args.index_writes, args.pipeline, args.fetch_programs, args.topk,
                                       args.xla_options, args.layer_unroll, args.row_cache)
    except (ValueError, TypeError) as e:
        ap.error(f"--index-writes / --pipeline / --fetch-programs / --topk / --xla-options / --layer-unroll / "
                 f"--row-cache: {e}")
    try:
        args.resident_planes = [int(p) for p in args.resident_planes.split(",")]
        for p in args.resident_planes:
            Placement("pinned_host", resident_planes=p)
    except ValueError as e:
        ap.error(f"--resident-planes: {e}")
    try:
        args.rows = parse_rows(args.rows, args.share_kv_from)
        for entry in args.rows:  # the format against the model's head_dim
            RowLayout.of(entry["format"], args.config.head_dim, jnp.bfloat16)
    except ValueError as e:
        ap.error(f"--rows: {e}")
    if args.query_drift is not None and not 0 <= args.query_drift < 1:
        ap.error(f"--query-drift must be in [0, 1), got {args.query_drift}")
    labels = [m for m in args.methods.split(",") if m]
    unknown = [m for m in labels if m not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    try:
        mesh = device_mesh(args.mesh)
    except ValueError as e:
        ap.error(f"--mesh {args.mesh}: {e}")
    args.placement = Placement("pinned_host", mesh=mesh)
    if args.placement.note:
        print("note:", args.placement.note, flush=True)
    os.makedirs(args.out, exist_ok=True)
    run = Run(args)
    run.res["notes"].append(args.placement.note or f"bulk cache arrays in {args.placement.memory_kind} memory")
    cfg = args.config
    calib, scale = synthetic_calibration(cfg)
    # Sections run in the order given, so a run cut short by its time budget keeps the ones that matter most.
    model = None
    for section in args.sections:
        if section == "link":
            run.guard("link", link_section, run)
        elif section == "attn":
            for ctx in sorted(args.attn_contexts, reverse=True):
                for p in args.resident_planes:
                    placement = dataclasses.replace(args.placement, resident_planes=p)
                    for rows in args.rows:
                        run.guard(f"attn {ctx} p{p}{rows_tag(rows)}", attention_rows, run, cfg, calib, scale, ctx,
                                  labels, placement=placement, rows=rows)
        elif section in ("full", "batch", "prefill") and model is None:
            model = run.guard("model", random_model, cfg, args.placement)
        if section == "full" and model is not None:
            for ctx in args.full_contexts:
                for p in args.resident_planes:
                    placement = dataclasses.replace(args.placement, resident_planes=p)
                    for rows in args.rows:
                        run.guard(f"full {ctx} p{p}{rows_tag(rows)}", full_rows, run, model, cfg, calib, scale, ctx,
                                  labels, profile="profile" in args.sections and ctx == max(args.full_contexts),
                                  placement=placement, rows=rows)
        elif section == "batch" and model is not None:
            ctx = 131072 if 131072 in args.contexts else min(args.contexts)
            for b in (int(x) for x in args.batches.split(",")):
                for p in args.resident_planes:
                    placement = dataclasses.replace(args.placement, resident_planes=p)
                    for rows in args.rows:
                        run.guard(f"batch {b} p{p}{rows_tag(rows)}", full_rows, run, model, cfg, calib, scale, ctx,
                                  labels[:1], batch=b, profile="profile" in args.sections and b == 8,
                                  placement=placement, rows=rows)
        elif section == "attnbatch":  # attention-only rows of larger batches (the row cache's and tiers' comparison)
            ctx = 131072 if 131072 in args.contexts else min(args.contexts)
            for b in (int(x) for x in args.batches.split(",")):
                for p in args.resident_planes:
                    placement = dataclasses.replace(args.placement, resident_planes=p)
                    for rows in args.rows:
                        run.guard(f"attn batch {b} p{p}{rows_tag(rows)}", attention_rows, run, cfg, calib, scale, ctx,
                                  labels[:1], batch=b, placement=placement, rows=rows)
        elif section == "control":
            ctx = 131072 if 131072 in args.contexts else min(args.contexts)
            run.guard("control", attention_rows, run, cfg, calib, scale, ctx, labels[:1],
                      placement=Placement("device", mesh=mesh), tag="index and K/V in HBM")
        elif section == "dense":
            METHODS.setdefault("dense", "dense")
            for ctx in [c for c in sorted(args.contexts) if c <= 131072]:
                run.guard(f"dense {ctx}", attention_rows, run, cfg, calib, scale, ctx, ["dense"], tag="dense offload")
        elif section == "prefill" and model is not None:
            ctx = 131072 if 131072 in args.contexts else max(args.contexts)
            run.guard("prefill", prefill_section, run, model, cfg, calib, ctx)
    run.save()
    print(f"done in {time.time() - run.t0:.0f} s; {len(run.res['errors'])} errors", flush=True)


# ----------------------------------------------------------------------------------------------
# Report


def mesh_ratio_lines(att: list[dict], default_read) -> list[str]:
    """Each step measured on one GPU and on a mesh of several with the same method, shapes and reads, side by side."""
    def key(r):  # chunk counts differ with the groups per device: pipelined pairs with pipelined
        return (r["method"], r["context"], r["batch"], r["memory"], r.get("read", default_read), r["shared_kv"],
                r.get("index_writes", "every_step"), r.get("streams", 1), int(r.get("pipeline", 1)) > 1,
                bool(r.get("scan_writes")), r.get("rows", "model"))

    single = {key(r): r for r in att if r["mesh"] == 1}
    pairs = [(single[key(r)], r) for r in att if r["mesh"] > 1 and key(r) in single]
    if not pairs:
        return []
    lines = ["## Several GPUs against one (same method, context, reads, K/V sharing, index writes and pipelining)", "",
             "| method | context | read | shared K/V | index writes | chunks (1 GPU / mesh) | 1 GPU ms | mesh | mesh ms | ratio | "
             "mesh floor ms | x floor | runs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for one, many in sorted(pairs, key=lambda p: (p[1]["context"], p[1]["method"], str(p[1]["shared_kv"]), key(p[1])[6:])):
        lines.append(f"| {many['method']} | {many['context']} | {key(many)[4]} | {many['shared_kv']} | {writes_text(many)} | "
                     f"{one.get('pipeline', 1)} / {many.get('pipeline', 1)} | {one['median_ms']:.1f} | "
                     f"{many['mesh']} | {many['median_ms']:.1f} | {many['median_ms'] / one['median_ms']:.2f} | "
                     f"{many['link_floor_ms']:.1f} | {many['median_ms'] / many['link_floor_ms']:.2f} | "
                     f"{str(one.get('run_date', ''))[:16]} / {str(many.get('run_date', ''))[:16]} |")
    return lines + [""]


def row_format_lines(rows: list[dict]) -> list[str]:
    """The row-format table: every row of a compressed format beside the rows of the model dtype (bf16) with the same
    step, method, context and batch, with their bytes per token on the host, row bytes per step, ms and tokens/s."""
    def key(r):
        return (r["kind"], r["method"], r["context"], r["batch"])

    compressed = [r for r in rows if r.get("rows", "model") != "model"]
    if not compressed:
        return []
    keys = {key(r) for r in compressed}
    picked = [r for r in rows if key(r) in keys]
    lines = ["## K/V row formats", "",
             "`rows`: how the cache stores each token's K and V (`model`: bf16 K and V side by side; `k8v8`: 8-bit K and V, "
             "one fp16 absmax scale per token each; `fathom_jax.decode.rows`). Host B/token: bytes per token, layer and KV "
             "head in host memory as held (`shared K/V`: one row buffer for every layer, counted once) and with every "
             "layer's own rows (the row plus the index's planes and scales); row B: what the row fetch moves per selected "
             "token; rows MB: the selected rows of a step (max, the union's upper bound).", "",
             "| step | method | context | batch | rows | shared K/V | host B/token (held) | host B/token (own rows) | "
             "row B | rows MB (max) | ms | tokens/s | vs model rows | run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, spec=".0f": "" if x is None or x != x else format(x, spec)  # noqa: E731  (None and NaN: blank)
    base = {}
    for r in rows:  # the fastest model-dtype row of each step: the comparison
        if r.get("rows", "model") == "model" and (key(r) not in base or r["median_ms"] < base[key(r)]["median_ms"]):
            base[key(r)] = r
    for r in sorted(picked, key=lambda r: key(r) + (r.get("rows", "model") != "model", r.get("rows", "model"),
                                                     str(r.get("run_date", "")))):
        b = base.get(key(r))
        ratio = f"{b['median_ms'] / r['median_ms']:.2f}x" if b is not None and b is not r else ""
        lines.append(f"| {r['kind']} | {r['method']} | {r['context']} | {r['batch']} | {r.get('rows', 'model')} | "
                     f"{r['shared_kv']} | {fmt(r.get('host_bytes_per_token'))} | {fmt(r.get('host_bytes_per_token_own'))} | "
                     f"{fmt(r.get('row_bytes_per_token'))} | {fmt(r.get('row_bytes_max', float('nan')) / 1e6)} | "
                     f"{r['median_ms']:.2f} [{r['min_ms']:.2f}, {r['max_ms']:.2f}] | "
                     f"{fmt(r.get('tokens_per_s', r['batch'] / r['median_ms'] * 1e3), '.1f')} | {ratio} | "
                     f"{str(r.get('run_date', ''))[:16]} |")
    return lines + [""]


def row_cache_lines(rows: list[dict]) -> list[str]:
    """Rows with drifting queries or a row cache, each beside the row of the same step without a cache."""
    picked = [r for r in rows if r.get("row_cache") or r.get("query_drift") is not None]
    if not picked:
        return []

    def key(r):
        return (r["kind"], r["method"], r["context"], r["batch"], r.get("query_drift"), r.get("pipeline", 1),
                r.get("index_writes"), r.get("rows", "model"), str(r.get("run_date", "")))

    plain = {key(r): r for r in rows if not r.get("row_cache")}
    lines = ["## Row cache (device-memory copies of the rows recent steps fetched)", "",
             "`drift`: each step's queries are the last step's times the coefficient plus fresh noise (AR(1); none: one "
             "query set repeated, which a row cache would hit every time; full steps: the random model's own queries). "
             "`from slots`: of the last step's selected rows, the share taken from the slots. Floors: every planned byte "
             "and every selected row over the link, and with only the rows fetched.", "",
             "| step | method | context | batch | drift | slots | from slots | rows MB fetched | ms | floor ms (all rows) | "
             "floor ms (rows fetched) | ms / floor (fetched) | vs no cache |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x, spec=".1f": "" if x is None or x != x else format(x, spec)  # noqa: E731  (None and NaN: blank)
    for r in sorted(picked, key=lambda r: key(r) + (r.get("row_cache", 0),)):
        base = plain.get(key(r))
        slots = r.get("row_cache") or 0
        share = f"{100 * r['row_hit_fraction']:.0f}%" if slots else ""
        fetched_mb = r["row_bytes_fetched"] / 1e6 if slots else r.get("row_bytes_max", float("nan")) / 1e6
        floor = r.get("link_floor_fetched_ms") if slots else None
        speedup = f"{base['median_ms'] / r['median_ms']:.2f}x" if slots and base else ""
        lines.append(f"| {r['kind']} | {r['method']} | {r['context']} | {r['batch']} | {r.get('query_drift') or 'none'} | "
                     f"{slots} | {share} | {fetched_mb:.0f}{'' if slots else ' (max)'} | {r['median_ms']:.2f} "
                     f"[{r['min_ms']:.2f}, {r['max_ms']:.2f}] | {fmt(r.get('link_floor_ms'))} | {fmt(floor)} | "
                     f"{fmt(None if floor is None else r['median_ms'] / floor, '.2f')} | {speedup} |")
    return lines + [""]


def write_report(res: dict, prefix: str) -> None:
    m = res["machine"]
    link = res.get("link", {})
    lines = [f"# Offloaded sparse decoding ({m['device']} x{m.get('devices', res['config'].get('mesh', 1))})", "",
             f"{m['date']}, JAX {m['jax']}, commit {m['commit']}, host {m['host']}. Command: `{res['command']}`.",
             "Model: Qwen3-8B shapes (36 layers, 32 query / 8 KV heads, D = 128, hidden 4096, MLP 12288), random bf16 "
             "weights; k = 512; caches synthetic (keys with log-normal channel scales, index built from them); "
             "`shared_kv`: all layers read one K/V row buffer (each layer keeps its own planes).",
             f"Link (device_put of {res['config'].get('link_bytes', 0) / 2**30:.0f} GiB from pinned_host): " +
             ", ".join(f"{k} {v['GBps']:.1f} GB/s" for k, v in link.items()) +
             (f"; HBM copy {res['hbm_copy']['GBps']:.0f} GB/s" if res.get("hbm_copy") else ""), ""]
    if res.get("runs"):
        lines += ["Runs merged: " + "; ".join(f"`{r['command']}` ({r['machine']['date']})" for r in res["runs"]), ""]
    for entry in res.get("links", [])[1:]:
        lines += [f"Link in `{entry['command'][:60]}...`: " + ", ".join(f"{k} {v['GBps']:.1f} GB/s" for k, v in entry["link"].items()), ""]
    rows = res["rows"]
    att = [r for r in rows if r["kind"] == "attention"]
    if att:
        lines += ["## Attention-only step (36 layers; ms per step, median [min, max])", "",
                  "read: `direct` = the plane scan reads host memory as it computes; `staged` = the run gather copies the "
                  "planned runs to HBM first. Link floor: every byte of the planned planes + scales and of the selected "
                  "rows over the link once at the rate measured in the run.", "",
                  "`index writes`: `every_step` writes the newest plane block of every layer each step; `full_blocks` only "
                  "when it fills (once in 64 steps: its cost, the cache write's plane words in the profile, is then "
                  "spread over 64 steps and the median leaves it out); `in scan`: each layer writes its new K/V row and "
                  "blocks inside the layer scan, beside its own transfers (the default since 2026-12-01), instead of every "
                  "layer's after the scan (an option since deleted: measured slower).", "",
                  "`split`: a layer's groups on several GPU streams (an option since deleted: measured slower), or in "
                  "pipelined chunks whose plane transfers are "
                  "chained (the next chunk's transfer beside this chunk's scan, selection and row fetch), with the run "
                  "gather as that many persistent programs.", "",
                  "| method | context | batch | mesh | split | index writes | memory | read | shared K/V | bits/token | scan MB | rows MB (max) | ms | "
                  "link floor ms | fraction of link | authors' ms | run |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(att, key=lambda r: (r["context"], r["method"], r.get("rows", "model"), r.get("read") or "",
                                            r.get("streams", 1),
                                            r.get("pipeline", 1), r.get("gather_programs", 0),
                                            r.get("index_writes", "every_step"), bool(r.get("scan_writes")))):
            lines.append(f"| {r['method']} | {r['context']} | {r['batch']} | {r['mesh']} | {split_text(r)} | {writes_text(r)} | {r['memory']} | {r.get('read', res['config'].get('read'))} | {r['shared_kv']} | "
                         f"{r['bits_per_token']:.1f} | {r['scan_bytes'] / 1e6:.0f} | {r['row_bytes_max'] / 1e6:.0f} | "
                         f"{r['median_ms']:.2f} [{r['min_ms']:.2f}, {r['max_ms']:.2f}] | {r['link_floor_ms']:.1f} | "
                         f"{r['fraction_of_link']:.2f} | {r.get('authors_ms') or ''} | {str(r.get('run_date', ''))[:16]} |")
        lines.append("")
        lines += mesh_ratio_lines(att, res["config"].get("read"))
    full = [r for r in rows if r["kind"] == "full"]
    if full:
        lines += ["## Full decode step (QKV, sparse attention, o_proj, MLP, lm_head)", "",
                  "`weight GEMMs`: `copied` = Triton GEMMs on copies of each layer's weights sliced out of the stacked "
                  "arrays (before 2026-12-01); `in place` = cuBLAS GEMMs reading the slices in place (XLA's dynamic-slice "
                  "fusion, `models.generation.WEIGHT_GEMM_OPTIONS`).", "",
                  "| method | context | batch | mesh | split | index writes | weight GEMMs | ms | tokens/s | wall / device |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(full, key=lambda r: (r["context"], r["batch"], r["method"], r.get("rows", "model"),
                                             r.get("streams", 1),
                                             r.get("pipeline", 1), r.get("index_writes", "every_step"),
                                             r.get("weight_gemms", "copied"), str(r.get("run_date")))):
            lines.append(f"| {r['method']} | {r['context']} | {r['batch']} | {r['mesh']} | {split_text(r)} | "
                         f"{writes_text(r)} | {r.get('weight_gemms', 'copied')} | {r['median_ms']:.2f} "
                         f"[{r['min_ms']:.2f}, {r['max_ms']:.2f}] | {r['tokens_per_s']:.1f} | "
                         f"{r.get('wall_over_device', float('nan')):.2f} |")
        lines.append("")
    lines += row_format_lines(att + full)
    lines += row_cache_lines(att + full)
    lines += tier_lines(att)
    for r in full + att:
        if "profile" in r:
            p = r["profile"]
            what = "full step" if r["kind"] == "full" else f"attention-only step ({r['memory']})"
            what += f", {split_text(r)}" if split_text(r) else ""
            what += ", plane blocks written when full" if r.get("index_writes") == "full_blocks" else ""
            what += ", each layer's writes in the layer scan" if r.get("scan_writes") else ""
            if r.get("profile_run_date"):  # profiled in an earlier run of this measurement than the row's median
                what += f" (profiled in the run of {r['profile_run_date'][:16]}; median above from {r['run_date'][:16]})"
            lines += [f"Profile of the {what}, {r['method']} at {r['context']} (batch {r['batch']}): wall "
                      f"{p['wall_ms_per_step']:.1f} ms, device span {p['device_span_ms_per_step']:.1f} ms, busy "
                      f"{p['device_busy_ms_per_step']:.1f} ms per step; "
                      + ", ".join(f"{k} {v:.1f}" for k, v in p["ms_per_step"].items()) + " ms"
                      + (f"; {p['launches_per_step']:.0f} kernel launches per step." if "launches_per_step" in p else "."), ""]
            if p.get("exposed_ms_per_step"):
                x = p["exposed_ms_per_step"]
                lines += [f"Of its span, a plane transfer ran for {x['transfer_running']:.1f} ms per step; with none running: "
                          + ", ".join(f"{k} {v:.1f}" for k, v in x["outside_transfers"].items()) + " ms.", ""]
            if p.get("top_kernels"):
                lines += ["| kernel | category | ms per step | launches per step |", "|---|---|---|---|"]
                lines += [f"| `{t['name'][:90]}` | {t['category']} | {t['ms_per_step']:.2f} | {t['launches_per_step']:.0f} |"
                          for t in p["top_kernels"][:15]]
                lines.append("")
    pre = [r for r in rows if r["kind"] == "prefill"]
    for r in pre:
        lines += [f"Prefill of a {r['context']}-token prompt into host memory: {r['prefill_s']:.1f} s "
                  f"(first call, with compilation: {r['first_s']:.1f} s); index build {r['index_build_s']:.2f} s "
                  f"({100 * r['index_share']:.1f}%).", ""]
    if res.get("errors"):
        when = lambda e: f"run of {e['run_date'][:16]}" if e.get("run_date") else "run not recorded"  # noqa: E731
        lines += ["## Errors", ""] + [f"- {e['section']} ({when(e)}): {e['error'][:300]}" for e in res["errors"]] + [""]
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    batch_plot([r for r in rows if r["kind"] == "full"], prefix + "_batches.png", m["device"])
    if not att:
        return
    fig, ax = plt.subplots(figsize=(11, 5.2))
    colors = dict(zip(sorted({r["method"] for r in att}), plt.get_cmap("tab10").colors))
    default_read = res["config"].get("read")
    for label in sorted(colors):
        # (read, index writes, pipelined, style); GPU-stream rows stay in the table (measured slower)
        for read, writes, pipelined, style in (
                ("staged", "every_step", False, "o-"), ("staged", "every_step", True, "*-"),
                ("staged", "full_blocks", False, "D:"), ("staged", "full_blocks", True, "*:"),
                ("direct", "every_step", False, "o--")):
            pts = sorted((r["context"], r["median_ms"]) for r in att if r["method"] == label and r["batch"] == 1
                         and r["memory"] == "pinned_host" and r.get("mesh", 1) == 1
                         and r.get("read", default_read) == read and r.get("streams", 1) == 1
                         and r.get("index_writes", "every_step") == writes and (r.get("pipeline", 1) > 1) == pipelined
                         and r.get("rows", "model") == "model")  # compressed rows: their own table
            best = {}
            for c, ms in pts:  # of several settings, the fastest at each context
                best[c] = min(ms, best.get(c, ms))
            pts = sorted(best.items())
            if pts:
                extra = (", blocks written when full" if writes == "full_blocks" else "") + (", pipelined" if pipelined else "")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colors[label],
                        label=f"{label} ({read}{extra})")
        authors = sorted((c, v[label]) for c, v in AUTHORS_MS.items() if label in v)
        if authors and any(r["method"] == label for r in att):
            ax.plot([a[0] for a in authors], [a[1] for a in authors], "x", color=colors[label], ms=9,
                    label=f"{label}, authors' implementation")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("attention-only step (ms, 36 layers)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save_plot(fig, ax, f"{m['device']}: index + K/V in pinned host memory, one GPU", prefix + ".png")
    tier_plot(att, prefix + "_tiers.png", m["device"])


def _save_plot(fig, ax, title: str, path: str) -> None:
    import matplotlib.pyplot as plt

    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tier_rows(att: list[dict]) -> list[dict]:
    """The rows of runs that recorded where the index lived (since resident planes exist)."""
    return [r for r in att if "index_hbm_bytes" in r and r["memory"] == "pinned_host"]


def tier_lines(att: list[dict]) -> list[str]:
    """The resident-planes table: each row beside the same method, context and batch with the index on the host."""
    rows = _tier_rows(att)
    if not any(r["resident_planes"] for r in rows):
        return []
    base = {(r["method"], r["context"], r["batch"], r.get("rows", "model")): r for r in rows if not r["resident_planes"]}
    lines = ["## Resident planes", "",
             "`p`: planes [0, p) of every channel, and every block scale, in HBM; planes [p, 4) in pinned host memory "
             "(p = 4: the whole index in HBM). Link MB: the planned planes (and, at p = 0, scales) that cross the link "
             "per step; the floor adds the selected rows (max) at the link rate measured in the run.", "",
             "| method | context | batch | p | index host GB | index HBM GB | link MB (planes) | rows MB (max) | ms | "
             "tokens/s | link floor ms | vs p = 0 | link bytes vs p = 0 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["method"], r["context"], r["batch"], r.get("rows", "model"),
                                         str(r["resident_planes"]))):
        b = base.get((r["method"], r["context"], r["batch"], r.get("rows", "model")))
        speed = f"{b['median_ms'] / r['median_ms']:.2f}x" if b else ""
        share = f"{r['link_scan_bytes'] / b['link_scan_bytes']:.2f}" if b and b["link_scan_bytes"] else ""
        lines.append(f"| {r['method']} | {r['context']} | {r['batch']} | {r['resident_planes']} | "
                     f"{r['index_host_bytes'] / 1e9:.2f} | {r['index_hbm_bytes'] / 1e9:.2f} | "
                     f"{r['link_scan_bytes'] / 1e6:.0f} | {r['row_bytes_max'] / 1e6:.0f} | "
                     f"{r['median_ms']:.2f} [{r['min_ms']:.2f}, {r['max_ms']:.2f}] | {r['batch'] / r['median_ms'] * 1e3:.1f} | "
                     f"{r['link_floor_ms']:.1f} | {speed} | {share} |")
    return lines + [""]


def tier_plot(att: list[dict], path: str, device: str) -> None:
    """Step time against the HBM bytes of the index per session, one line per method and context."""
    import matplotlib.pyplot as plt

    rows = _tier_rows(att)
    if not any(r["resident_planes"] for r in rows):
        return
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for (method, context), style in zip(sorted({(r["method"], r["context"]) for r in rows}),
                                        ("o-", "s-", "D-", "^-", "o--", "s--", "D--", "^--")):
        pts = sorted((r["index_hbm_bytes"] / r["batch"] / 1e9, r["median_ms"]) for r in rows
                     if (r["method"], r["context"]) == (method, context) and isinstance(r["resident_planes"], int))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{method}, {context // 1024}k")
    ax.set_xlabel("HBM bytes of the index per session (GB)")
    ax.set_ylabel("attention-only step (ms, 36 layers)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    _save_plot(fig, ax, f"{device}: resident planes (p = 0, 1, 2, 4)", path)


def batch_plot(full: list[dict], path: str, device: str) -> None:
    """Tokens per second of the full step against the batch size (sessions of their own), one line per method,
    context, row format and resident planes; only where a line has two batch sizes or more."""
    import matplotlib.pyplot as plt

    lines: dict[tuple, dict[int, float]] = {}
    for r in full:  # of several settings, the fastest at each batch
        pts = lines.setdefault((r["method"], r["context"], r.get("rows", "model"), r.get("resident_planes", 0),
                                r.get("shared_kv")), {})
        pts[r["batch"]] = max(r["tokens_per_s"], pts.get(r["batch"], 0.0))
    lines = {k: v for k, v in lines.items() if len(v) > 1}
    if not lines:
        return
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for (method, context, rows, p, shared), pts in sorted(lines.items()):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], "o-", label=f"{method}, {context // 1024}k, {rows} rows, p = {p}"
                + (", shared K/V" if shared else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (sessions decoded together)")
    ax.set_ylabel("tokens per second (full step)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    _save_plot(fig, ax, f"{device}: full decode step against the batch size", path)


if __name__ == "__main__":
    main()
