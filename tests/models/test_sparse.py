"""Sparse decoding of the real model: offloaded (pinned_host) decoding equals decoding in HBM (GPU), and the
attention-only step matches the decode step's attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import decode
from fathom_jax.models import sparse


def greedy_with_logits(model, prompt, lengths, attn, capacity, steps):
    """Sparse prefill, then greedy decode steps one compiled step at a time: (tokens [B, steps], logits
    [steps, B, V], the final cache). The host arrays of an offloaded cache are the prefill's, written in place."""
    logits, cache, attn = sparse.prefill(model, prompt, lengths, attn, capacity)
    tokens, all_logits = [jnp.argmax(logits, -1).astype(jnp.int32)], [np.asarray(logits)]
    for _ in range(steps - 1):
        nxt, logits, cache = sparse.decode_step(model, tokens[-1], cache, attn)
        tokens.append(nxt)
        all_logits.append(np.asarray(logits))
    return np.asarray(jnp.stack(tokens, 1)), np.stack(all_logits), cache


def assert_same_tokens_up_to_a_near_tie(tokens_a, logits_a, tokens_b, logits_b, *, atol):
    """Two greedy runs (``tokens [B, steps]``, ``logits [steps, B, V]``, token i the argmax of logits i) whose
    programs round differently: per sequence, the logits agree within ``atol`` up to the first step where the tokens
    differ, and at that step each run's token beat the other's by at most ``atol`` (a near tie that rounding may
    flip; past it the runs continue from different tokens and are not compared)."""
    for seq in range(tokens_a.shape[0]):
        differ = np.flatnonzero(tokens_a[seq] != tokens_b[seq])
        upto = differ[0] if differ.size else tokens_a.shape[1]
        np.testing.assert_allclose(logits_a[:upto, seq], logits_b[:upto, seq], rtol=0, atol=atol)
        if differ.size:
            step, a, b = differ[0], tokens_a[seq, differ[0]], tokens_b[seq, differ[0]]
            margins = (logits_a[step, seq, a] - logits_a[step, seq, b], logits_b[step, seq, b] - logits_b[step, seq, a])
            assert max(margins) <= atol, (f"sequence {seq} diverges at step {step} ({a} vs {b}) by logit margins "
                                          f"{margins}, more than rounding ({atol})")


def test_near_tie_comparison_of_greedy_runs():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 1, 10))
    logits[:, 0, 3] += 5  # token 3 wins every step by a clear margin...
    logits[4, 0, 7] = logits[4, 0, 3] - 0.001  # ...but at step 4 token 7 is within 0.001 of it
    tokens = np.argmax(logits, -1).T
    other_logits = logits + rng.uniform(-1e-4, 1e-4, logits.shape)
    other_logits[4, 0, 7] = other_logits[4, 0, 3] + 0.0005
    other_logits[5] = rng.standard_normal(10)  # after the flip: another continuation, not compared
    other = np.argmax(other_logits, -1).T
    assert other[0, 4] == 7 and tokens[0, 4] == 3
    assert_same_tokens_up_to_a_near_tie(tokens, logits, other, other_logits, atol=0.01)
    assert_same_tokens_up_to_a_near_tie(tokens, logits, tokens, logits, atol=0.0)
    with pytest.raises(AssertionError, match="diverges at step 4"):  # a flip beyond rounding
        assert_same_tokens_up_to_a_near_tie(tokens, logits, other, other_logits, atol=0.0008)
    drifted = other_logits.copy()
    drifted[2] += 0.1
    with pytest.raises(AssertionError):  # logits apart before the flip
        assert_same_tokens_up_to_a_near_tie(tokens, logits, other, drifted, atol=0.01)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("context", [4096, 8192])
