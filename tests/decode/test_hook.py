"""Sparse decoding through the decoder: dense equivalence, exact index writes, an independent per-step
reference, both placements, ragged batches, one compiled program, calibration sources, errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import calibrate as C
from fathom_jax import decode
from fathom_jax import methods as M
from fathom_jax import store
from fathom_jax.decode import StepConfig
from fathom_jax.index import build_index
from fathom_jax.models import DenseCache, capture_qkv, generate, softmax_attention
from fathom_jax.models import generation
from fathom_jax.models.attention import CacheShape
from fathom_jax.scan import scan_scores
from fathom_jax.select import select_topk, sparse_attention
from tests.support import (ON_GPU, assert_trees_bitwise_equal, build_index_jit, corpus_calibration,
                           describe_code_difference, sparse_forced)

RNG = np.random.default_rng(7)
PROMPTS = RNG.integers(0, 97, (2, 2, 24)).astype(np.int32)  # two [B=2, T=24] prompts
LONG = RNG.integers(0, 97, (2, 60)).astype(np.int32)
CAPACITY = 48
STEPS = 6


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def calib(model):
    return corpus_calibration(model, 1)


def dense_forced(model, prompt, tokens, attention_fn=softmax_attention, capacity=CAPACITY):
    """Logits [steps + 1, B, V]: the dense prefill's last position, then decode steps fed `tokens`; decode attention
    ``attention_fn`` over the dense cache."""
    return sparse_forced(model, prompt, tokens, DenseCache(attention_fn), capacity)[0]


@pytest.fixture(scope="module")
def dense_run(model):
    prompt = PROMPTS[0]
    tokens = np.asarray(generate(model, prompt, STEPS + 1, capacity=CAPACITY))
    logits = dense_forced(model, prompt, tokens[:, :STEPS])
    assert (np.argmax(logits, -1).T == tokens).all()  # the forced loop is the greedy loop
    return tokens, logits


def close(got, want, tol=2e-5):
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


# ----------------------------------------------------------------------------------------------
# k >= context: every token is selected, sparse decode is dense decode


@pytest.mark.parametrize("spec", ["fathom:16", "landmark", "dense"])
def test_selecting_every_token_equals_dense(model, calib, dense_run, spec):
    tokens, want = dense_run
    attn = decode.from_spec(spec, k=CAPACITY, calibration=calib)
    got, cache, _ = sparse_forced(model, PROMPTS[0], tokens[:, :STEPS], attn)
    close(got, want)
    assert (np.argmax(got, -1).T == tokens).all()  # greedy tokens equal, step by step
    np.testing.assert_array_equal(cache.length, PROMPTS.shape[-1] + STEPS)
    assert int(cache.index.length[0, 0]) == PROMPTS.shape[-1] + STEPS


# ----------------------------------------------------------------------------------------------
# The cache after decoding is the cache of all keys, bit for bit (ragged batch, across blocks)


@pytest.mark.parametrize("spec,writes,memory", [
    ("fathom_klt:16", "every_step", "device"), ("landmark", "every_step", "device"),
    ("fathom:16", "full_blocks", "device"), ("quest:16", "every_step", "device"),
    # in pinned_host memory the kernels write in place, each layer's inside the layer scan (raw stores: on a GPU a
    # KLT store built from all keys rotates them with another GEMM shape than the step's one key, TF32 rounds the
    # two differently and codes at a quantizer boundary can differ: seen on the H200)
    pytest.param("fathom:16", "every_step", "pinned_host", marks=ON_GPU),
    pytest.param("fathom:16", "full_blocks", "pinned_host", marks=ON_GPU),
    pytest.param("landmark", "every_step", "pinned_host", marks=ON_GPU),
    pytest.param("quest:8", "every_step", "pinned_host", marks=ON_GPU)])
def test_index_after_decode_equals_index_of_all_keys(model, spec, writes, memory, full_f32_matmuls):
    # A raw store written every step takes the KLT store's commit path (the same code per part).
    # 60 / 45 prompt tokens + 5 decode steps cross a 64-token store block, 8-token landmark blocks and 16- and
    # 8-token Quest pages.
    lengths = np.array([60, 45])
    attn = decode.from_spec(spec, k=40, placement=memory,  # fathom_klt: session calibration
                            step=StepConfig(index_writes=writes))
    _, cache, attn = sparse_forced(model, LONG, LONG[:, :5], attn, capacity=72, lengths=lengths)
    if memory == "pinned_host":
        assert cache.kv.sharding.memory_kind == "pinned_host" and attn.run.in_place
    cache = jax.device_get(cache) if writes == "every_step" else cache  # numpy leaves (host arrays: no eager ops)
    np.testing.assert_array_equal(cache.length, lengths + 5)
    if writes == "full_blocks":  # the steps wrote the block that filled (0 of sequence 0), not the partial ones
        hkv = model.config.n_kv_heads
        planes = np.array(cache.index["raw"].planes, copy=True)  # (a host array's numpy view would see the flush)
        assert planes[:, :hkv, :, :, :2].any() and not planes[:, :hkv, :, :, 2:4].any()  # 65 tokens: block 1 unwritten
        cache = jax.device_get(decode.flush(cache, attn))
        assert planes[:, hkv:].tolist() != np.asarray(cache.index["raw"].planes)[:, hkv:].tolist()  # 45 + 5: block 0 was stale
    hkv = model.config.n_kv_heads
    for b, n in enumerate(lengths + 5):
        rows = slice(b * hkv, (b + 1) * hkv)
        for layer in range(model.config.n_layers):
            calib = None if cache.calibration is None else jax.tree.map(lambda a: a[layer, rows], cache.calibration)
            want = build_index_jit(cache.k[layer, rows, :n], calib, (attn.method,), capacity=72)
            got = jax.tree.map(lambda a: a[layer, rows], cache.index)
            for part in ("raw", "klt"):  # on failure: which cells, and the keys that decide them
                g, w = got.get(part), want.get(part)
                if g is not None:
                    keys = store.rotate_keys(jnp.asarray(cache.k[layer, rows, :n], jnp.float32), w.rotation)
                    for h in range(hkv):
                        report = describe_code_difference(g.planes[h], w.planes[h], w.scales[h], keys[h])
                        assert not report, f"{part} store, layer {layer}, group {rows.start + h}: {report}"
            assert_trees_bitwise_equal(got, want)
        # the K rows are the model's keys: every layer's on the prompt (dense prefill), layer 0's on the decoded
        # tokens too (deeper layers' inputs there come from sparse attention)
        dense_k = capture_qkv(model, np.concatenate([LONG[b, : lengths[b]], LONG[b, :5]]))["k"]
        # (full f32 GEMMs: full_f32_matmuls; the GPU's tolerance stays the one that held with TF32 until run v5)
        tol = 1e-4 if jax.default_backend() == "cpu" else 1e-3
        np.testing.assert_allclose(cache.k[:, rows, : lengths[b]], dense_k[:, :, : lengths[b]], atol=tol)
        np.testing.assert_allclose(cache.k[0, rows, :n], dense_k[0], atol=tol)
    if cache.calibration is not None:  # session statistics are those of each sequence's prompt keys
        for b, n in enumerate(lengths):
            want = C.calibrate_session(cache.k[:, b * hkv:(b + 1) * hkv, :n])
            np.testing.assert_allclose(cache.calibration.basis[:, b * hkv:(b + 1) * hkv], want.basis, atol=1e-5)


@pytest.mark.parametrize("spec,shared_kv,writes", [("fathom_klt:16", False, "every_step"), ("landmark", True, "every_step"),
                                                   ("fathom:16", True, "full_blocks"),
                                                   ("quest:8", False, "full_blocks")])
def test_writes_layer_by_layer_equal_the_writes_after_the_scan(model, spec, shared_kv, writes):
    """What each layer writes inside the layer scan (in real host memory: in place, on a GPU) lands where the commit
    after the scan puts it: every layer's new K/V row and index blocks at its own layer, and in a row buffer shared by
    all layers only the last layer's row; the commit then only updates the small leaves."""
    from fathom_jax.decode import writes as W

    cfg = model.config
    attn = decode.from_spec(spec, k=12, sink=2, local=4, step=StepConfig(index_writes=writes))
    prompt = np.random.default_rng(4).integers(0, 97, (2, 63)).astype(np.int32)
    _, cache, attn = generation.prefill(model, prompt, np.array([63, 40]), attn, 72)
    if shared_kv:
        cache = dataclasses.replace(cache, kv=cache.kv[-1:])
    assert cache.shared_kv == shared_kv
    rng = np.random.default_rng(5)
    hkv, layers = cfg.n_kv_heads, cfg.n_layers
    q = jnp.asarray(rng.standard_normal((layers, 2, hkv, cfg.group_size, cfg.head_dim)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, layers, 2, hkv, cfg.head_dim)), jnp.float32)
    # each piece as one program (eagerly, hundreds of small ops compiled one by one)
    attend = jax.jit(lambda cache, layer, q, k, v: attn.attend(cache, layer, q, k, v)[1])
    per_layer = [attend(cache, jnp.int32(layer), q[layer], kv[0, layer], kv[1, layer]) for layer in range(layers)]
    updates = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    commit = jax.jit(attn.commit)
    want = commit(cache, updates)

    got, p = cache, cache.group_length()
    for layer, update in enumerate(per_layer):
        write = W.Writer(False, "xla")
        kv_rows, data, tokens = W.write_token(got, jax.tree.map(lambda a: a[None], update), p, layer, write, writes)
        got = dataclasses.replace(got, kv=kv_rows, index=dataclasses.replace(got.index, data=data))
        assert tokens == ()  # functional writes here; in place they return one token per write
    written = jnp.zeros((layers,) + cache.writes.shape, jnp.int32)
    got = commit(got, dataclasses.replace(updates, written=written))
    assert_trees_bitwise_equal(got, want)
    row = np.asarray(want.kv[0, :, 63])  # sequence 0's new row: the last layer's where the buffer is shared
    np.testing.assert_array_equal(row[: cfg.n_kv_heads, : cfg.head_dim],
                                  np.asarray(kv[0, -1 if shared_kv else 0, 0]))


