"""The zero-copy guard: host-array copies are found in compiled HLO (parser on CPU, real programs on GPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx

from fathom_jax import decode
from fathom_jax.decode import StepConfig
from fathom_jax.hlo import device_copies, hlo_collectives, host_array_copies, kernel_launches, trip_counts
from fathom_jax.models import generation

SNIPPET = """
ENTRY %main (p0: u32[36,8,128,4,32768], p1: f32[8,4,128]) -> f32[8,4,1048576] {
  %p0 = u32[36,8,128,4,32768]{4,3,2,1,0:S(5)} parameter(0)
  %gte = u32[36,8,128,4,32768]{4,3,2,1,0:S(5)} get-tuple-element((u32[36,8,128,4,32768]{4,3,2,1,0:S(5)}) %t), index=0
  %ok = f32[8,4,1048576]{2,1,0} custom-call(u32[36,8,128,4,32768]{4,3,2,1,0:S(5)} %p0, f32[8,4,128]{2,1,0} %p1), custom_call_target="__gpu$xla.gpu.triton"
  %bad = (u32[36,8,128,4,32768]{4,3,2,1,0:S(5)}, u32[36,8,128,4,32768]{4,3,2,1,0}, u32[]) copy-start(u32[36,8,128,4,32768]{4,3,2,1,0:S(5)} %p0)
  %small = u32[4]{0} copy(u32[4]{0:S(5)} %x)
  %cs = ((u32[36,8,128,4,32768]{4,3,2,1,0:S(5)}), f32[4,4,128]{2,1,0}) call-start(u32[36,8,128,4,32768]{4,3,2,1,0:S(5)} %p0), async_execution_thread="main", to_apply=%wrapped
  %cd = f32[4,4,128]{2,1,0} call-done(((u32[36,8,128,4,32768]{4,3,2,1,0:S(5)}), f32[4,4,128]{2,1,0}) %cs)
  %slice = u32[1,8,128,4,32768]{4,3,2,1,0} dynamic-slice(u32[36,8,128,4,32768]{4,3,2,1,0:S(5)} %p0, s32[] %i, s32[] %z, s32[] %z, s32[] %z, s32[] %z), dynamic_slice_sizes={1,8,128,4,32768}
  ROOT %out = u32[36,8,128,4,32768]{4,3,2,1,0:S(5)} custom-call(u32[36,8,128,4,32768]{4,3,2,1,0:S(5)} %p0), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{}: (0, {})}
}
"""


def test_parser_flags_copies_slices_and_host_outputs_of_large_host_arrays():
    found = host_array_copies(SNIPPET)
    assert len(found) == 3  # not the call-start/done of a computation on another stream (it passes the array on)
    assert "copy-start" in found[0] and "dynamic-slice" in found[1]
    assert "output_to_operand_aliasing" in found[2]  # a kernel returning a host array: XLA copies into a new one
    assert host_array_copies(SNIPPET.replace("S(5)", "S(1)")) == []


# Lines of run u2's compiled full step (H200, Qwen3-8B shapes, Triton GEMMs): the layer scan's body copies a layer's
# MLP weight out of the stacked [36, ...] array as an async dynamic-slice fusion; the dynamic-update-slice of the
# scan's stacked output is in place; the slice inside a fused computation is not work of its own.
WEIGHT_COPY_SNIPPET = """
%fused_slice (p0: bf16[36,64,64], p1: s32[]) -> bf16[1,64,64] {
  %p0 = bf16[36,64,64]{2,1,0} parameter(0)
  %inner = bf16[1,4096,12288]{2,1,0} dynamic-slice(bf16[36,4096,12288]{2,1,0} %p0, s32[] %p1, s32[] %z, s32[] %z), dynamic_slice_sizes={1,4096,12288}
}