def test_smollm2_offloaded_decoding_equals_hbm_decoding(smollm2, context):
    """SmolLM2-135M on real code: 64 greedy tokens with the cache and index in pinned_host memory equal the
    in-HBM sparse decode with the same method, and so do the logits (stated tolerance: 1e-5 of their scale).
    The same holds with each layer's three KV groups in three pipelined chunks, against the same chunks in HBM.
    Chunked and unchunked decoding differ by float reassociation (GEMMs over one group instead of three round
    differently on the GPU, and near-ties in the top-k then pick other rows: up to 0.31 of a 43 logit scale over 32
    steps at 4k on the H200, results/pipeline_h200.md): their logits agree within 5% of the scale and their tokens
    until a near tie (run y2 at 8k: the same 25 tokens, then others; until then the test asked for the same 64; run z2
    at 4k: the same 64 tokens, logits 2.5% of the scale apart at step 54, over y2's 1%)."""
    from fathom_jax.eval import texts

    model, tok, cfg = smollm2
    text, _ = texts.evaluation_text()
    ids = np.asarray(texts.token_window(tok.encode(text), context - 64), np.int32)[None]
    lengths = np.array([ids.shape[1]])
    out = {}
    for memory, pipeline in (("device", 1), ("pinned_host", 1), ("device", 3), ("pinned_host", 3)):
        placement = decode.Placement(memory, pipeline=pipeline)
        attn = decode.from_spec("fathom:32", k=128, placement=placement, implementation="pallas")
        tokens, logits, cache = greedy_with_logits(model, ids, lengths, attn, context, 64)
        out[memory, pipeline] = (tokens, logits)
        if memory == "pinned_host":
            assert cache.kv.sharding.memory_kind == "pinned_host"
    scale = np.abs(out["device", 1][1]).max()
    for pipeline in (1, 3):
        host, hbm = out["pinned_host", pipeline], out["device", pipeline]
        np.testing.assert_array_equal(host[0], hbm[0])
        np.testing.assert_allclose(host[1], hbm[1], rtol=0, atol=1e-5 * scale)
    chunked, whole = out["pinned_host", 3], out["pinned_host", 1]
    assert_same_tokens_up_to_a_near_tie(chunked[0], chunked[1], whole[0], whole[1], atol=5e-2 * scale)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "gpu" or len(jax.devices()) < 2, reason="needs two CUDA GPUs")
def test_smollm2_offloaded_decoding_over_two_gpus_equals_one_gpu(smollm2):
    """Issue 9 on the real model: SmolLM2's 3 KV heads do not split over two GPUs, so the batch does. Two
    sequences of different lengths (~4k tokens of code) make 6 groups, 3 per GPU, each GPU scanning and
    fetching its own groups from its own slice of pinned_host memory; 32 greedy tokens equal those of the
    same offloaded decode on one GPU. Logits agree to 5% of their scale: the partitioned program runs the
    GEMMs over 3 groups instead of 6 and TF32 rounds them differently (3e-4 of the scale after prefill; 1.44 of a 44.3
    scale after 32 steps on two H200s, results/gpu_smollm2_h200.txt)."""
    from fathom_jax.eval import texts
    from fathom_jax.placement import device_mesh

    model, tok, cfg = smollm2
    text, _ = texts.evaluation_text()
    ids = tok.encode(text)
    lengths = np.array([4032, 3911])
    prompt = np.zeros((2, lengths.max()), np.int32)
    prompt[0] = texts.token_window(ids, lengths[0])
    prompt[1, :lengths[1]] = texts.token_window(ids[6000:], lengths[1])
    out = {}
    for devices in (1, 2):
        placement = decode.Placement("pinned_host", mesh=device_mesh(devices))
        attn = decode.from_spec("fathom:32", k=128, placement=placement, implementation="pallas")
        tokens, logits, cache = greedy_with_logits(model, prompt, lengths, attn, 4096, 32)
        out[devices] = (tokens, logits)
        if devices == 2:
            assert cache.kv.sharding.spec[1] == placement.axis and cache.kv.sharding.memory_kind == "pinned_host"
    scale = np.abs(out[1][1]).max()
    print(f"two GPUs vs one: max |logit difference| {np.abs(out[2][1] - out[1][1]).max():.3g} of scale {scale:.3g}")
    np.testing.assert_array_equal(out[2][0], out[1][0])
    np.testing.assert_allclose(out[2][1], out[1][1], rtol=0, atol=5e-2 * scale)


def test_attention_only_step_matches_the_layers_attention(tiny_model):
    """attention_step (the benchmark's no-GEMM step) runs each layer's sparse attention and writes the cache
    like the decode step's commit: the index after it holds one more token."""
    cfg = tiny_model.config
    attn = decode.from_spec("sparq:4", k=16, sink=2, local=4, implementation="xla")
    prompt = np.random.default_rng(1).integers(0, 97, (2, 40)).astype(np.int32)
    _, cache, attn = sparse.prefill(tiny_model, prompt, np.array([40, 33]), attn, 64)
    rng = np.random.default_rng(2)
    r = 2 * cfg.n_kv_heads
    q = jnp.asarray(rng.standard_normal((cfg.n_layers, r, cfg.group_size, cfg.head_dim)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, cfg.n_layers, r, cfg.head_dim)), jnp.float32)
    # each layer's attention as the decode step's layer scan runs it: one program, the layer traced
    attend = jax.jit(lambda q, key, value, cache, layer: attn.attend(q, key, value, cache, layer)[0])
    want = [attend(q[layer], kv[0, layer], kv[1, layer], cache, jnp.int32(layer)) for layer in range(cfg.n_layers)]
    out, cache = sparse.attention_step(q, kv[0], kv[1], cache, attn)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.stack(want)), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(cache.length, [41, 34])
    np.testing.assert_array_equal(np.asarray(cache.k[:, 0, 40]), np.asarray(kv[0, :, 0]))


