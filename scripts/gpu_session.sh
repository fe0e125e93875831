#!/usr/bin/env bash
# The device runs of a session, stage by stage (each stage is one call of at most 10 minutes on a lent GPU):
#   a1  (nvidia-h200)   GPU tests (kernels, sparse step, zero-copy guard) + benchmark: link, attention at 1M and 128k
#   a2  (same machine)  SmolLM2 offloaded-vs-HBM parity + benchmark: full step, profile, batch, control, dense, prefill
#   b1  (nvidia-h200-x2) sharding tests natively + the 1-GPU step on that machine
#   b2  (same machine)  the 2-GPU step (every layer's own K/V at 1M)
#   c1  (nvidia-h200)   GPU tests after a change (kernels, offload, decoding), first half of the GGUF;
#                       benchmark: full step at batch 4 and 8 @128k, attention with index and K/V in HBM
#   c2  (same machine)  second half; SmolLM2 GPU tests; the downstream sweeps (RULER 4k and 8k, step
#                       agreement 4k) as parallel processes in their own sessions, so they outlive the call
#   c3  (same machine)  wait for the sweeps and collect their results
#   d1  (nvidia-h200)   row fetch vs context size / index pattern / config; attention step profiles at 1M and 128k
#   d2  (same machine)  attention at 512k (one shared K/V row buffer: every layer's own, 87 GB, was killed) and 32k for four methods; dense offload at 32k/128k
#   e1  (nvidia-h200)   GPU tests after a change; row fetch with fresh rows per call; three methods at 1M, profiled
#   e2  (same machine)  SmolLM2 GPU tests; Fathom 48 at 128k, profiled
#   f1  (nvidia-h200)   GPU tests after a change; three methods at 1M and 128k, profiled
#   f2  (same machine)  SmolLM2 GPU tests
#   g1  (nvidia-h200-x2) GPU tests after a change (one GPU visible) + sharding tests on both; 1M with every
#                       layer's own K/V (171 GB of host memory) on one GPU of that machine
#   g2  (same machine)  SmolLM2 GPU tests; the same 1M step on two GPUs
#   g6  (nvidia-h200-x2) offload-path GPU tests; 1M with every layer's own K/V on two GPUs (K/V allocated first)
#   h1/h2 (nvidia-h200-x2, never run: superseded by j2/j3) issue 9's comparison: 1M, every layer's own K/V, staged
#                       reads, 1 vs 2 GPUs, with K and V as two arrays
#   i1  (nvidia-h200-x2) GPU tests; row fetch from host memory, K and V split vs side by side
#   j1-j3 (nvidia-h200-x2) after K and V went side by side: GPU tests, the 1-GPU benchmark at 1M/128k; h1/h2 as j2/j3
#   k1  (nvidia-h200)   the planner in rounds of six bisection steps (reverted: no gain): GPU tests, Fathom 48 vs SparQ at 128k
#   l1  (nvidia-h200)   the water-line kernel (the bisection in one launch): GPU tests; three methods at 1M and 128k, profiled
#   l2  (same machine)  SmolLM2 GPU tests; full step at batch 1, 4 and 8 @128k
#   m1  (nvidia-h200)   top-k: GPU tests; the fused path's warps and bucket limit on decode-shaped rows (2^k + 64)
#   m2  (nvidia-h200)   32-token buckets at 1M (bucket limit 65536): GPU tests; Fathom 48 and SparQ r=16 at 1M and 128k, profiled
#   n1  (nvidia-h200)   run gather chunk / warps on the runs of a 128k and a 1M store
#   n2  (nvidia-h200)   cache write with 64 (channel, plane) rows per program (run at a003c0c, reverted: no change): its GPU
#                       tests and the offload path's; Fathom 48 at 1M and 128k, profiled
#   n3  (nvidia-h200-x2) the sharding, HLO and CLI tests on both GPUs after the water-line and top-k changes
#   o1  (nvidia-h200)   each device's groups split over GPU streams (Placement.streams): GPU tests; Fathom 48 at 1M
#                       and 128k with 1, 2 and 4 streams, profiled (failed to compile with streams: every op traced inside
#                       compute_on carried the stream too, and XLA wrapped inner ops into async calls of their own)
#   o2  (nvidia-h200)   o1 after tracing the stream's body without the per-op annotation: the streams' GPU tests; o1's benchmark
#                       (ran, slower: every chunk an async computation, and the profile shows no overlap at all)
#   o3  (nvidia-h200)   o2 with the last chunk on the main stream (XLA schedules two async computations one after the other)
#                       (ran: the schedule has main-stream kernels inside the async window, yet busy = span: no overlap)
#   o4  (nvidia-h200)   which streams the kernels really run on, with XLA's command buffers on (default) and off
#   o5  (nvidia-h200)   plane blocks written only when full (Placement(index_writes="full_blocks")): the offload path's
#                       GPU tests; three methods at 1M and 128k, both write modes, profiled (rows after the first
#                       ~64 steps of a context read a full cache: the 32-channel rows' writes fell outside it)
#   o6  (nvidia-h200)   o5's 1M rows of SparQ r=16 and the 32-channel scan again, each row from the same context
#   p1  (nvidia-h200)   a layer in pipelined chunks (Placement(pipeline=N)): each chunk's plane transfer chained to the
#                       previous one's and run beside its scan, selection and row fetch (CUDA graphs scheduled by data
#                       dependencies), the run gather as persistent programs: GPU tests; Fathom 48 at 1M and 128k, profiled
#   p2  (nvidia-h200)   p1's best settings and fewer gather programs, profiled with the time outside plane transfers;
#                       SparQ r=16 and the 32-channel scan pipelined beside their one-chunk rows (the ratio targets)
#   q1  (nvidia-h200)   pipelined chunks by default (pipeline="auto"): every GPU test but SmolLM2's, first half of the GGUF;
#                       three methods at 1M, both index-write modes, auto against one chunk, profiled
#   q2  (same machine)  second half; SmolLM2 GPU tests; the same at 128k
#   r1  (nvidia-h200-x2) pipelined chunks by default, after the review's refactor: every GPU test but SmolLM2's on
#                       one GPU, the sharding/HLO/CLI tests on both (pipelined chunks under a mesh), first half of the
#                       GGUF; 1M with every layer's own K/V on one GPU of that machine, both index-write modes
#   r2  (same machine)  second half; SmolLM2 GPU tests (8k parity, two GPUs vs one); the same 1M step on two GPUs
#   s1  (nvidia-h200)   each layer's writes inside the layer scan (Placement(scan_writes=True), the default): the GPU tests
#                       of the decode/offload path; Fathom 48 with and without scan writes, SparQ r=16 and the 32-channel
#                       scan at 1M and 128k
#   t1  (nvidia-h200-x2) the sharding/HLO/CLI tests on both GPUs (r1's were cut by their timeout), with scan writes; the
#                       decode GPU tests after s1's three new cases were fixed (raw store, a copy before flush, TF32 tolerance)
#   t2  (nvidia-h200)   t1's failing raw-store index cases: the same test in HBM on the GPU, and in host memory with the
#                       writes after the scan and in it (which of them breaks bit equality)
#   u1  (nvidia-h200)   ninth session: the index-equality GPU cases after exact_cell (run from the shell, not a stage);
#                       full step at 1M and 128k, batch 4 and 8 at 128k, profiled (the rows of the fifth session were stale)
#   u2  (nvidia-h200)   diagnostics: the top-k with split rows (kernel tests, sweep of splits on chunk-shaped rows);
#                       the row fetch with persistent programs walking the groups; the full step's HLO (what it copies,
#                       with and without XLA's dynamic-slice fusion)
#   u3  (nvidia-h200)   the top-k with split rows and the persistent row fetch by default: every GPU test but SmolLM2's,
#                       the index-equality cases in HBM on the GPU, first half of the GGUF; Fathom 48 at 1M with each
#                       option on and off
#   u4  (same machine)  second half; SmolLM2 GPU tests; the full step at 128k (batch 1 and 8) with and without cuBLAS
#                       GEMMs reading the layer's weights in place (XLA's dynamic-slice fusion); three methods at 1M
#   u5  (nvidia-h200)   cuBLAS GEMMs reading each layer's weights in place, by default in every decode-step program: the
#                       decode, zero-copy and sparse-model GPU tests (not SmolLM2's: its GGUF needs two calls); the full
#                       step at 1M, profiled
#   v1  (nvidia-h200)   tenth session: the union of a group's selections without a sort (kernel bench against the sort);
#                       every GPU test but SmolLM2's (the weight-copy guard new), first half of the GGUF; three methods
#                       at 128k, both index-write modes, Fathom 48 profiled
#   v2  (same machine)  second half; SmolLM2 GPU tests (with the weight options); three methods at 1M, both write
#                       modes; the full step at 128k, batch 1 and 8, batch 8 profiled, the row fetch's programs varied
#   v3  (same machine)  v2's 1M and 128k Fathom 48 rows were 10 ms slower: the same rows with the sort-free union in the
#                       step and without it (run from the shell: UNSORTED_UNION_GROUPS 8, 0, 8; since removed)
#   v4  (same machine)  the sort again: three methods at 1M and 128k, both write modes; the full step at 128k; the
#                       weight-copy guard's failures (XLA's cuBLAS dynamic-slice fusion counted as a copy; the
#                       device-memory decode loop copied its cache: not donated) (run from the shell)
#   v5  (nvidia-h200)   after both fixes: the HLO and sparse-model GPU tests; Fathom 48 at 1M, profiled
#   w1  (nvidia-h200, never run; its tests went into y1) after cd00015: every GPU test but SmolLM2's; the 1M and 128k
#                       Fathom 48 step profiled with the union by sort, then with the sort-free union patched into this
#                       machine's copy of sparse_step.py (why it is 10 ms slower in the step)
#   x1-x3 (nvidia-h200) eleventh session, run from the shell (results/step_options_h200.md): layers per loop iteration, the
#                       layer loop as one CUDA graph, chunks and fetch programs; x2 kept its traces (results/tail_h200.md)
#   y1  (nvidia-h200)   every GPU test but SmolLM2's after the layer_unroll change, the weight-copy guard's printed
#                       controls (-s), first half of the GGUF; the top-k's split programs in the 1M and 128k step
#   y2  (same machine)  second half; SmolLM2 GPU tests
#   z1  (nvidia-h200)   twelfth session, the row cache and the donated small leaves: every GPU test but SmolLM2's, first
#                       half of the GGUF; Fathom 48 attention-only at 1M and 128k with drifting queries, with and without a
#                       row cache of 16384 slots
#   z2  (same machine)  second half; SmolLM2 GPU tests; attention-only and full step at batch 8 @128k, the same two rows
#   z3  (nvidia-h200)   the row cache's winners decided after the layer scan: its GPU tests; batch 8 @128k attention-only
#                       (drifting queries, profiled) and full, batch 1 @128k attention-only, with and without 16384 slots
#   z4  (same machine)  the SmolLM2 4k test after z2's tolerance change (GGUF halves: z3 carries the first)
#   z5  (nvidia-h200)   the row cache's hits read through the row fetch kernel (only the hits' slots; reverted: no gain,
#                       the kernel's HBM reads took 14 ms per batch-8 step): its GPU tests and the guard's row-cache case;
#                       batch 8 @128k attention-only (profiled) and full, 1M attention-only
#   aa1 (nvidia-h200)   thirteenth session: the plane scan's channel loop unrolled (PlaneScanConfig.unroll): its GPU tests;
#                       the scan of one pipelined chunk per configuration; Fathom 48 attention-only at 1M and 128k with
#                       unroll 1 (the default), then with 4 patched into this machine's copy as the default
#   aa2 (nvidia-h200)   a pipelined chunk's row fetch ordered after the next chunk's scan (sparse_step.FETCH_AFTER_NEXT_SCAN):
#                       Fathom 48 attention-only at 1M and 128k with it (the default), then without (patched into this
#                       machine's copy)
#   aa3 (same machine)  the wait for the last chunk's scan only (FETCH_AFTER_NEXT_SCAN = "last", the default; aa2 ran
#                       "every" against "none"): Fathom 48 attention-only at 1M and 128k; every GPU test but SmolLM2's,
#                       first half of the GGUF
#   aa4 (same machine)  second half; SmolLM2 GPU tests
#   aa5-aa7 (nvidia-h200) run from the shell (commands in their JSON and logs): four methods side by side at 1M and
#                       128k (aa5); Fathom 48 at 1M profiled with the fetch order (aa6: its traces did not come back; aa7
#                       ran scripts/trace_gaps.py on the machine)
#   g3/g4 (nvidia-h200-x2) g1's and g2's benchmarks with the host allocator's limit near the cache's size: g1
#                       was killed holding 247 GB of pinned memory for a 171 GB cache (the allocator grows
#                       its pinned regions towards XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (GiB, per device), each
#                       region twice the last: planes 18 + 36 + K 72 GiB leave V a region of limit - 126)
# The GPU machine has JAX 0.11.2 but not gguf: carry its wheel in .whl/; SmolLM2's GGUF (98 MB, over one call's
# 64 MiB) travels in two halves, .carry1/ (a1) and .carry2/ (a2), joined on the machine (ignored paths persist
# between calls on a warm machine). Outputs go to $OUT.
set -uo pipefail
stage=${1:?stage: a1 .. f2, g1 .. g6, h1 or h2}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
mkdir -p /tmp/fathom_cache && export FATHOM_CACHE=/tmp/fathom_cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
case $stage in
a1)
  timeout 270 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_h200.log
  timeout 290 python3 scripts/bench_offload.py --tag h200_a1 --out $OUT --sections link,attn --contexts 1m,128k \
    --time-budget 280 2>&1 | tee $OUT/bench_a1.log ;;