# ----------------------------------------------------------------------------------------------
# Small k: the decode step equals an independent reference that rebuilds the index every step


def rebuild_attention(method, k, sink, local, calib):
    """A dense-cache hook written from the library's per-head pieces: build the index of keys [0, length),
    scan, select per head, attend over each head's own rows (no sparse step, no patching, no union)."""

    def attn(q, kc, vc, length, layer):
        c = None if calib is None else jax.tree.map(lambda a: jnp.broadcast_to(a[layer], kc.shape[:2] + a.shape[2:]),
                                                    calib)
        index = build_index(kc.astype(jnp.float32), c, method.parts, capacity=kc.shape[2], length=length)
        scores = scan_scores(method, q, index, c, implementation="xla").scores
        sel, mask = select_topk(scores, length, k, sink=sink, local=local, implementation="xla")
        return sparse_attention(q, kc, vc, sel, mask)

    return attn


@pytest.mark.parametrize("spec", ["fathom:16", "fathom_klt:12", "sparq:2", "landmark", "quest:8"])  # quest:16 differs only in its page
def test_small_k_equals_rebuild_per_step_reference(model, calib, dense_run, spec):
    tokens, dense = dense_run
    small = dict(k=12, sink=2, local=4)
    attn = decode.from_spec(spec, calibration=calib, implementation="xla", **small)
    got, _, _ = sparse_forced(model, PROMPTS[0], tokens[:, :STEPS], attn)
    reference = rebuild_attention(attn.method, small["k"], small["sink"], small["local"], attn.calibration)
    want = dense_forced(model, PROMPTS[0], tokens[:, :STEPS], reference)
    close(got, want, 1e-4)
    assert np.abs(got[1:] - dense[1:]).max() > 1e-3 * np.abs(dense).max()  # really sparse: not dense decode