def test_layers_per_loop_iteration_change_no_number(tiny_model):
    """``Placement(layer_unroll=N)`` only regroups the layer scan's iterations (3 layers: 2 leaves a remainder):
    the decode step's logits and cache and the attention-only step's outputs equal one layer per iteration, bit
    for bit, and the attention-only step still chains each layer to the previous one's output."""
    import dataclasses

    unroll = 2
    cfg = tiny_model.config
    base = decode.from_spec("fathom:16", k=16, sink=2, local=4, calibration="session", implementation="xla")
    prompt = np.random.default_rng(3).integers(0, 97, (2, 40)).astype(np.int32)
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((cfg.n_layers, 2 * cfg.n_kv_heads, cfg.group_size, cfg.head_dim)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, cfg.n_layers, 2 * cfg.n_kv_heads, cfg.head_dim)), jnp.float32)
    got = {}
    for n in (1, unroll):
        attn = dataclasses.replace(base, placement=dataclasses.replace(base.placement, layer_unroll=n))
        logits, cache, attn = sparse.prefill(tiny_model, prompt, np.array([40, 33]), attn, 64)
        nxt, logits, cache = sparse.decode_step(tiny_model, jnp.argmax(logits, -1).astype(jnp.int32), cache, attn)
        out, cache = sparse.attention_step(q, kv[0], kv[1], cache, attn)
        got[n] = jax.tree.map(np.asarray, (nxt, logits, out, cache.kv, cache.index.raw.planes, cache.length))
        hlo = jax.jit(lambda q, c: sparse.attention_step_fn(q, kv[0], kv[1], c, attn)[0]).lower(q, cache).as_text()
        assert "optimization_barrier" in hlo, "the attention-only step's layers are not chained"
    for want, have in zip(jax.tree.leaves(got[1]), jax.tree.leaves(got[unroll])):
        np.testing.assert_array_equal(have, want)


def test_cache_from_dense_prefill_branches_methods_from_one_prefill(tiny_model):
    """A sparse cache built from one dense prefill decodes like the sparse path's own prefill."""
    from fathom_jax.models import KVCache

    cfg = tiny_model.config
    prompt = np.random.default_rng(3).integers(0, 97, (2, 30)).astype(np.int32)
    lengths = np.array([30, 30])
    logits, kv = tiny_model.prefill(jnp.asarray(prompt), KVCache.init(cfg, 2, 48), last_only=True)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    # jitted, as the downstream sweeps run it (fathom_jax/eval/downstream.py); eagerly it is op by op (~4x slower)
    from_dense = jax.jit(sparse.cache_from_dense)
    for spec in ("fathom_klt:12", "landmark"):
        attn = decode.from_spec(spec, k=12, sink=2, local=4)
        cache, branched = from_dense(kv, lengths, attn)
        got, _ = sparse.decode_loop(tiny_model, first, cache, branched, 5)
        want_logits, want_cache, want_attn = sparse.prefill(tiny_model, prompt, lengths, attn, 48)
        want, _ = sparse.decode_loop(tiny_model, jnp.argmax(want_logits, -1).astype(jnp.int32), want_cache, want_attn, 5)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_chunked_causal_attention_equals_dense_causal():
    from fathom_jax.models.cache import causal_attention

    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((2, 37, 6, 8)), jnp.float32)  # T not a multiple of the chunk
    k = jnp.asarray(rng.standard_normal((2, 37, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 37, 2, 8)), jnp.float32)
    got = sparse.chunked_causal_attention(q, k, v, chunk=16)
    qg = q.reshape(2, 37, 2, 3, 8).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    want = causal_attention(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), 0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want.transpose(0, 3, 1, 2, 4).reshape(2, 37, 6, 8)),
                               rtol=1e-5, atol=1e-5)
