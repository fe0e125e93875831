"""Offloaded sparse decoding of a Qwen3-8B-shaped model: results/offload_<machine>_<tag>.{json,md,png}, <machine> the
device the run used (``h200``, ``h100``, ``h200x2`` for two, ``cpu``: :func:`scripts.harness.machine_name`).

The K/V cache and the key index of every layer live in ``pinned_host`` memory, stacked by layer; HBM holds
the weights, the queries and the selected rows. One compiled program per decode step (36 layers under
``lax.scan``), one per attention-only step (the paper's terms: no weight GEMMs).

Caches are synthetic where no prefill is run: each layer's keys are drawn with log-normal channel scales
(log-variance std 1.25, as the kernel benchmark: ~39 active channels at a budget of 48) and written through
the same path as prefill (the index is built from them, so the planes are real codes); the calibration
variance is the drawn one. Where the host cannot hold every layer's K/V rows (1M tokens on a 128 GiB host),
all layers share one row buffer while each keeps its own planes (``shared_kv`` in the results): the bytes
a step moves are the same.

    python3 -m scripts.bench_offload --out $OUT                      # the default sections: offload_h200.json on an H200
    python3 -m scripts.bench_offload --mesh 2 --out $OUT             # over two GPUs: offload_h200x2.json
    JAX_COORDINATOR_ADDRESS=host0:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python3 -m scripts.bench_offload --mesh 2 \
        --out $OUT                                                   # one process per host (fathom_jax.distributed)
    python3 -m scripts.bench_offload --smoke --out /tmp/smoke          # tiny shapes, any backend (CI-size)
    python3 -m scripts.bench_offload --merge results/offload_h200 a.json b.json   # one file from several runs
    python3 -m scripts.bench_offload --preset attn --out $OUT        # the run behind a committed table (PRESETS)

Sections (``--sections``): link, attn, full, profile, batch, control, dense, prefill; ``attnprofile`` adds a
profiler breakdown (categories and the costliest kernels) to every attention-only row; ``attnbatch``: attention-only
rows at 128k for each of ``--batches``.

K/V row formats (``--rows model,k8v8``; an entry ``FORMAT@SHARE`` sets that format's ``--share-kv-from``): one set
of rows each in the attn, attnbatch, full and batch sections, over a cache of its own; each row records its format
(``rows``), its row bytes per token and per step, and its host bytes per token (as held, and with every layer's own
rows).

Inputs (``--inputs today,honest``: one set of attention-only and control rows each, over a cache of its own;
``scripts/offload_inputs.py``): ``today`` draws the keys every earlier run drew and repeats one query set (or drifts
it by ``--query-drift``); ``honest`` draws keys whose plane-0 shares match SmolLM2's real keys and drifts the queries so
that a step reselects ~63% of the rows of the step before, as real decodes measured. The report puts them side by side.

A row cache (``--row-cache SLOTS``, :class:`fathom_jax.decode.RowCache`) pays only when a step reselects rows
of the steps before it: ``--query-drift RHO`` gives every attention-only step new queries, drifting from the last
step's (AR(1); 0.95 leaves ~37% of the rows new each step, what SmolLM2 measured on real text) instead of one query
set repeated. The report's row-cache table puts each such row beside the same step without a cache.

The code: this file holds the command line, its presets and the sections driver (:func:`main`); ``offload_setup.py``
the methods, synthetic caches, hooks, step inputs, random model and step options; ``offload_measure.py`` the results
file (:class:`offload_measure.Run`) and each section's timed rows; ``offload_report.py`` ``--merge`` and the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax.numpy as jnp

from fathom_jax import distributed
from fathom_jax.models import LlamaConfig
from fathom_jax.placement import Placement, device_mesh
from fathom_jax.rows.layout import RowLayout
from scripts import harness
from scripts.offload_inputs import parse_inputs
from scripts.offload_measure import Run, attention_rows, full_rows, link_section, prefill_section
from scripts.offload_report import merge
from scripts.offload_setup import (METHODS, parse_ctx, parse_rows, parse_variants, random_model, rows_tag)

QWEN3_8B = LlamaConfig(vocab=151936, hidden=4096, intermediate=12288, n_layers=36, n_heads=32, n_kv_heads=8,
                       head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True, max_position_embeddings=1 << 20,
                       family="qwen3")
SMOKE = LlamaConfig(vocab=512, hidden=64, intermediate=128, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=64,
                    rope_theta=1e6, qk_norm=True, family="qwen3")

# `--preset NAME`: the argument list of the run behind a committed table (results/README.md names each table's
# presets, their environment and the --merge that joins them); arguments after it override it (--out, --tag, ...).
_F4 = '--methods "Fathom 48,Fathom 64,SparQ r=16,32-channel (SparQ r=32)"'
_F3 = '--methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)"'
_F48, _F48_32 = '--methods "Fathom 48"', '--methods "Fathom 48,32-channel (SparQ r=32)"'
_WHILE = "xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE"
PRESETS = harness.presets({
    # results/offload_h200.*, one H200
    "attn": f"--tag attn --read staged --sections link,attn --contexts 1m,128k {_F4} --share-kv-from 1m "
            "--time-budget 280",
    "attn-index-writes-1m": f"--tag writes_1m --read staged --sections link,attn --contexts 1m {_F3} "
                            "--index-writes every_step,full_blocks --share-kv-from 1m --time-budget 140",
    "attn-index-writes-128k": f"--tag writes_128k --read staged --sections attn,full --contexts 128k "
                              f"--full-contexts 128k {_F3} --index-writes every_step,full_blocks --time-budget 90",
    "direct-reads": "--tag direct --read direct --sections link,attn --contexts 1m,128k --time-budget 280",
    "contexts-32k-512k": f"--tag 32k_512k --read staged {_F4} --sections attn,dense --contexts 512k,128k,32k "
                         "--attn-contexts 512k,32k --share-kv-from 512k --time-budget 550",
    "full-1m": f"--tag full_1m --read staged --sections full,profile --contexts 1m --full-contexts 1m {_F48} "
               "--share-kv-from 1m --time-budget 120",
    "full-3methods": f"--tag full_3 --read staged {_F3} --sections attn,full,profile,batch,prefill,control,dense "
                     "--contexts 1m,128k --attn-contexts 1m,128k --full-contexts 1m --share-kv-from 1m --time-budget 290",
    "full-batches": f"--tag batches {_F48} --sections link,attn,attnprofile,full,profile,batch --contexts 1m,128k "
                    "--attn-contexts 128k --full-contexts 1m,128k --batches 8,4 --share-kv-from 512k --time-budget 400",
    "full-batches-128k": f"--tag batches_128k {_F48} --read staged --sections link,full,batch --contexts 128k "
                         "--batches 4,8 --time-budget 320",
    "full-batch8": f"--tag batch8 --read staged --sections link,full,batch,profile --contexts 128k "
                   f"--full-contexts 128k --batches 8 {_F48} --fetch-programs auto,132 --share-kv-from 512k "
                   "--time-budget 190",
    "prefill": f"--tag prefill --read staged {_F48} --sections prefill,batch --contexts 128k --batches 8 "
               "--share-kv-from 512k --time-budget 155",
    "hbm-control": f"--tag control {_F48} --read staged --sections batch,control --contexts 128k --batches 8,1 "
                   "--time-budget 270",
    # results/pipeline_h200.md (the pipeline rows are in offload_h200 as well)
    "pipeline-1m": f"--tag pipeline_1m --read staged {_F3} --index-writes every_step,full_blocks "
                   "--pipeline auto,1/0 --sections link,attn,attnprofile --contexts 1m --share-kv-from 1m "
                   "--time-budget 270",
    "pipeline-128k": f"--tag pipeline_128k --read staged {_F3} --index-writes every_step,full_blocks "
                     "--pipeline auto,1/0 --sections link,attn --contexts 128k --time-budget 220",
    "pipeline-chunks": f"--tag chunks --read staged {_F48} --index-writes full_blocks "
                       "--pipeline 1,1/132,2/132,4/132,8/0,8/132,8/264 --sections link,attn,attnprofile "
                       "--contexts 1m,128k --share-kv-from 1m --time-budget 390",
    "pipeline-programs": f"--tag programs --read staged {_F48} --index-writes full_blocks "
                         "--pipeline 1,8/132,8/66,8/33,4/66,2/66 --sections link,attn,attnprofile --contexts 1m,128k "
                         "--share-kv-from 1m --time-budget 290",
    # results/decode_step_h200.md (rows merged into offload_h200 too)
    "topk-fetch-programs": f"--tag topk_fetch --read staged --sections link,attn --contexts 1m {_F48} "
                           "--fetch-programs auto,0 --topk auto,single --share-kv-from 1m --time-budget 190",
    "weight-gemms": f"--tag weights --read staged --sections link,full,batch --contexts 128k --full-contexts 128k "
                    f"--batches 8 {_F48} --share-kv-from 512k --time-budget 160 "  # the Triton control, then the default
                    '--xla-options "xla_gpu_enable_triton_gemm=true,xla_gpu_enable_dynamic_slice_fusion=false;none"',
    # results/step_options_h200.md, results/tail_h200.* (traces of layer-unroll-profile)
    "layer-unroll": f"--tag unroll --read staged --sections attn --contexts 1m,128k {_F48} --share-kv-from 1m "
                    "--layer-unroll 1,2,4,6 --time-budget 280",
    "layer-unroll-profile": f"--tag unroll_profile --read staged --sections attn,attnprofile --contexts 1m,128k "
                            f"{_F48} --share-kv-from 1m --layer-unroll 2,4 --time-budget 220",
    "layer-unroll-full": f"--tag unroll_full --read staged --sections full --contexts 128k --full-contexts 128k "
                         f"{_F48} --layer-unroll 1,4 --time-budget 220",
    "command-buffer-loop": f"--tag while --read staged --sections attn --contexts 1m,128k {_F48} --share-kv-from 1m "
                           f'--xla-options "{_WHILE};{_WHILE},xla_gpu_command_buffer_unroll_loops=true" --time-budget 220',
    "chunks-fetch-programs": f"--tag chunks_fetch --read staged --sections attn --contexts 1m,128k {_F48} "
                             "--share-kv-from 1m --layer-unroll 2 --pipeline auto,4,8 --fetch-programs 66,132 "
                             "--time-budget 400",
    "topk-programs": f"--tag topk --read staged --sections attn --contexts 1m,128k {_F48} --share-kv-from 1m "
                     "--topk auto,b8t4,b16t4,b8t8,bautot8 --time-budget 160",
    # results/row_cache_h200/
    "row-cache-1m": f"--tag row_cache_1m --read staged --sections link,attn --contexts 1m,128k {_F48} "
                    "--share-kv-from 1m --query-drift 0.95 --row-cache 0,16384 --time-budget 190",
    "row-cache-batch8": f"--tag row_cache_b8 --read staged --sections link,attnbatch,attn,batch,attnprofile "
                        f"--contexts 128k --attn-contexts 128k --batches 8 {_F48} --share-kv-from 512k "
                        "--query-drift 0.95 --row-cache 0,16384 --time-budget 390",
    # results/offload_h200_honest_1m.* (issue 45): today's inputs and honest ones, plane 0 or every plane in HBM, the
    # link floor and the all-in-HBM control of each
    "honest-1m": f"--tag honest_1m --sections link,attn,control --contexts 1m {_F48} --resident-planes 1,4 "
                 "--inputs today,honest --share-kv-from 1m --time-budget 290",
    # warm planes (plane_reuse.md: on these keys a set of 27 / 58 channel planes per group, chosen by the planner's
    # gains, misses ~6% / ~11% of Fathom 48's host planes at p = 1 / 0)
    "warm-1m": f"--tag warm_1m --sections link,attn --contexts 1m {_F48} --resident-planes 0,1 --warm-planes 0,48 "
               "--inputs honest --share-kv-from 1m --time-budget 480",
    "warm-128k-b8": f"--tag warm_128k_b8 --sections link,attnbatch --contexts 128k {_F48} --batches 8 "
                    "--rows k8v8 --resident-planes 0,1 --warm-planes 0,48 --share-kv-from none --time-budget 400",
    # results/fetch_order_h200/ (the default fetch order) and results/scan_unroll_h200/ (the default scan)
    "fathom48": f"--tag f48 --read staged --sections link,attn --contexts 1m,128k {_F48} --share-kv-from 1m "
                "--time-budget 160",
    "attn-profile-1m": f"--tag profile_1m --read staged --sections attn,attnprofile --contexts 1m {_F48} "
                       "--share-kv-from 1m --time-budget 140",
    # results/offload_h200.* resident planes (issue 33; the p = 0 rows also re-measure the default step)
    "tiers-1m": f"--tag tiers_1m --sections link,attn --contexts 1m {_F4} --resident-planes 0,1 "
                "--share-kv-from 1m --time-budget 350",
    "tiers-128k": f"--tag tiers_128k --sections link,attn --contexts 128k {_F4} --resident-planes 0,1 "
                  "--share-kv-from 1m --time-budget 190",
    "tiers-p24": '--tag tiers_p24 --sections attn --contexts 1m,128k --methods "Fathom 48,Fathom 64" '
                 "--resident-planes 2,4 --share-kv-from 1m --time-budget 210",
    "tiers-profile": f"--tag tiers_profile --sections attn,attnprofile --contexts 1m {_F48} --resident-planes 1 "
                     "--share-kv-from 1m --time-budget 140",
    "tiers-chunks": f"--tag tiers_chunks --sections link,attn --contexts 1m {_F48} --resident-planes 1,2,4 "
                    "--pipeline 8,2,1 --share-kv-from 1m --time-budget 420",
    # K/V row formats (issue 32): every layer's (every session's) own rows in 8-bit K and V, beside bf16 rows; the pinned
    # host cap must hold them (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, README). bf16 rows of every layer at 1M (167 GB) do
    # not fit the 128 GiB host: their row, shared by every layer, is the committed baseline (offload_h200). At 128k
    # batch 8, bf16 own rows (175 GB) do not fit either: bf16 is measured shared as the control, after k8v8 (the
    # larger cache first: the allocator's regions, once pinned, are kept).
    "rows-1m": f"--tag rows_1m --sections link,attn,full --contexts 1m --attn-contexts 1m --full-contexts 1m "
               f"{_F48} --rows k8v8 --share-kv-from none --time-budget 200",
    "rows-1m-tiers": f"--tag rows_1m_tiers --sections link,attn,full --contexts 1m --attn-contexts 1m "
                     f"--full-contexts 1m {_F48} --rows k8v8 --resident-planes 1 --share-kv-from none --time-budget 200",
    "rows-128k-batch": f"--tag rows_128k_b8 --sections link,attnbatch,batch --contexts 128k --batches 8 {_F48} "
                       "--rows k8v8@none,model@512k --share-kv-from none --time-budget 280",
    "tiers-batch8": f"--tag tiers_b8 --sections link,attnbatch,batch --contexts 128k --batches 8 {_F48} "
                    "--rows k8v8 --resident-planes 1 --pipeline 2,1 --share-kv-from none --time-budget 300",
    "rows-128k-batches": f"--tag rows_128k_batches --sections link,batch --contexts 128k --batches 8,4,2,1 "
                         f"{_F48} --rows k8v8 --resident-planes 0,1 --share-kv-from none --time-budget 540",
    # results/offload_h200x2.*, the two-H200 machine (every layer's own K/V: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, README)
    "x2-1m-1gpu": f"--tag 1m_1gpu --mesh 1 --read staged --sections link,attn --contexts 1m {_F48_32} "
                  "--index-writes every_step,full_blocks --share-kv-from none --time-budget 230",
    "x2-1m-2gpu": f"--tag 1m_2gpu --mesh 2 --read staged --sections link,attn --contexts 1m {_F48_32} "
                  "--index-writes every_step,full_blocks --share-kv-from none --time-budget 310",
    "x2-512k-1gpu": f"--tag 512k_1gpu --mesh 1 --sections attn --contexts 512k {_F48} --read staged "
                    "--share-kv-from none --time-budget 210",
    "x2-512k-2gpu": f"--tag 512k_2gpu --mesh 2 --sections link,attn --contexts 512k {_F48} --read staged "
                    "--share-kv-from none --time-budget 270",
    "x2-shared-1gpu": f"--tag shared_1gpu --mesh 1 --read staged --sections link,attn --contexts 1m,128k {_F48_32} "
                      "--share-kv-from 1m --time-budget 140",
    "x2-shared-2gpu": f"--tag shared_2gpu --mesh 2 --read staged --sections link,attn --contexts 1m,128k "
                      f"{_F48_32} --share-kv-from 1m --time-budget 160",
})


def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--merge":  # --merge OUT_PREFIX IN.json ...
        return merge(sys.argv[3:], sys.argv[2])
    argv = harness.expand_preset(sys.argv[1:] if argv is None else argv, PRESETS)
    distributed.initialize()  # one process per host, from the environment (fathom_jax.distributed); else a no-op
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results")
    ap.add_argument("--tag", default=None, help="the run's name: it writes offload_<machine>_<tag>.{json,md,png}, "
                    "<machine> the device it ran on (h200, h100, h200x2, cpu: scripts.harness.machine_name)")
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
    ap.add_argument("--warm-planes", default="0",
                    help="channel planes per layer and KV group kept in HBM beside the resident planes "
                         "(Placement.warm_planes, chosen from the step's queries), a ','-separated list: one set of "
                         "attn and attnbatch rows each with resident planes 0-3 (0: none)")
    ap.add_argument("--rows", default="model",
                    help="K/V row formats, a ','-separated list: one set of rows each (sections attn, attnbatch, full, "
                         "batch), over a cache of its own. Each FORMAT or FORMAT@SHARE: model (the model dtype, bf16) or "
                         "a format with per-token scales (k8v8, k8v4g32a, ...: fathom_jax.rows.layout); SHARE overrides "
                         "--share-kv-from for that format (a context or none)")
    ap.add_argument("--query-drift", type=float, default=None,
                    help="attention-only rows: each step's queries drift from the last by AR(1) with this coefficient "
                         "(0.95: ~37%% new rows per step); default: one query set repeated")
    ap.add_argument("--inputs", default="today",
                    help="synthetic input sets (scripts/offload_inputs.py), a ','-separated list: one set of attention "
                         "and control rows each, over a cache of its own: today (the keys of every earlier run, queries "
                         "repeated or --query-drift) and/or honest (keys and query drift fitted to real decodes)")
    ap.add_argument("--scan", default="default",
                    help="plane scan configurations (StepConfig.scan; a list: one row each): default (the kernel's "
                         "heuristic, f32 arithmetic) and/or f16x2 (pairs of tokens in packed f16)")
    ap.add_argument("--select", default="threshold",
                    help="how a step selects its rows (StepConfig.selection; a list: one row each): threshold (the scan "
                         "keeps each head's candidates above a threshold seeded by the previous step) and/or sorted "
                         "(every score written, the top-k kernels, the union by a sort)")
    ap.add_argument("--attention", default="kernel",
                    help="how a step attends (StepConfig.attention; a list: one row each): kernel (the attention "
                         "kernel reads the selected rows by index) and/or xla (the rows gathered, then XLA)")
    ap.add_argument("--dump-hlo", action="store_true",
                    help="write each attention row's compiled step (GPU) beside the results, to count its kernels")
    ap.add_argument("--link-bytes", type=int, default=2 << 30)
    ap.add_argument("--time-budget", type=float, default=540.0, help="seconds; sections past it are skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the whole script)")
    ap.add_argument("--implementation", default="triton", choices=["triton", "xla"],
                    help="the kernels: triton (what the benchmark measures; interpreted on a CPU) or xla (a quick CPU "
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
                                       args.xla_options, args.layer_unroll, args.row_cache, args.scan, args.select,
                                       args.attention)
    except (ValueError, TypeError) as e:
        ap.error(f"--index-writes / --pipeline / --fetch-programs / --topk / --xla-options / --layer-unroll / "
                 f"--row-cache / --scan / --select / --attention: {e}")
    for field in ("resident_planes", "warm_planes"):  # lists of counts, each a valid Placement field
        try:
            counts = [int(c) for c in getattr(args, field).split(",")]
            for c in counts:
                Placement("pinned_host", **{field: c})
        except ValueError as e:
            ap.error(f"--{field.replace('_', '-')}: {e}")
        setattr(args, field, counts)
    try:
        args.rows = parse_rows(args.rows, args.share_kv_from)
        for entry in args.rows:  # the format against the model's head_dim
            RowLayout.of(entry["format"], args.config.head_dim, jnp.bfloat16)
    except ValueError as e:
        ap.error(f"--rows: {e}")
    try:
        args.inputs = parse_inputs(args.inputs)
    except ValueError as e:
        ap.error(str(e))
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
    # Sections run in the order given, so a run cut short by its time budget keeps the ones that matter most.
    for section in args.sections:
        if section == "link":
            run.guard("link", link_section, run)
        elif section == "attn":
            for ctx in sorted(args.attn_contexts, reverse=True):
                for p, w in ((p, w) for p in args.resident_planes for w in args.warm_planes if not w or p < 4):
                    placement = dataclasses.replace(args.placement, resident_planes=p, warm_planes=w)
                    for rows, inputs in ((r, i) for r in args.rows for i in args.inputs):
                        run.guard(f"attn {ctx} p{p}{f'w{w}' if w else ''}{rows_tag(rows)}{inputs_tag(inputs)}",
                                  attention_rows, run, ctx, labels, placement=placement, rows=rows, inputs=inputs)
        elif section in ("full", "batch", "prefill") and run.model is None:
            run.model = run.guard("model", random_model, args.config, args.placement)
        if section == "full" and run.model is not None:
            for ctx in args.full_contexts:
                for p in args.resident_planes:
                    placement = dataclasses.replace(args.placement, resident_planes=p)
                    for rows in args.rows:
                        run.guard(f"full {ctx} p{p}{rows_tag(rows)}", full_rows, run, ctx,
                                  labels, profile="profile" in args.sections and ctx == max(args.full_contexts),
                                  placement=placement, rows=rows)
        elif section == "batch" and run.model is not None:
            ctx = 131072 if 131072 in args.contexts else min(args.contexts)
            for b in (int(x) for x in args.batches.split(",")):
                for p in args.resident_planes:
                    placement = dataclasses.replace(args.placement, resident_planes=p)
                    for rows in args.rows:
                        run.guard(f"batch {b} p{p}{rows_tag(rows)}", full_rows, run, ctx,
                                  labels[:1], batch=b, profile="profile" in args.sections and b == 8,
                                  placement=placement, rows=rows)
        elif section == "attnbatch":  # attention-only rows of larger batches (the row cache's and tiers' comparison)
            ctx = 131072 if 131072 in args.contexts else min(args.contexts)
            for b in (int(x) for x in args.batches.split(",")):
                for p, w in ((p, w) for p in args.resident_planes for w in args.warm_planes if not w or p < 4):
                    placement = dataclasses.replace(args.placement, resident_planes=p, warm_planes=w)
                    for rows in args.rows:
                        run.guard(f"attn batch {b} p{p}{f'w{w}' if w else ''}{rows_tag(rows)}", attention_rows, run,
                                  ctx, labels[:1], batch=b, placement=placement, rows=rows)
        elif section == "control":
            ctx = 131072 if 131072 in args.contexts else min(args.contexts)
            for inputs in args.inputs:
                run.guard(f"control{inputs_tag(inputs)}", attention_rows, run, ctx, labels,
                          placement=Placement("device", mesh=mesh), tag="index and K/V in HBM", inputs=inputs)
        elif section == "dense":
            METHODS.setdefault("dense", "dense")
            for ctx in [c for c in sorted(args.contexts) if c <= 131072]:
                run.guard(f"dense {ctx}", attention_rows, run, ctx, ["dense"], tag="dense offload")
        elif section == "prefill" and run.model is not None:
            ctx = 131072 if 131072 in args.contexts else max(args.contexts)
            run.guard("prefill", prefill_section, run, ctx)
    run.save()
    print(f"done in {time.time() - run.t0:.0f} s; {len(run.res['errors'])} errors", flush=True)


def inputs_tag(inputs) -> str:
    """A section name's suffix naming an input set (none for today's)."""
    return "" if inputs.name == "today" else f" {inputs.name} inputs"


if __name__ == "__main__":
    main()