# ----------------------------------------------------------------------------------------------
# Placements, read modes, implementations, ragged batches


@pytest.mark.parametrize("spec,implementation,split", [
    ("fathom:16", "xla", {}), ("fathom:16", "xla", dict(pipeline=2)),
    pytest.param("fathom:16", "triton", dict(pipeline=2), marks=ON_GPU, id="gpu")])  # interpreted: ~40 s on CPU
def test_offloaded_placement_equals_device_placement(model, calib, spec, implementation, split):
    """The offloaded layout (kernels staging and writing the cache; device memory on CPU) = device memory;
    with the groups in two pipelined chunks too (each read at its group offset, the second chunk's transfer
    chained to the first's, compiled with the pipeline's XLA options) and plane blocks written only once full."""
    common = dict(k=12, sink=2, local=4, calibration=calib, implementation=implementation)
    prompt, lengths = PROMPTS[1], np.array([24, 19])
    want = np.asarray(generate(model, prompt, 3, capacity=CAPACITY, lengths=lengths,
                               attention_fn=decode.from_spec(spec, **common)))
    # with the kernels, the staged read (run gather, then scan HBM) is the one the device path does not take
    read = "staged" if implementation == "triton" else "direct"
    writes = "full_blocks" if split else "every_step"  # the steps never read a partial block from the store
    host = decode.from_spec(spec, placement="pinned_host", step=StepConfig(read=read, index_writes=writes, **split),
                            **common)
    # the CPU has no pinned_host memory: it says so; a GPU has it
    assert (host.placement.note is not None) == (jax.default_backend() == "cpu")
    got = np.asarray(generate(model, prompt, 3, capacity=CAPACITY, lengths=lengths, attention_fn=host))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("implementation,split", [
    ("xla", {}), ("xla", dict(pipeline=2)),  # the interpreted kernels: ~45 s on CPU, natively below
    pytest.param("triton", dict(pipeline=2), marks=ON_GPU, id="gpu-pinned_host")])  # natively, rows in host memory
