"""The zero-copy guard: host-array copies are found in compiled HLO (parser on CPU, real programs on GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import decode
from fathom_jax.hlo import _INSTR, host_array_copies
from fathom_jax.models import sparse

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


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("read,streams,writes,pipeline,scan_writes", [
    ("direct", 1, "every_step", 1, True), ("staged", 1, "every_step", 1, True), ("staged", 2, "every_step", 1, True),
    ("staged", 1, "full_blocks", 1, True), ("staged", 1, "full_blocks", 2, True), ("staged", 1, "every_step", 2, False)])
def test_compiled_decode_step_reads_the_host_cache_in_place(tiny_config, tiny_model, read, streams, writes, pipeline,
                                                            scan_writes):
    """The compiled offloaded decode step has no host-to-device (or host-to-host) copy of the store or K/V,
    whether the plane scan reads host memory itself or the run gather stages the planned runs, and when the
    groups are split over GPU streams (the host arrays then pass into each stream's computation) or into
    pipelined chunks (compiled with their CUDA-graph option), and whether each layer writes its new row and blocks
    inside the layer scan or all layers write after it."""
    placement = decode.Placement("pinned_host", read=read, streams=streams, index_writes=writes, pipeline=pipeline,
                                 gather_programs=64 if pipeline > 1 else 0, scan_writes=scan_writes)
    attn = decode.from_spec("fathom:16", k=64, calibration="session", placement=placement, implementation="pallas")
    prompt = np.random.default_rng(0).integers(0, 97, (2, 1000)).astype(np.int32)
    logits, cache, attn = sparse.prefill(tiny_model, prompt, np.array([1000, 900]), attn, 4096)
    assert cache.kv.sharding.memory_kind == "pinned_host" and cache.index.raw.planes.sharding.memory_kind == "pinned_host"
    step_jit = sparse.host_programs(tiny_model, attn, cache).jits[1]
    from flax import nnx
    from fathom_jax.models.llama import split_attention

    _, state = nnx.split(tiny_model)
    leaves = split_attention(attn)[1]
    tokens = jnp.argmax(logits, -1).astype(jnp.int32)
    text = step_jit.lower(state, tokens, cache, leaves).compile().as_text()
    assert "S(5)" in text, "the compiled step has no host-memory operands: the cache is not offloaded"
    copies = host_array_copies(text, min_bytes=1 << 16)
    assert copies == [], "the decode step copies host-resident cache arrays:\n" + "\n".join(copies)
    if streams > 1:  # the first chunk runs as a computation on a stream of its own, the last on the main stream
        assert text.count("call-start") >= streams - 1 and '_xla_stream_annotation="1"' in text
        schedule = [m.group(3) for m in map(_INSTR.match, text.splitlines()) if m]  # in scheduled order
        start, done = schedule.index("call-start"), schedule.index("call-done")
        between = schedule[start + 1:done]
        print("scheduled between the stream's start and done:", between.count("custom-call"), "custom calls of",
              len(between), "instructions")
        assert "custom-call" in between, "nothing of the main stream is scheduled while the other stream runs"
    # and the cache is really written: the next step sees the new token's K row in host memory
    block = np.asarray(cache.index.raw.planes[:, 0, :, :, 30:32])  # sequence 0's partial block 15 (tokens 960..1000)
    nxt, _, cache2 = sparse.decode_step(tiny_model, tokens, cache, attn)
    assert cache2.kv is cache.kv  # the same host array, updated in place
    assert np.abs(np.asarray(cache2.k[:, 0, 1000])).max() > 0 and np.abs(np.asarray(cache2.k[:, 0, 1001])).max() == 0
    after = np.asarray(cache2.index.raw.planes[:, 0, :, :, 30:32])
    if writes == "full_blocks":  # the step left the partial block to the tail; flush writes it
        np.testing.assert_array_equal(after, block)
        flushed = np.asarray(sparse.flush(cache2, attn).index.raw.planes[:, 0, :, :, 30:32])
        assert (flushed != block).any()
    else:
        assert (after != block).any()