a2)
  cat .carry1/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -k smollm2 tests/models/test_sparse.py 2>&1 | tee $OUT/gpu_smollm2_h200.log
  timeout 420 python3 scripts/bench_offload.py --tag h200_a2 --out $OUT --methods "Fathom 48" \
    --sections full,profile,batch,control,dense,prefill,attn --contexts 1m,128k,512k,32k --full-contexts 1m,128k \
    --attn-contexts 512k,32k --time-budget 410 2>&1 | tee $OUT/bench_a2.log ;;
b1)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_sharding.py tests/test_hlo.py 2>&1 | tee $OUT/gpu_tests_h200x2.log
  timeout 400 python3 scripts/bench_offload.py --tag h200x2_1gpu --out $OUT --mesh 1 --sections link,attn --contexts 1m,128k \
    --methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)" --share-kv-from 1m --time-budget 390 2>&1 | tee $OUT/bench_b1.log ;;
b2)
  timeout 560 python3 scripts/bench_offload.py --tag h200x2_2gpu --out $OUT --mesh 2 --sections link,attn --contexts 1m,128k \
    --methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)" --share-kv-from none --time-budget 550 2>&1 | tee $OUT/bench_b2.log ;;
c1)
  cp .carry1/smol.part1 /tmp/smol.part1
  timeout 230 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_h200.log
  timeout 200 python3 scripts/bench_offload.py --tag h200_c1 --out $OUT --methods "Fathom 48" --read staged \
    --sections batch,control --contexts 128k --batches 4,8 --time-budget 190 2>&1 | tee $OUT/bench_c1.log ;;