def test_row_cache_decodes_the_same_bits(model, calib, implementation, split):
    """With a row cache (rows the slots hold come from device memory, the rest are fetched) every logit is the same bits
    as without one, in a ragged batch, offloaded and pipelined too; after the steps every filled slot holds the row the
    K/V cache holds for its tag, in the slot its token maps to, and later steps took rows from the slots."""
    common = dict(k=12, sink=2, local=4, calibration=calib, implementation=implementation)
    memory = "pinned_host" if split else "device"
    plain = decode.from_spec("fathom:16", placement=memory, step=StepConfig(**split), **common)
    cached = decode.from_spec("fathom:16", placement=memory, step=StepConfig(row_cache=16, **split), **common)
    lengths = np.array([60, 47])
    want, _, _ = sparse_forced(model, LONG, LONG[:, :STEPS], plain, capacity=72, lengths=lengths)
    got, cache, _ = sparse_forced(model, LONG, LONG[:, :STEPS], cached, capacity=72, lengths=lengths)
    np.testing.assert_array_equal(got, want)
    tags, rows, kv = (np.asarray(a) for a in (cache.row_cache.tags, cache.row_cache.rows, cache.kv))
    layer, group, slot = np.nonzero(tags)
    assert len(slot) > 0
    np.testing.assert_array_equal((tags[layer, group, slot] - 1) % 16, slot)
    np.testing.assert_array_equal(rows[layer, group, slot], kv[layer, group, tags[layer, group, slot] - 1])
    hits, fetched = np.asarray(cache.row_cache.hits), np.asarray(cache.row_cache.fetched)
    assert hits.sum() > 0 and fetched.sum() > 0  # the last step: some rows from the slots, some fetched


def test_ragged_batch_decodes_like_each_sequence_alone(model, calib):
    attn = decode.from_spec("fathom:16", k=12, sink=2, local=4, calibration=calib)
    lengths = np.array([24, 17])
    prompt = PROMPTS[0].copy()
    prompt[1, 17:] = 0  # padding: ignored
    got, _, _ = sparse_forced(model, prompt, PROMPTS[1][:, :4], attn, lengths=lengths)
    for b, n in enumerate(lengths):
        alone, _, _ = sparse_forced(model, prompt[b:b + 1, :n], PROMPTS[1][b:b + 1, :4], attn)
        close(got[:, b], alone[:, 0], 1e-5)


def test_pallas_kernels_decode_like_the_reference(model):
    """implementation="triton" (the scans, the selection, row fetch, attention, cache write; interpreted on CPU) ==
    "xla"; with XLA's attention, whose sums the reference's equal, the same index bit for bit."""
    ref = decode.from_spec("fathom:16", k=40, implementation="xla")
    pal = dataclasses.replace(ref, implementation="triton")
    want, want_cache, _ = sparse_forced(model, LONG, LONG[:, :3], ref, capacity=72)
    for step in (StepConfig(), StepConfig(attention="xla")):
        got, got_cache, _ = sparse_forced(model, LONG, LONG[:, :3], dataclasses.replace(pal, step=step), capacity=72)
        close(got[:2], want[:2], 1e-4)  # prefill and the first step
        # Compiled for the GPU, the plane scan sums in another order than the XLA dot, so a near-tied token
        # can swap in or out of a later step's top-k (seen on the H200: 2.5e-4 of the logit scale).
        close(got, want, 1e-4 if jax.default_backend() == "cpu" else 1e-3)
        assert (np.argmax(got, -1) == np.argmax(want, -1)).all()
    assert_trees_bitwise_equal(got_cache.index, want_cache.index)  # the kernels write the same bits
    with pytest.raises(ValueError, match="implementation"):
        dataclasses.replace(ref, implementation="cuda")