%body.1 (arg: (s32[], bf16[36,4096,12288])) -> (s32[], bf16[36,4096,12288]) {
  %fusion-start.9 = ((bf16[36,4096,12288]{2,1,0}, s32[]), bf16[1,4096,12288]{2,1,0}, u32[]) fusion-start(%get-tuple-element.175, %get-tuple-element.146), kind=kLoop, calls=%fused_dynamic_slice.5.clone, metadata={op_name="jit(step_fn)/while/body/jit(dynamic_index_in_dim)/dynamic_slice" deduplicated_name="loop_dynamic_slice_fusion.5" scheduling_name="fusion-start.9" stack_frame_id=125}
  %fusion-done.9 = bf16[1,4096,12288]{2,1,0} fusion-done(%fusion-start.9), metadata={op_name="jit(step_fn)/while/body/jit(dynamic_index_in_dim)/dynamic_slice" deduplicated_name="loop_dynamic_slice_fusion.5" scheduling_name="fusion-done.9" stack_frame_id=125}
  %fusion-start.6 = ((s32[], f32[64,128,64]{2,1,0}, f32[36,64,64,128]{2,3,1,0}), f32[36,64,128,64]{3,2,1,0}, u32[]) fusion-start(%get-tuple-element.146, %input_scatter_fusion.2, %get-tuple-element.148), kind=kLoop, calls=%fused_dynamic_update_slice.clone, metadata={op_name="jit(step_fn)/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice" scheduling_name="fusion-start.6" stack_frame_id=125}
  %fusion-done.6 = f32[36,64,128,64]{3,2,1,0} fusion-done(%fusion-start.6), metadata={op_name="jit(step_fn)/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice" scheduling_name="fusion-done.6" stack_frame_id=125}
  %custom-call.9 = (f32[32,2048,4]{1,2,0}, s8[33554432]{0}) custom-call(%wrapped_convert.2, %bitcast.486), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step_fn)/while/body/eval_jaxpr/...gd,...gmd->...gm/dot_general" scheduling_name="custom-call.9" stack_frame_id=342}
  %dynamic_slice_fusion.4 = (bf16[8,512]{1,0}, s8[33554432]{0}) fusion(bf16[36,12288,512]{2,1,0} %w3, bf16[8,12288]{1,0} %x, s32[] %i), kind=kCustom, calls=%address_computation, backend_config={"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":{"name":"dynamic_address_computation"}}}
  %loop_dynamic_slice_fusion.3 = bf16[1,64,64]{2,1,0} fusion(bf16[36,64,64]{2,1,0} %w, s32[] %i), kind=kLoop, calls=%fused_slice
  %copy.2 = bf16[4096,4096]{0,1} copy(bf16[4096,4096]{1,0} %w2)
}