c2)
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  # The sweeps run from their own copy of the tree: the next call replaces the working tree under them.
  mkdir -p /tmp/sweeps/repo && tar --exclude=./.carry1 --exclude=./.carry2 --exclude=./.git -cf - . | tar -xf - -C /tmp/sweeps/repo
  cd /tmp/sweeps/repo && export PYTHONPATH=/tmp/site:/tmp/sweeps/repo
  # f32 matmuls at full precision (no TF32), memory grown on demand: four processes share the GPU.
  export JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_PREALLOCATE=false
  launch() { name=$1; shift; setsid nohup bash -c "$* > /tmp/sweeps/$name.log 2>&1; echo \$? > /tmp/sweeps/$name.rc" \
    < /dev/null > /dev/null 2>&1 & }
  launch ruler4k python3 -m fathom_jax.cli ruler --context 4096 --per-task 8 --batch 8 --out /tmp/sweeps/results
  launch ruler8k python3 -m fathom_jax.cli ruler --context 8192 --per-task 8 --batch 4 --out /tmp/sweeps/results
  launch agree4k python3 -m fathom_jax.cli agreement --context 4096 --sessions 40 --batch 8 --out /tmp/sweeps/results
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k smollm2 tests 2>&1 | tee $OUT/gpu_smollm2_h200.log
  bash scripts/gpu_session.sh wait 300 ;;
c3)
  bash scripts/gpu_session.sh wait 540 ;;
e1)  # (nvidia-h200) GPU tests after the planner / top-k changes; row fetch with a fresh row set per call; the
     # attention step of three methods at 1M (profiled) and Fathom 48 at 128k, side by side
  cp .carry1/smol.part1 /tmp/smol.part1
  (cat /sys/kernel/mm/transparent_hugepage/enabled; ls /sys/class/iommu 2>&1; grep -i -o 'iommu[^ ]*' /proc/cmdline) \
    > $OUT/system.txt 2>&1
  timeout 250 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_h200.log
  timeout 90 python3 scripts/bench_kernels.py --sections rowfetch --rowfetch-sizes 131072,1048576 \
    --name rowfetch_fresh_h200 --out $OUT 2>&1 | tee $OUT/bench_e1_rowfetch.log
  timeout 220 python3 scripts/bench_offload.py --tag h200_e1 --out $OUT --read staged \
    --methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)" --sections link,attn,attnprofile --contexts 1m \
    --share-kv-from 1m --time-budget 210 2>&1 | tee $OUT/bench_e1.log ;;
e2)  # (same machine) SmolLM2 GPU tests (the GGUF's second half joins the first); Fathom 48 at 128k, profiled
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k smollm2 tests 2>&1 | tee $OUT/gpu_smollm2_h200.log
  timeout 150 python3 scripts/bench_offload.py --tag h200_e2 --out $OUT --read staged --methods "Fathom 48" \
    --sections link,attn,attnprofile --contexts 128k --time-budget 140 2>&1 | tee $OUT/bench_e2.log ;;
f1)  # (nvidia-h200) GPU tests after dropping the scores' masking pass; three methods at 1M and 128k, profiled
  cp .carry1/smol.part1 /tmp/smol.part1
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_h200.log
  timeout 330 python3 scripts/bench_offload.py --tag h200_f1 --out $OUT --read staged \
    --methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)" --sections link,attn,attnprofile --contexts 1m,128k \
    --share-kv-from 1m --time-budget 320 2>&1 | tee $OUT/bench_f1.log ;;
f2)  # (same machine) SmolLM2 GPU tests
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k smollm2 tests 2>&1 | tee $OUT/gpu_smollm2_h200.log ;;
d1)  # (nvidia-h200) where the step's time goes: row fetch vs context, size and pattern; per-kernel profiles
  cp .carry1/smol.part1 /tmp/smol.part1
  timeout 170 python3 scripts/bench_kernels.py --sections rowfetch --tune --rowfetch-sizes 131072,1048576 \
    --name rowfetch_h200 --out $OUT 2>&1 | tee $OUT/bench_d1_rowfetch.log
  timeout 330 python3 scripts/bench_offload.py --tag h200_d1 --out $OUT --read staged --methods "Fathom 48" \
    --sections link,attn,attnprofile --contexts 1m,128k --share-kv-from 1m --time-budget 320 2>&1 | tee $OUT/bench_d1.log ;;