# ----------------------------------------------------------------------------------------------
# One compiled program: new prompts and new calibration arrays reuse it


def test_generate_is_one_program_and_does_not_recompile(model, calib, dense_run):
    tokens, _ = dense_run
    attn = decode.SparseAttention(M.Fathom(16), k=CAPACITY, calibration=calib)
    out = np.asarray(generate(model, PROMPTS[0], STEPS + 1, capacity=CAPACITY, attention_fn=attn))
    assert out.tolist() == tokens.tolist()  # k >= context: the greedy tokens of dense decode
    size = generation.generate_program()._cache_size()
    generate(model, PROMPTS[1], STEPS + 1, capacity=CAPACITY, attention_fn=attn)
    other = decode.SparseAttention(M.Fathom(16), k=CAPACITY, calibration=corpus_calibration(model, 2))
    generate(model, PROMPTS[1], STEPS + 1, capacity=CAPACITY, attention_fn=other)
    assert generation.generate_program()._cache_size() == size


def test_session_and_corpus_calibration_both_run(model, calib):
    small = dict(k=12, sink=2, local=4)
    corpus = decode.SparseAttention(M.FathomKLT(16), calibration=calib, **small)
    session = decode.SparseAttention(M.FathomKLT(16), calibration_source="session", **small)
    a = np.asarray(generate(model, PROMPTS[0], 4, capacity=32, attention_fn=corpus))
    size = generation.generate_program()._cache_size()
    b = np.asarray(generate(model, PROMPTS[0], 4, capacity=32, attention_fn=session))
    c = np.asarray(generate(model, PROMPTS[1], 4, capacity=32, attention_fn=session))
    assert a.shape == b.shape == c.shape == (2, 4)
    assert generation.generate_program()._cache_size() == size + 1  # session: one more program, reused
    assert decode.from_spec("fathom_klt:16", **small) == session


# ----------------------------------------------------------------------------------------------
# Specs and errors


def test_from_spec():
    assert decode.from_spec("fathom:48", k=64).calibration_source == "session"
    assert decode.from_spec("sparq:8", k=64, calibration=None).method == M.SparQ(8)
    assert decode.from_spec("exact", k=64, calibration=None).method == M.Exact()
    assert decode.from_spec("dense", k=64).method == M.Dense()
    assert decode.from_spec(M.SparQ(4), k=64, placement="host").placement.offloaded
    assert decode.from_spec("sparq:4", k=64).label == "SparQ r=4, k=64"
    for bad, match in [("fathmo:48", "unknown scan method 'fathmo'"), ("fathom", "expected fathom:BUDGET"),
                       ("sparq:x", "r must be an integer"), ("exact:3", "takes no parameters"), ("", "non-empty")]:
        with pytest.raises(ValueError, match=match):
            decode.from_spec(bad, k=64)
    with pytest.raises(ValueError, match="placement must be one of"):
        decode.from_spec("sparq:4", k=64, placement="disk")