ENTRY %main (p0: bf16[36,4096,12288]) -> bf16[36,4096,12288] {
  %p0 = bf16[36,4096,12288]{2,1,0} parameter(0)
  ROOT %while = (s32[], bf16[36,4096,12288]{2,1,0}) while((s32[], bf16[36,4096,12288]{2,1,0}) %t), condition=%cond, body=%body.1
}
"""


def test_device_copies_finds_a_layers_weight_slice_and_plain_copies():
    """The async slice of a layer's weight counts once (at its done: the start's shape holds the 3.6 GB stack),
    a plain copy counts, and neither the in-place update of the scan's output, the cuBLAS calls (one reading its
    weight slice in place under XLA's dynamic-slice fusion: run v1), a small slice nor a slice inside a fused
    computation does."""
    found = device_copies(WEIGHT_COPY_SNIPPET)
    assert [(i["name"], i["bytes"]) for i in found] == [("fusion-done.9", 4096 * 12288 * 2), ("copy.2", 4096 * 4096 * 2)]
    assert found[0]["op"].endswith("/dynamic_slice") and found[0]["computation"] == "body.1"
    small = device_copies(WEIGHT_COPY_SNIPPET, min_bytes=4096)
    assert [i["name"] for i in small] == ["fusion-done.9", "copy.2", "loop_dynamic_slice_fusion.3"]
    assert device_copies(WEIGHT_COPY_SNIPPET.replace("dynamic_slice", "dot").replace("copy", "negate")) == []


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("read,writes,pipeline,row_cache", [
    ("direct", "every_step", 1, 0), ("staged", "every_step", 1, 0), ("staged", "full_blocks", 1, 0),
    ("staged", "full_blocks", 2, 0), ("staged", "every_step", 2, 256)])
def test_compiled_decode_step_reads_the_host_cache_in_place(tiny_config, tiny_model, read, writes, pipeline, row_cache):
    """The compiled offloaded decode step has no host-to-device (or host-to-host) copy of the store or K/V,
    whether the plane scan reads host memory itself or the run gather stages the planned runs, and when the
    groups are split into pipelined chunks (compiled with their CUDA-graph option); each layer writes its new row and
    blocks inside the layer scan. With a row cache in HBM, the step updates it in place (its small leaves are
    donated): no copy of it either."""
    step = StepConfig(read=read, index_writes=writes, pipeline=pipeline, gather_programs=64 if pipeline > 1 else 0,
                      row_cache=row_cache)
    attn = decode.from_spec("fathom:16", k=64, calibration="session", placement="pinned_host", step=step,
                            implementation="triton")
    prompt = np.random.default_rng(0).integers(0, 97, (2, 1000)).astype(np.int32)
    logits, cache, attn = generation.prefill(tiny_model, prompt, np.array([1000, 900]), attn, 4096)
    assert cache.kv.sharding.memory_kind == "pinned_host"
    assert cache.index["raw"].planes.sharding.memory_kind == "pinned_host"
    _, state = nnx.split(tiny_model)
    tokens = jnp.argmax(logits, -1).astype(jnp.int32)
    text = generation.decode_step_program(tiny_model, cache, attn).lower(state, tokens, None, cache=cache).compile().as_text()
    assert "S(5)" in text, "the compiled step has no host-memory operands: the cache is not offloaded"
    copies = host_array_copies(text, min_bytes=1 << 16)
    assert copies == [], "the decode step copies host-resident cache arrays:\n" + "\n".join(copies)
    if row_cache:
        whole = device_copies(text, min_bytes=cache.row_cache.rows.nbytes)
        assert whole == [], "the decode step copies its row cache:\n" + "\n".join(map(str, whole))
    # and the cache is really written: the next step sees the new token's K row in host memory
    block = np.asarray(cache.index["raw"].planes[:, 0, :, :, 30:32])  # sequence 0's partial block 15 (tokens 960..1000)
    nxt, _, cache2 = generation.decode_step(tiny_model, tokens, cache, attn)
    assert cache2.kv is cache.kv  # the same host array, updated in place
    assert np.abs(np.asarray(cache2.k[:, 0, 1000])).max() > 0 and np.abs(np.asarray(cache2.k[:, 0, 1001])).max() == 0
    after = np.asarray(cache2.index["raw"].planes[:, 0, :, :, 30:32])
    if writes == "full_blocks":  # the step left the partial block to the tail; flush writes it
        np.testing.assert_array_equal(after, block)
        flushed = np.asarray(decode.flush(cache2, attn).index["raw"].planes[:, 0, :, :, 30:32])
        assert (flushed != block).any()
    else:
        assert (after != block).any()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("memory", ["pinned_host", "device"])
def test_compiled_decode_step_reads_each_layers_weights_in_place(memory):
    """The compiled decode step (offloaded: one step; in device memory: the decode loop) copies no layer's weights
    out of the stacked arrays: under :data:`generation.WEIGHT_GEMM_OPTIONS` its GEMMs are cuBLAS calls that read the
    slices in place. A bf16 model whose per-layer weights (0.5-1.5 MB) and device-memory cache (1-8 MB: the loop
    takes it donated, a copy of all of it was seen without) are its only device arrays of 256 kB or more."""
    from fathom_jax.models.config import LlamaConfig
    from fathom_jax.models.llama import LlamaForCausalLM

    cfg = LlamaConfig(vocab=97, hidden=512, intermediate=1536, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=64,
                      rope_theta=1e4, rms_norm_eps=1e-6, qk_norm=True)
    model = LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    attn = decode.from_spec("fathom:16", k=64, calibration="session", placement=memory, implementation="triton")
    prompt = np.random.default_rng(0).integers(0, 97, (2, 1000)).astype(np.int32)
    logits, cache, attn = generation.prefill(model, prompt, np.array([1000, 900]), attn, 4096)
    graphdef, state = nnx.split(model)
    tokens = jnp.argmax(logits, -1).astype(jnp.int32)

    def compiled(extra, **fields):  # the program decode_step / decode_loop runs, with ``extra`` XLA options (and
        # other ``fields``) of the step configuration
        with_extra = dataclasses.replace(attn, step=dataclasses.replace(attn.step, xla_options=extra, **fields))
        with_extra = with_extra.bind(decode.cache_shape(cache))
        if memory == "pinned_host":
            run = generation.decode_step_program(model, cache, with_extra)
            return run.lower(state, tokens, None, cache=cache).compile().as_text()
        program = generation.decode_loop_program(with_extra.compiler_options)
        return program.lower(graphdef, state, with_extra, tokens, cache, 3).compile().as_text()

    text = compiled({})  # the programs' own options (WEIGHT_GEMM_OPTIONS on a GPU)
    copies = device_copies(text, min_bytes=256 << 10)
    assert "__cublas$" in text, "the decode step's weight GEMMs are not cuBLAS calls"
    assert copies == [], "the decode step copies layer weights:\n" + "\n".join(
        f"{i['name']} {i['opcode']} {i['bytes']} B {i['shape']} {i['op']}" for i in copies)
    # The control: Triton GEMM fusions make XLA copy each slice (Qwen3-8B shapes); printed, not asserted, since
    # whether XLA picks Triton for GEMMs this small is its own choice.
    triton = device_copies(compiled({"xla_gpu_enable_triton_gemm": True}), min_bytes=256 << 10)
    print(f"with Triton GEMMs: {len(triton)} weight copies of >= 256 kB per step")
    # Two layers per loop iteration (StepConfig.layer_unroll, slower in the full 128k step): printed, to say whether
    # weight copies are why.
    unrolled = device_copies(compiled({}, layer_unroll=2), min_bytes=256 << 10)
    print(f"with 2 layers per loop iteration: {len(unrolled)} copies of >= 256 kB per step:",
          [(i["name"], i["bytes"]) for i in unrolled[:8]])


def test_decode_loop_takes_the_cache_donated(tiny_model):
    """The device-memory decode loop updates the cache in place: its compiled program copies neither the K/V rows
    nor the plane store (without the donation XLA copied both whole at entry), and the cache passed in is
    consumed."""
    attn = decode.from_spec("fathom:16", k=48, calibration="session")
    prompt = np.random.default_rng(1).integers(0, 97, (2, 100)).astype(np.int32)
    logits, cache, attn = generation.prefill(tiny_model, prompt, np.array([100, 90]), attn, 256)
    graphdef, state = nnx.split(tiny_model)
    tokens = jnp.argmax(logits, -1).astype(jnp.int32)
    text = generation.decode_loop_program().lower(graphdef, state, attn, tokens, cache, 3).compile().as_text()
    hlo_type = {"bfloat16": "bf16", "float32": "f32", "uint32": "u32", "float16": "f16"}
    bulk = {f"{hlo_type[x.dtype.name]}[{','.join(map(str, x.shape))}]"
            for x in (cache.kv, cache.index["raw"].planes, cache.index["raw"].scales)}
    copied = [i["shape"] for i in device_copies(text, min_bytes=0) if i["shape"].split("{")[0] in bulk]
    assert copied == [], f"the decode loop copies its cache: {copied}"
    out, _ = generation.decode_loop(tiny_model, tokens, cache, attn, 3)
    assert out.shape == (2, 3) and cache.kv.is_deleted()


def test_decode_step_updates_its_row_cache_in_place(tiny_model):
    """The step program donates the cache's small leaves, so XLA writes a step's rows into the row cache in place; the
    same program without the donation copies the whole row cache first (the control: the check can fail)."""
    from fathom_jax.models.attention import CacheShape
    from fathom_jax.placement import split_bulk

    cfg = tiny_model.config
    shape = CacheShape(layers=cfg.n_layers, batch=2, kv_heads=cfg.n_kv_heads, capacity=64, head_dim=cfg.head_dim,
                       dtype=jnp.float32)
    attn = decode.from_spec("sparq:4", k=12, sink=2, local=4, step=StepConfig(row_cache=1024)).bind(shape)
    cache = attn.init_cache(shape)  # only compiled, never run: its contents do not matter
    cache = attn.start_decode(cache, jnp.array([40, 33], jnp.int32))
    _, state = nnx.split(tiny_model)
    tokens = jnp.zeros((2,), jnp.int32)
    run = generation.decode_step_program(tiny_model, cache, attn)
    size = cache.row_cache.rows.nbytes
    donated = run.lower(state, tokens, None, cache=cache).compile().as_text()
    assert device_copies(donated, min_bytes=size) == []
    leaves = jax.tree.leaves(attn)
    kept = jax.jit(run.jit.__wrapped__).lower(leaves, (state, tokens, None), *split_bulk(cache, cache.bulk()))
    assert device_copies(kept.compile().as_text(), min_bytes=size) != []


# A compiled GPU module's shape, cut down: a layer loop whose body holds two fusions, a Pallas kernel, a cuBLAS call
# reached through a called computation, and a conditional with a one-kernel and a three-kernel branch.
_LAUNCH_HLO = """
HloModule step

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(f32[4]{0} %p)
}