d2)  # (same machine) the contexts and rows issue 8 still lacks: 512k, 32k, dense offload
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=118
  timeout 560 python3 scripts/bench_offload.py --tag h200_d2 --out $OUT --read staged \
    --methods "Fathom 48,Fathom 64,SparQ r=16,32-channel (SparQ r=32)" --sections attn,dense \
    --contexts 512k,128k,32k --attn-contexts 512k,32k --share-kv-from 512k --time-budget 550 2>&1 | tee $OUT/bench_d2.log ;;
wait)  # wait up to $2 s for the sweeps, then copy their logs and results to $OUT
  for _ in $(seq ${2:-60}); do ls /tmp/sweeps/*.rc 2>/dev/null | wc -l | grep -q '^3$' && break; sleep 1; done
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  for f in /tmp/sweeps/*.log; do echo "== $f"; tail -c 1500 $f | tr '\r' '\n' | tail -8; done
  cat /tmp/sweeps/*.rc 2>/dev/null; mkdir -p $OUT/sweeps; cp /tmp/sweeps/*.log /tmp/sweeps/*.rc $OUT/sweeps/ 2>/dev/null
  cp -r /tmp/sweeps/results $OUT/sweeps/ 2>/dev/null; true ;;
g1)
  cp .carry1/smol.part1 /tmp/smol.part1
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_h200.log
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_sharding.py tests/test_hlo.py 2>&1 | tee $OUT/gpu_tests_h200x2.log
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=236
  timeout 330 python3 scripts/bench_offload.py --tag h200x2_g1 --out $OUT --mesh 1 --sections link,attn --contexts 1m \
    --methods "Fathom 48,32-channel (SparQ r=32)" --share-kv-from none --time-budget 320 2>&1 | tee $OUT/bench_g1.log ;;
g2)
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -k smollm2 tests/models/test_sparse.py 2>&1 | tee $OUT/gpu_smollm2_h200.log
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=236
  timeout 440 python3 scripts/bench_offload.py --tag h200x2_g2 --out $OUT --mesh 2 --sections link,attn --contexts 1m \
    --methods "Fathom 48,32-channel (SparQ r=32)" --share-kv-from none --time-budget 430 2>&1 | tee $OUT/bench_g2.log ;;
g3)
  cp .carry1/smol.part1 /tmp/smol.part1
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=205
  timeout 560 python3 scripts/bench_offload.py --tag h200x2_g3 --out $OUT --mesh 1 --sections link,attn --contexts 1m \
    --methods "Fathom 48,32-channel (SparQ r=32)" --share-kv-from none --time-budget 550 2>&1 | tee $OUT/bench_g3.log ;;
g4)
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -k smollm2 tests/models/test_sparse.py 2>&1 | tee $OUT/gpu_smollm2_h200.log
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=101
  timeout 470 python3 scripts/bench_offload.py --tag h200x2_g4 --out $OUT --mesh 2 --sections link,attn --contexts 1m \
    --methods "Fathom 48,32-channel (SparQ r=32)" --share-kv-from none --time-budget 460 2>&1 | tee $OUT/bench_g4.log ;;
g5)  # g3 + g4 after allocating K/V before the index (largest first: regions of 128 + 72 GiB for one GPU,
     # 64 + 36 per GPU for two), Fathom 48 only (device time)
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=201
  timeout 285 python3 scripts/bench_offload.py --tag h200x2_g5_1gpu --out $OUT --mesh 1 --sections link,attn --contexts 1m \
    --methods "Fathom 48" --share-kv-from none --time-budget 275 2>&1 | tee $OUT/bench_g5_1gpu.log
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=101
  timeout 285 python3 scripts/bench_offload.py --tag h200x2_g5_2gpu --out $OUT --mesh 2 --sections link,attn --contexts 1m \
    --methods "Fathom 48" --share-kv-from none --time-budget 275 2>&1 | tee $OUT/bench_g5_2gpu.log ;;
g6)  # the offload-path GPU tests after the K/V-first order; g5's 2-GPU run with room for the regions the link
     # measurement left (2 GiB buffers per GPU: BFC regions are never returned): 4 + 64 (K) + 37 (V) GiB per GPU
  CUDA_VISIBLE_DEVICES=0 timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests/test_sparse_step.py tests/test_hlo.py tests/models 2>&1 | tee $OUT/gpu_tests_offload_h200.log
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=106
  timeout 280 python3 scripts/bench_offload.py --tag h200x2_g6 --out $OUT --mesh 2 --sections link,attn --contexts 1m \
    --methods "Fathom 48" --share-kv-from none --steps 3 --time-budget 270 2>&1 | tee $OUT/bench_g6.log ;;
h1)  # (not yet run) 1M, every layer's own K/V, staged reads, on one GPU of the x2 machine: regions 2 (link) +
     # 128 (K, then planes) + 73 (V) GiB under a cap of 206 GiB (host_memory.check replays this)
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=206
  timeout 560 python3 scripts/bench_offload.py --tag h200x2_h1 --out $OUT --mesh 1 --read staged --sections link,attn \
    --contexts 1m --methods "Fathom 48,32-channel (SparQ r=32)" --share-kv-from none --time-budget 550 2>&1 | tee $OUT/bench_h1.log ;;
h2)  # (not yet run) the same cache on two GPUs, staged reads: 2 + 64 + 40 GiB of regions per GPU
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=106
  timeout 560 python3 scripts/bench_offload.py --tag h200x2_h2 --out $OUT --mesh 2 --read staged --sections link,attn \
    --contexts 1m --methods "Fathom 48,32-channel (SparQ r=32)" --share-kv-from none --time-budget 550 2>&1 | tee $OUT/bench_h2.log ;;
i1)  # (nvidia-h200-x2) GPU tests of the un-run changes (host_memory.check, both read modes, CLI --mesh/--read) on
     # one GPU and the sharding/HLO tests on both; row fetch from host memory: K and V split vs interleaved
  CUDA_VISIBLE_DEVICES=0 timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_h200.log
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_sharding.py tests/test_hlo.py tests/test_cli.py 2>&1 | tee $OUT/gpu_tests_h200x2.log
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 scripts/bench_kernels.py --sections rowlayout --rowfetch-sizes 131072,1048576 \
    --name rowlayout_h200 --out $OUT 2>&1 | tee $OUT/bench_i1_rowlayout.log ;;
j1)  # (nvidia-h200-x2) K and V side by side in one row (one run per fetched token): GPU tests on one GPU and the
     # sharding/HLO/CLI tests on both; f1's benchmark (three methods at 1M with shared K/V and 128k, profiled) on one GPU
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_h200.log
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_sharding.py tests/test_hlo.py tests/test_cli.py 2>&1 | tee $OUT/gpu_tests_h200x2.log
  CUDA_VISIBLE_DEVICES=0 timeout 250 python3 scripts/bench_offload.py --tag h200x2_j1 --out $OUT --read staged \
    --methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)" --sections link,attn,attnprofile --contexts 1m,128k \
    --share-kv-from 1m --time-budget 240 2>&1 | tee $OUT/bench_j1.log ;;
j2)  # (same machine) h1 with the side-by-side K/V: one 144 GiB array; regions 2 (link) + 164 GiB (host_memory)
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=170
  timeout 560 python3 scripts/bench_offload.py --tag h200x2_j2 --out $OUT --mesh 1 --read staged --sections link,attn \
    --contexts 1m --methods "Fathom 48,32-channel (SparQ r=32)" --share-kv-from none --time-budget 550 2>&1 | tee $OUT/bench_j2.log ;;
j3)  # (same machine) h2 with the side-by-side K/V: 2 + 82 GiB of regions per GPU
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=90
  timeout 560 python3 scripts/bench_offload.py --tag h200x2_j3 --out $OUT --mesh 2 --read staged --sections link,attn \
    --contexts 1m --methods "Fathom 48,32-channel (SparQ r=32)" --share-kv-from none --time-budget 550 2>&1 | tee $OUT/bench_j3.log ;;
k1)  # (nvidia-h200, run at b2532c2; that planner change was reverted: 21.9 vs 22.0 ms) planner rounds: GPU tests; Fathom 48 vs SparQ r=16 at 128k
  timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_planner.py tests/test_sparse_step.py 2>&1 | tee $OUT/gpu_tests_planner_h200.log
  timeout 150 python3 scripts/bench_offload.py --tag h200_k1 --out $OUT --methods "Fathom 48,SparQ r=16" \
    --sections link,attn,attnprofile --contexts 128k --time-budget 140 2>&1 | tee $OUT/bench_k1.log ;;
l1)  # (nvidia-h200) the planner as one Pallas launch per layer: GPU tests, then f1's benchmark
  cp .carry1/smol.part1 /tmp/smol.part1
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_h200.log
  timeout 330 python3 scripts/bench_offload.py --tag h200_l1 --out $OUT --read staged \
    --methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)" --sections link,attn,attnprofile --contexts 1m,128k \
    --share-kv-from 1m --time-budget 320 2>&1 | tee $OUT/bench_l1.log ;;
l2)  # (same machine) SmolLM2 GPU tests; the full step at batch 1, 4 and 8 @128k (issue 8's batch target)
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k smollm2 tests 2>&1 | tee $OUT/gpu_smollm2_h200.log
  timeout 330 python3 scripts/bench_offload.py --tag h200_l2 --out $OUT --methods "Fathom 48" --read staged \
    --sections link,full,batch --contexts 128k --batches 4,8 --time-budget 320 2>&1 | tee $OUT/bench_l2.log ;;
m1)  # (nvidia-h200, run at 124895f: the default limit was 32768, the variants then raised it) top-k tuning: does select_tokens gain from 32 warps or 32-token buckets?
  timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/pallas_kernels/test_topk.py 2>&1 | tee $OUT/gpu_tests_topk_h200.log
  timeout 400 python3 scripts/bench_kernels.py --sections topk --tune --name topk_tune_h200 --out $OUT 2>&1 | tee $OUT/bench_m1.log ;;
m2)  # (nvidia-h200) after raising the fused top-k's bucket limit: GPU tests, then two methods at 1M and 128k
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_h200.log
  timeout 300 python3 scripts/bench_offload.py --tag h200_m2 --out $OUT --read staged \
    --methods "Fathom 48,SparQ r=16" --sections link,attn,attnprofile --contexts 1m,128k \
    --share-kv-from 1m --time-budget 290 2>&1 | tee $OUT/bench_m2.log ;;
n1)  # (nvidia-h200) the run gather is 0.87 of the link at 1M (46.4 ms of 2.2 GB): chunk and warps
  timeout 300 python3 scripts/bench_kernels.py --sections gather --tune --name gather_tune_h200 --out $OUT 2>&1 | tee $OUT/bench_n1.log ;;
n2)  # (nvidia-h200) the plane-word write launched 147k programs of 8 bytes; now 64 rows per program
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests/pallas_kernels/test_cache_write.py \
    tests/test_hlo.py tests/test_sparse_step.py tests/models/test_sparse.py 2>&1 | tee $OUT/gpu_tests_n2_h200.log
  timeout 200 python3 scripts/bench_offload.py --tag h200_n2 --out $OUT --read staged --methods "Fathom 48" \
    --sections link,attn,attnprofile --contexts 1m,128k --share-kv-from 1m --time-budget 190 2>&1 | tee $OUT/bench_n2.log ;;
n3)  # (nvidia-h200-x2) sharded decoding natively after this session's planner and top-k changes
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_sharding.py tests/test_hlo.py tests/test_cli.py 2>&1 | tee $OUT/gpu_tests_h200x2.log ;;
o1)  # (nvidia-h200) the groups of a layer split over GPU streams: one chunk's plane transfer under another's kernels
  timeout 230 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_h200.log
  timeout 340 python3 scripts/bench_offload.py --tag h200_o1 --out $OUT --read staged --methods "Fathom 48" \
    --streams 1,2,4 --sections link,attn,attnprofile --contexts 1m,128k --share-kv-from 1m --time-budget 330 \
    2>&1 | tee $OUT/bench_o1.log ;;
o2)
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_sparse_step.py tests/test_hlo.py 2>&1 | tee $OUT/gpu_tests_o2_h200.log
  timeout 400 python3 scripts/bench_offload.py --tag h200_o2 --out $OUT --read staged --methods "Fathom 48" \
    --streams 1,2,4 --sections link,attn,attnprofile --contexts 1m,128k --share-kv-from 1m --time-budget 390 \
    2>&1 | tee $OUT/bench_o2.log ;;
o3)
  timeout 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_sparse_step.py tests/test_hlo.py 2>&1 | tee $OUT/gpu_tests_o3_h200.log
  timeout 400 python3 scripts/bench_offload.py --tag h200_o3 --out $OUT --read staged --methods "Fathom 48" \
    --streams 1,2,4 --sections link,attn,attnprofile --contexts 1m,128k --share-kv-from 1m --time-budget 390 \
    2>&1 | tee $OUT/bench_o3.log ;;
o4)
  timeout 200 python3 scripts/bench_offload.py --tag h200_o4a --out $OUT --read staged --methods "Fathom 48" \
    --streams 1,2 --sections attn,attnprofile --contexts 1m --share-kv-from 1m --time-budget 190 2>&1 | tee $OUT/bench_o4a.log
  XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_experimental_stream_annotation=true" timeout 200 \
    python3 scripts/bench_offload.py --tag h200_o4b --out $OUT --read staged --methods "Fathom 48" \
    --streams 1,2 --sections attn,attnprofile --contexts 1m --share-kv-from 1m --time-budget 190 2>&1 | tee $OUT/bench_o4b.log ;;
o5)
  timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_sparse_step.py tests/test_hlo.py 2>&1 | tee $OUT/gpu_tests_o5_h200.log
  timeout 430 python3 scripts/bench_offload.py --tag h200_o5 --out $OUT --read staged \
    --methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)" --index-writes every_step,full_blocks \
    --sections link,attn,attnprofile --contexts 1m,128k --share-kv-from 1m --time-budget 420 2>&1 | tee $OUT/bench_o5.log ;;
p1)
  timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider tests/pallas_kernels/test_run_gather.py \
    tests/test_sparse_step.py tests/test_hlo.py 2>&1 | tee $OUT/gpu_tests_p1_h200.log
  timeout 400 python3 scripts/bench_offload.py --tag h200_p1 --out $OUT --read staged --methods "Fathom 48" \
    --index-writes full_blocks --pipeline 1,1/132,2/132,4/132,8/0,8/132,8/264 --sections link,attn,attnprofile \
    --contexts 1m,128k --share-kv-from 1m --time-budget 390 2>&1 | tee $OUT/bench_p1.log ;;
p2)
  timeout 300 python3 scripts/bench_offload.py --tag h200_p2a --out $OUT --read staged --methods "Fathom 48" \
    --index-writes full_blocks --pipeline 1,8/132,8/66,8/33,4/66,2/66 --sections link,attn,attnprofile \
    --contexts 1m,128k --share-kv-from 1m --time-budget 290 2>&1 | tee $OUT/bench_p2a.log
  timeout 260 python3 scripts/bench_offload.py --tag h200_p2b --out $OUT --read staged \
    --methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)" --index-writes every_step,full_blocks --pipeline 1,8/132 \
    --sections attn --contexts 1m --share-kv-from 1m --time-budget 250 2>&1 | tee $OUT/bench_p2b.log ;;
q1)
  timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_q1_h200.log
  timeout 280 python3 scripts/bench_offload.py --tag h200_q1 --out $OUT --read staged \
    --methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)" --index-writes every_step,full_blocks --pipeline auto,1/0 \
    --sections link,attn,attnprofile --contexts 1m --share-kv-from 1m --time-budget 270 2>&1 | tee $OUT/bench_q1.log ;;
q2)
  cat .carry1/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -k smollm2 tests 2>&1 | tee $OUT/gpu_smollm2_q2_h200.log
  timeout 230 python3 scripts/bench_offload.py --tag h200_q2 --out $OUT --read staged \
    --methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)" --index-writes every_step,full_blocks --pipeline auto,1/0 \
    --sections link,attn --contexts 128k --time-budget 220 2>&1 | tee $OUT/bench_q2.log ;;
r1)
  cp .carry1/smol.part1 /tmp/smol.part1
  CUDA_VISIBLE_DEVICES=0 timeout 210 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_r1_h200.log
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_sharding.py tests/test_hlo.py tests/test_cli.py 2>&1 | tee $OUT/gpu_tests_r1_h200x2.log
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=170
  timeout 240 python3 scripts/bench_offload.py --tag h200x2_r1 --out $OUT --mesh 1 --read staged --sections link,attn \
    --contexts 1m --methods "Fathom 48,32-channel (SparQ r=32)" --index-writes every_step,full_blocks --share-kv-from none \
    --time-budget 230 2>&1 | tee $OUT/bench_r1.log ;;
r2)
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 230 python3 -m pytest -m gpu -q -s -p no:cacheprovider -k smollm2 tests/models/test_sparse.py 2>&1 | tee $OUT/gpu_smollm2_r2_h200x2.log
  export XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=90
  timeout 320 python3 scripts/bench_offload.py --tag h200x2_r2 --out $OUT --mesh 2 --read staged --sections link,attn \
    --contexts 1m --methods "Fathom 48,32-channel (SparQ r=32)" --index-writes every_step,full_blocks --share-kv-from none \
    --time-budget 310 2>&1 | tee $OUT/bench_r2.log ;;
s1)
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_hlo.py tests/test_decode.py tests/test_sparse_step.py \
    tests/pallas_kernels/test_cache_write.py 2>&1 | tee $OUT/gpu_tests_s1_h200.log
  timeout 130 python3 scripts/bench_offload.py --tag h200_s1a --out $OUT --read staged --sections link,attn --contexts 1m \
    --methods "Fathom 48" --index-writes every_step,full_blocks --scan-writes 1,0 \
    --share-kv-from 1m --time-budget 120 2>&1 | tee $OUT/bench_s1a.log
  timeout 130 python3 scripts/bench_offload.py --tag h200_s1b --out $OUT --read staged --sections attn --contexts 1m \
    --methods "SparQ r=16,32-channel (SparQ r=32)" --index-writes every_step,full_blocks \
    --share-kv-from 1m --time-budget 120 2>&1 | tee $OUT/bench_s1b.log
  timeout 120 python3 scripts/bench_offload.py --tag h200_s1c --out $OUT --read staged --sections attn --contexts 128k \
    --methods "Fathom 48,SparQ r=16" --index-writes every_step --scan-writes 1,0 --time-budget 110 2>&1 | tee $OUT/bench_s1c.log ;;
t1)
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_decode.py 2>&1 | tee $OUT/gpu_tests_t1_h200.log
  timeout 290 python3 -m pytest -q -p no:cacheprovider --durations=12 tests/test_sharding.py tests/test_hlo.py tests/test_cli.py 2>&1 \
    | tee $OUT/gpu_tests_t1_h200x2.log ;;
t2)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rA tests/test_decode.py -k "index_after" 2>&1 | grep -v "^E  \|^  \|^ *$" | tail -40 ;;
u2)
  timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider tests/pallas_kernels/test_topk.py tests/pallas_kernels/test_row_fetch.py \
    2>&1 | tee $OUT/gpu_tests_u2_h200.log | tail -5
  timeout 200 python3 scripts/bench_kernels.py --out $OUT --name kernels_u2_h200 --sections topksplit,roworder 2>&1 \
    | tee $OUT/kernels_u2.log | grep -v "^ " | tail -60
  timeout 230 python3 scripts/step_hlo.py --context 32k --batch 8 --out /tmp/hlo --tag u2 \
    --option xla_gpu_enable_dynamic_slice_fusion=true 2>&1 | tee $OUT/step_hlo_u2.log | cut -c1-260 | grep -v "^  File\|^    "
  cp /tmp/hlo/step_u2.json $OUT/; gzip -c /tmp/hlo/step_u2_0.hlo.txt > $OUT/step_u2_0.hlo.txt.gz
  gzip -c /tmp/hlo/step_u2_1.hlo.txt > $OUT/step_u2_1.hlo.txt.gz ;;
u3)
  cp .carry1/smol.part1 /tmp/smol.part1
  timeout 270 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_u3_h200.log | tail -4
  timeout 70 python3 -m pytest -q -p no:cacheprovider -rA tests/test_decode.py -k "index_after and device" 2>&1 \
    | tee $OUT/gpu_tests_u3_index_hbm.log | grep -E "PASSED|FAILED|differ|passed|failed" | head -20
  timeout 200 python3 scripts/bench_offload.py --tag h200_u3 --out $OUT --read staged --sections link,attn --contexts 1m \
    --methods "Fathom 48" --fetch-programs auto,0 --topk auto,single --share-kv-from 1m --time-budget 190 2>&1 \
    | tee $OUT/bench_u3.log | cut -c1-330 ;;
u4)
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -k smollm2 tests 2>&1 | tee $OUT/gpu_smollm2_u4_h200.log | tail -4
  timeout 170 python3 scripts/bench_offload.py --tag h200_u4a --out $OUT --read staged --sections link,full,batch \
    --contexts 128k --full-contexts 128k --batches 8 --methods "Fathom 48" --share-kv-from 512k --time-budget 160 \
    --xla-options "none;xla_gpu_enable_triton_gemm=false,xla_gpu_enable_dynamic_slice_fusion=true" 2>&1 \
    | tee $OUT/bench_u4a.log | cut -c1-330
  timeout 220 python3 scripts/bench_offload.py --tag h200_u4b --out $OUT --read staged --sections attn --contexts 1m \
    --methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)" --index-writes every_step,full_blocks --share-kv-from 1m \
    --time-budget 210 2>&1 | tee $OUT/bench_u4b.log | cut -c1-330 ;;
u5)
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests/test_hlo.py tests/test_decode.py \
    tests/models/test_sparse.py 2>&1 | tee $OUT/gpu_tests_u5_h200.log | tail -3
  timeout 130 python3 scripts/bench_offload.py --tag h200_u5 --out /tmp/u5 --read staged --sections full,profile \
    --contexts 1m --full-contexts 1m --methods "Fathom 48" --share-kv-from 1m --time-budget 120 2>&1 \
    | tee $OUT/bench_u5.log | cut -c1-330; cp /tmp/u5/offload_h200_u5.json /tmp/u5/offload_h200_u5.md $OUT/ ;;
v1)
  cp .carry1/smol.part1 /tmp/smol.part1
  timeout 120 python3 scripts/bench_kernels.py --out $OUT --name kernels_v1_h200 --sections union 2>&1 \
    | tee $OUT/kernels_v1.log | grep -v "^ " | tail -12
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_v1_h200.log | tail -6
  timeout 130 python3 scripts/bench_offload.py --tag h200_v1a --out $OUT --read staged --sections link,attn --contexts 128k \
    --methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)" --index-writes every_step,full_blocks --time-budget 120 2>&1 \
    | tee $OUT/bench_v1a.log | cut -c1-330
  timeout 80 python3 scripts/bench_offload.py --tag h200_v1b --out $OUT --read staged --sections attn,attnprofile \
    --contexts 128k --methods "Fathom 48" --time-budget 70 2>&1 | tee $OUT/bench_v1b.log | cut -c1-330 ;;
v2)
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 170 python3 -m pytest -m gpu -q -p no:cacheprovider -k smollm2 tests 2>&1 | tee $OUT/gpu_smollm2_v2_h200.log | tail -4
  timeout 150 python3 scripts/bench_offload.py --tag h200_v2a --out $OUT --read staged --sections attn --contexts 1m \
    --methods "Fathom 48,SparQ r=16,32-channel (SparQ r=32)" --index-writes every_step,full_blocks --share-kv-from 1m \
    --time-budget 140 2>&1 | tee $OUT/bench_v2a.log | cut -c1-330
  timeout 200 python3 scripts/bench_offload.py --tag h200_v2b --out $OUT --read staged --sections link,full,batch,profile \
    --contexts 128k --full-contexts 128k --batches 8 --methods "Fathom 48" --fetch-programs auto,132 \
    --share-kv-from 512k --time-budget 190 2>&1 | tee $OUT/bench_v2b.log | cut -c1-330 ;;
v5)
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not smollm2" tests/test_hlo.py tests/models/test_sparse.py \
    tests/test_decode.py 2>&1 | tee $OUT/gpu_tests_v5_h200.log | tail -4
  timeout 110 python3 scripts/bench_offload.py --tag h200_v5 --out /tmp/v5 --read staged --sections attn,attnprofile \
    --contexts 1m --methods "Fathom 48" --share-kv-from 1m --time-budget 100 2>&1 | tee $OUT/bench_v5.log | cut -c1-330
  cp /tmp/v5/offload_h200_v5.json /tmp/v5/offload_h200_v5.md $OUT/ ;;
y1)
  cp .carry1/smol.part1 /tmp/smol.part1
  timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_y1_h200.log | tail -8
  timeout 80 python3 -m pytest -m gpu -q -s -p no:cacheprovider -k weights_in_place tests/test_hlo.py 2>&1 \
    | tee $OUT/gpu_guard_y1_h200.log | grep -E "^with|passed|failed"
  timeout 170 python3 scripts/bench_offload.py --tag h200_y1 --out $OUT --read staged --sections attn --contexts 1m,128k \
    --methods "Fathom 48" --share-kv-from 1m --topk auto,b8t4,b16t4,b8t8,bautot8 --time-budget 160 2>&1 \
    | tee $OUT/bench_y1.log | cut -c1-330 ;;
y2)
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k smollm2 tests 2>&1 | tee $OUT/gpu_smollm2_y2_h200.log | tail -4 ;;
z1)
  cp .carry1/smol.part1 /tmp/smol.part1
  timeout 330 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_z1_h200.log | tail -8
  timeout 200 python3 scripts/bench_offload.py --tag h200_z1 --out $OUT --read staged --sections link,attn --contexts 1m,128k \
    --methods "Fathom 48" --share-kv-from 1m --query-drift 0.95 --row-cache 0,16384 --time-budget 190 2>&1 \
    | tee $OUT/bench_z1.log | cut -c1-400 ;;
z2)
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k smollm2 tests 2>&1 | tee $OUT/gpu_smollm2_z2_h200.log | tail -4
  timeout 330 python3 scripts/bench_offload.py --tag h200_z2 --out $OUT --read staged --sections link,attnbatch,batch \
    --contexts 128k --batches 8 --methods "Fathom 48" --share-kv-from 512k --query-drift 0.95 --row-cache 0,16384 \
    --time-budget 320 2>&1 | tee $OUT/bench_z2.log | cut -c1-400 ;;
z3)
  cp .carry1/smol.part1 /tmp/smol.part1
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -k "row_cache" tests 2>&1 | tee $OUT/gpu_tests_z3_h200.log | tail -4
  timeout 400 python3 scripts/bench_offload.py --tag h200_z3 --out $OUT --read staged --sections link,attnbatch,attn,batch,attnprofile \
    --contexts 128k --attn-contexts 128k --batches 8 --methods "Fathom 48" --share-kv-from 512k --query-drift 0.95 \
    --row-cache 0,16384 --time-budget 390 2>&1 | tee $OUT/bench_z3.log | cut -c1-400 ;;
z4)
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -k "smollm2 and 4096" tests 2>&1 | tee $OUT/gpu_smollm2_z4_h200.log | tail -4 ;;
z5)
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -k "row_cache or (reads_the_host_cache_in_place and 256)" \
    tests 2>&1 | tee $OUT/gpu_tests_z5_h200.log | tail -3
  timeout 420 python3 scripts/bench_offload.py --tag h200_z5 --out $OUT --read staged --sections link,attnbatch,batch,attn,attnprofile \
    --contexts 128k,1m --attn-contexts 1m --batches 8 --methods "Fathom 48" --share-kv-from 512k --query-drift 0.95 \
    --row-cache 0,16384 --time-budget 410 2>&1 | tee $OUT/bench_z5.log | cut -c1-400 ;;
aa1)
  timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/pallas_kernels/test_plane_scan.py 2>&1 \
    | tee $OUT/gpu_tests_aa1_h200.log | tail -3
  timeout 150 python3 scripts/bench_kernels.py --sections scanchunk --name scanchunk_h200 --out $OUT 2>&1 \
    | tee $OUT/bench_kernels_aa1.log | grep "scan chunk"
  for unroll in 1 4; do
    if [ $unroll = 4 ]; then  # this machine's copy only
      sed -i 's/^    unroll: int = 1$/    unroll: int = 4/' pallas_kernels/plane_scan.py
      grep -n "^    unroll: int = 4" pallas_kernels/plane_scan.py || exit 1
    fi
    timeout 170 python3 scripts/bench_offload.py --tag h200_aa1_u$unroll --out $OUT --read staged --sections link,attn \
      --contexts 1m,128k --methods "Fathom 48" --share-kv-from 1m --time-budget 160 2>&1 \
      | tee $OUT/bench_aa1_u$unroll.log | cut -c1-330
  done ;;
aa2)
  for order in after_scan beside; do
    if [ $order = beside ]; then  # this machine's copy only
      sed -i 's/^FETCH_AFTER_NEXT_SCAN = True$/FETCH_AFTER_NEXT_SCAN = False/' fathom_jax/sparse_step.py  # then a bool
      grep -n "^FETCH_AFTER_NEXT_SCAN = False" fathom_jax/sparse_step.py || exit 1
    fi
    timeout 200 python3 scripts/bench_offload.py --tag h200_aa2_$order --out $OUT --read staged --sections link,attn \
      --contexts 1m,128k --methods "Fathom 48" --share-kv-from 1m --time-budget 190 2>&1 \
      | tee $OUT/bench_aa2_$order.log | cut -c1-330
  done ;;  # the next call's copy of the tree brings the repository's sparse_step.py back
aa3)
  cp .carry1/smol.part1 /tmp/smol.part1
  timeout 150 python3 scripts/bench_offload.py --tag h200_aa3_last --out $OUT --read staged --sections attn \
    --contexts 1m,128k --methods "Fathom 48" --share-kv-from 1m --time-budget 140 2>&1 \
    | tee $OUT/bench_aa3_last.log | cut -c1-330
  timeout 380 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_aa3_h200.log | tail -8 ;;
aa4)
  cat /tmp/smol.part1 .carry2/smol.part2 > $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum $FATHOM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 250 python3 -m pytest -m gpu -q -p no:cacheprovider -k smollm2 tests 2>&1 | tee $OUT/gpu_smollm2_aa4_h200.log | tail -4 ;;
w1)
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rs -k "not smollm2" tests 2>&1 | tee $OUT/gpu_tests_w1_h200.log | tail -6
  for union in sort sorted_heads; do
    if [ $union = sorted_heads ]; then  # this machine's copy only: the repository keeps the sort
      sed -i 's/group_union(idx, mask)$/group_union(idx, mask, sorted_heads=implementation == "pallas")/' fathom_jax/sparse_step.py
      grep -n "sorted_heads=implementation" fathom_jax/sparse_step.py || exit 1
    fi
    timeout 130 python3 scripts/bench_offload.py --tag h200_w1_$union --out /tmp/w1_$union --read staged \
      --sections attn,attnprofile --contexts 1m,128k --methods "Fathom 48" --share-kv-from 1m --time-budget 120 2>&1 \
      | tee $OUT/bench_w1_$union.log | cut -c1-330
    cp /tmp/w1_$union/*.json /tmp/w1_$union/*.md $OUT/
  done ;;  # the next call's copy of the tree brings the repository's sparse_step.py back
o6)
  timeout 200 python3 scripts/bench_offload.py --tag h200_o6 --out $OUT --read staged \
    --methods "32-channel (SparQ r=32),SparQ r=16" --index-writes every_step,full_blocks \
    --sections link,attn --contexts 1m --share-kv-from 1m --time-budget 190 2>&1 | tee $OUT/bench_o6.log ;;
esac