def test_bad_inputs_give_clear_errors(model, calib):
    prompt = PROMPTS[0]
    with pytest.raises(ValueError, match="k=64 is larger than the KV cache capacity 48"):
        generate(model, prompt, 4, capacity=48, attention_fn=decode.SparseAttention(M.SparQ(2), k=64))
    with pytest.raises(ValueError, match="needs calibration statistics"):
        decode.SparseAttention(M.Fathom(16), k=40)
    with pytest.raises(TypeError, match="topk must be a pallas_kernels.topk.TopkConfig or None"):
        decode.SparseAttention(M.SparQ(2), k=64, step=StepConfig(topk={"token_splits": 2}))
    with pytest.raises(ValueError, match="sink \\+ local"):
        decode.SparseAttention(M.SparQ(2), k=20)
    with pytest.raises(ValueError, match="calibration has leading axes"):
        generate(model, prompt, 2, capacity=48,
                 attention_fn=decode.SparseAttention(M.Fathom(16), k=40, calibration=calib[:2]))
    with pytest.raises(ValueError, match="budget must lie in"):
        generate(model, prompt, 2, capacity=48, attention_fn=decode.SparseAttention(M.Fathom(33), k=40,
                                                                                     calibration=calib))
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 24\]"):
        generate(model, prompt, 2, capacity=48, lengths=np.array([24, 0]),
                 attention_fn=decode.SparseAttention(M.SparQ(2), k=40))
    with pytest.raises(ValueError, match="equal-length prompts"):
        generate(model, prompt, 2, capacity=48, lengths=np.array([24, 20]))
    with pytest.raises(TypeError, match=r"DenseCache\(fn\)"):
        generate(model, prompt, 2, capacity=48, attention_fn=softmax_attention)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        generate(model, prompt, 0, capacity=48, attention_fn=decode.SparseAttention(M.SparQ(2), k=40))


def test_decode_step_past_capacity_raises_and_writes_nothing(model):
    """A full cache (60 prompt tokens + 4 steps = 64) refuses a fifth step instead of dropping its writes."""
    attn = decode.SparseAttention(M.SparQ(2), k=40, placement=decode.Placement("pinned_host"))
    _, cache, attn = sparse_forced(model, LONG, LONG[:, :4], attn, capacity=64)
    np.testing.assert_array_equal(cache.length, [64, 64])
    with pytest.raises(Exception, match="1 token\\(s\\) past capacity \\(length 64, capacity 64\\)"):
        jax.block_until_ready(generation.decode_step(model, LONG[:, 4], cache, attn))


def test_generate_sizes_the_cache_to_at_least_k(model):
    """A short prompt with a large k: generate's default capacity holds k rows (padding slots are masked)."""
    out = generate(model, PROMPTS[0], 3, attention_fn=decode.from_spec("sparq:2", k=40))
    assert out.shape == (2, 3)


@pytest.mark.parametrize("spec", ["fathom:16", "fathom_klt:16", "sparq:4", "landmark", "quest:16", "quest:8", "exact"])
@pytest.mark.parametrize("shared_kv", [False, True])
def test_cache_bytes_before_allocating_equals_the_cache(spec, shared_kv):
    """decode.cache_bytes (the host memory a cache will need, from shapes alone) = the allocated cache's bytes."""
    attn = decode.from_spec(spec, k=40)
    shape = CacheShape(layers=3, batch=2, kv_heads=3, capacity=200, head_dim=16, dtype=jnp.bfloat16)
    cache = attn.init_cache(shape, shared_kv=shared_kv)
    want = decode.cache_bytes(attn.index_parts, attn.row_layout(shape), n_layers=3, groups=6, capacity=200,
                              shared_kv=shared_kv)
    assert cache.nbytes() == want


@pytest.mark.parametrize("page", [16, 8])
def test_quest_pages_are_bulk_and_their_tail_stays_on_the_device(page):
    """Quest's page bounds grow with the context: a placement puts them with the K/V rows and the other index arrays
    (pinned_host where there is host memory); the raw keys of the newest page are small and stay in device memory.
    Their bytes are 2 x 16 D / P bits per token, as the method reads."""
    from fathom_jax.index.parts import Pages

    attn = decode.from_spec(f"quest:{page}", k=40, placement="pinned_host")
    shape = CacheShape(layers=3, batch=2, kv_heads=3, capacity=200, head_dim=16, dtype=jnp.bfloat16)
    cache = attn.init_cache(shape)
    assert cache.bulk().index[f"quest{page}"] == Pages(bounds=True, tail=False)
    data = cache.index[f"quest{page}"]
    assert data.bounds.shape == (3, 6, 256 // page, 32) and data.bounds.dtype == jnp.float16
    assert data.tail.shape == (3, 6, page, 16) and data.tail.dtype == jnp.float32
    assert data.bounds.sharding.memory_kind == cache.kv.sharding.memory_kind == attn.placement.memory_kind
    assert data.tail.sharding.memory_kind == "device"
    per_token = attn.method.fixed_bits_per_token(16) / 8
    assert cache.nbytes()[f"quest{page}"] == 3 * 6 * 256 * per_token == data.bounds.nbytes