%branch_fast (t: (f32[4])) -> f32[4] {
  %t = (f32[4]{0}) parameter(0)
  %g = f32[4]{0} get-tuple-element((f32[4]{0}) %t), index=0
  ROOT %u = f32[4]{0} custom-call(f32[4]{0} %g), custom_call_target="__gpu$xla.gpu.triton"
}

%branch_slow (t: (f32[4])) -> f32[4] {
  %t.1 = (f32[4]{0}) parameter(0)
  %g.1 = f32[4]{0} get-tuple-element((f32[4]{0}) %t.1), index=0
  %s = f32[4]{0} sort(f32[4]{0} %g.1), dimensions={0}, to_apply=%cmp
  %f.2 = f32[4]{0} fusion(f32[4]{0} %s), kind=kLoop, calls=%fused_a
  ROOT %c.2 = f32[4]{0} custom-call(f32[4]{0} %f.2), custom_call_target="__gpu$xla.gpu.triton"
}

%gemm (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %d = f32[4]{0} custom-call(f32[4]{0} %x), custom_call_target="__cublas$gemm"
}

%body (s: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s.1 = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[4]{0}) %s.1), index=0
  %v = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %s.1), index=1
  %f.1 = f32[4]{0} fusion(f32[4]{0} %v), kind=kLoop, calls=%fused_a
  %k = f32[4]{0} custom-call(f32[4]{0} %f.1), custom_call_target="__gpu$xla.gpu.triton"
  %call = f32[4]{0} call(f32[4]{0} %k), to_apply=%gemm
  %pred = pred[] fusion(f32[4]{0} %call), kind=kLoop, calls=%fused_a
  %tup = (f32[4]{0}) tuple(f32[4]{0} %call)
  %cond = f32[4]{0} conditional(pred[] %pred, (f32[4]{0}) %tup, (f32[4]{0}) %tup), true_computation=%branch_slow, false_computation=%branch_fast
  ROOT %r = (s32[], f32[4]{0}) tuple(s32[] %i, f32[4]{0} %cond)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %init = (s32[], f32[4]{0}) tuple(s32[] %zero, f32[4]{0} %a)
  %w = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %init), condition=%cond_c, body=%body
  ROOT %out = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %w), index=1
}
"""


def test_kernel_launches_counts_by_where_they_run():
    got = kernel_launches(_LAUNCH_HLO)
    assert got["entry"] == 0
    (loop,) = got["loops"]
    # fusion, triton kernel, the called cuBLAS gemm, the predicate's fusion; the branches apart (fast, slow)
    assert loop["body"] == "body" and loop["kernels"] == 4 and loop["branches"] == [[1, 3]]


# The same loop after XLA's command buffer scheduling: the first fusion and the Pallas kernel outlined into one
# command buffer (a CUDA graph), a second Pallas kernel launched by itself beside it.
_CAPTURED_HLO = """
HloModule step

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(f32[4]{0} %p)
}

%command_buffer (v: f32[4]) -> f32[4] {
  %v.1 = f32[4]{0} parameter(0)
  %f.1 = f32[4]{0} fusion(f32[4]{0} %v.1), kind=kLoop, calls=%fused_a
  ROOT %k = f32[4]{0} custom-call(f32[4]{0} %f.1), custom_call_target="__gpu$xla.gpu.triton"
}

%body (s: (s32[], f32[4])) -> (s32[], f32[4]) {
  %s.1 = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[4]{0}) %s.1), index=0
  %v = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %s.1), index=1
  %cb = f32[4]{0} call(f32[4]{0} %v), to_apply=%command_buffer
  %k.2 = f32[4]{0} custom-call(f32[4]{0} %cb), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %r = (s32[], f32[4]{0}) tuple(s32[] %i, f32[4]{0} %k.2)
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %init = (s32[], f32[4]{0}) tuple(s32[] %zero, f32[4]{0} %a)
  %w = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %init), condition=%cond_c, body=%body
  ROOT %out = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %w), index=1
}
"""


def test_kernel_launches_say_which_kernels_command_buffers_capture():
    """Kernels inside a ``command_buffer`` computation launch as one graph; a Pallas kernel outside one launches by
    itself (JAX issue 27988: Triton custom calls were left out of command buffers by default)."""
    (loop,) = kernel_launches(_CAPTURED_HLO)["loops"]
    assert loop["kernels"] == 3 and loop["captured"] == 2 and loop["triton_outside"] == 1
    (plain,) = kernel_launches(_LAUNCH_HLO)["loops"]
    assert plain["captured"] == 0 and plain["triton_outside"] == 1  # the branches' kernels are counted apart


COLLECTIVES = """
%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(f32[8]{0} %x), replica_groups={}, to_apply=%add, metadata={op_name="jit(step)/while/body/psum" source_file="/x/model.py" source_line=7}
}

%cond (t: (s32[], f32[8])) -> pred[] {
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[16] {
  %w = (s32[], f32[8]) while((s32[], f32[8]) %t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"36"}}
  %ags = (f32[8]{0}, f32[16]{0}) all-gather-start(f32[8]{0} %a), dimensions={0}
  ROOT %agd = f32[16]{0} all-gather-done((f32[8]{0}, f32[16]{0}) %ags)
}
"""


def test_collectives_count_their_runs_per_step():
    """A collective inside a loop body runs its known trip count times per run of the module, one in the entry once;
    an async pair counts once, at its ``-done``."""
    assert trip_counts(COLLECTIVES)["body"] == 36 and trip_counts(COLLECTIVES)["ENTRY"] == 1
    found = {c["opcode"]: c for c in hlo_collectives(COLLECTIVES)}
    assert set(found) == {"all-reduce", "all-gather"}
    assert (found["all-reduce"]["per_step"], found["all-reduce"]["bytes"], found["all-reduce"]["computation"]) == \
        (36, 32, "body")
    assert found["all-reduce"]["source"] == "model.py:7" and found["all-reduce"]["op"].endswith("/psum")
    assert (found["all-gather"]["per_step"], found["all-gather"]["bytes"]) == (1, 64)
