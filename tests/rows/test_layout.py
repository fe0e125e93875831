"""Compressed K/V rows in the decode cache: the row format's own bits, appends equal to encoding every token,
decoding equal to attention over the dequantized rows, the row cache, the bytes counted, bad formats refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import decode
from fathom_jax.decode import RowLayout, StepConfig
from fathom_jax.index import build_index
from fathom_jax.index.parts import KEYS
from fathom_jax.models import KVCache
from fathom_jax.models.attention import CacheShape
from fathom_jax.rows import formats as row_formats
from fathom_jax.scan import scan_scores
from fathom_jax.select import attend, select_topk, sparse_attention
from tests.support import ON_GPU, corpus_calibration, sparse_forced

# tests/decode/test_hook.py's long prompts (the second draw of its generator) and steps
_RNG = np.random.default_rng(7)
_RNG.integers(0, 97, (2, 2, 24))
LONG = _RNG.integers(0, 97, (2, 60)).astype(np.int32)
STEPS = 6

SMALL = dict(k=12, sink=2, local=4)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def calib(model):
    return corpus_calibration(model, 1)


@pytest.mark.parametrize("spec", ["k8v8", "k8v4g32a", "k4g32av4g32a", "k8g32v8a", "bf16"])
def test_layout_rows_are_the_formats_rows(spec):
    """Stored rows hold the format's own bytes (padded to words): split(join(k, v)) is the format's decode of its
    encode, bit for bit, and of a whole sequence encoded at once."""
    rng = np.random.default_rng(0)
    keys, values = (jnp.asarray(rng.standard_normal((3, 70, 64)) * 3, jnp.float32) for _ in range(2))
    layout = RowLayout.of(spec, 64, jnp.bfloat16)
    rows = layout.join(keys, values)
    assert rows.dtype == jnp.uint32 and rows.shape == (3, 70, layout.width)
    assert layout.row_bytes == -(-row_formats.parse(spec).row_bytes(64) // 4) * 4
    got = layout.split(rows)
    fmt = row_formats.parse(spec)
    want = fmt.decode(fmt.encode(keys, values))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w)[:, :70])


def test_model_rows_are_the_model_dtype_side_by_side():
    layout = RowLayout.of(None, 8, jnp.float32)
    assert (layout.width, layout.storage_dtype, layout.row_bytes, layout.spec) == (16, np.float32, 64, "model")
    keys, values = jnp.arange(16.0).reshape(2, 8), -jnp.arange(16.0).reshape(2, 8)
    np.testing.assert_array_equal(layout.join(keys, values), jnp.concatenate([keys, values], -1))
    assert RowLayout.of("model", 8, jnp.float32) == layout


def _random_dense(seed, *, layers=2, batch=2, kv_heads=2, capacity=200, head_dim=16):
    rng = np.random.default_rng(seed)
    shape = (layers, batch, kv_heads, capacity, head_dim)
    return KVCache(k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
                   v=jnp.asarray(rng.standard_normal(shape), jnp.float32), length=jnp.zeros((), jnp.int32))


@pytest.mark.parametrize("spec,implementation,memory", [
    ("k8v8", "xla", "device"), ("k8v4g8a", "xla", "device"), ("k8v8", "xla", "pinned_host"),
    pytest.param("k8v8", "triton", "pinned_host", marks=ON_GPU, id="gpu-k8v8"),
    pytest.param("k8v4g8a", "triton", "pinned_host", marks=ON_GPU, id="gpu-k8v4g8a")])
def test_rows_after_appends_equal_rows_of_all_keys(spec, implementation, memory):
    """A prefill of 70 / 45 tokens, then 5 decode steps through the attention step: every stored row is the format's
    row of its token (the appends through the kernels' writes too)."""
    kv = _random_dense(1)
    lengths, steps = np.array([70, 45]), 5
    attn = decode.from_spec("fathom:16", k=40, rows=spec, implementation=implementation, placement=memory)
    cache, attn = decode.cache_from_dense(kv, lengths, attn)
    rng = np.random.default_rng(2)
    layers, groups, d = kv.k.shape[0], kv.k.shape[1] * kv.k.shape[2], kv.k.shape[-1]
    keys, values = np.array(kv.k), np.array(kv.v)
    for t in range(steps):
        q = jnp.asarray(rng.standard_normal((layers, groups, 3, d)), jnp.float32)
        new_k, new_v = (rng.standard_normal((layers, groups, d)).astype(np.float32) for _ in range(2))
        _, cache = decode.attention_step(q, jnp.asarray(new_k), jnp.asarray(new_v), cache, attn)
        for g, n in enumerate(np.repeat(lengths, 2)):
            b, h = divmod(g, 2)
            keys[:, b, h, n + t], values[:, b, h, n + t] = new_k[:, g], new_v[:, g]
    layout = cache.layout
    want = np.asarray(layout.join(jnp.asarray(keys), jnp.asarray(values))).reshape(layers, groups, -1, layout.width)
    got = np.asarray(jax.device_get(cache.kv))
    for g, n in enumerate(np.repeat(lengths, 2) + steps):
        np.testing.assert_array_equal(got[:, g, :n], want[:, g, :n])


def reference_step(attn, layout, keys, values, lengths, q):
    """Attention of ``q [L, R, G, D]`` written from the library's per-head pieces over the format's dequantized rows:
    the index built from the raw keys (the cache's index sees the keys before any row format; the exact oracle
    scores the rows' keys), every head selecting and attending over its own rows."""
    method, layers = attn.method, keys.shape[0]
    kq, vq = layout.split(layout.join(keys, values))
    outs = []
    for layer in range(layers):
        scored = kq[layer] if KEYS in method.parts else keys[layer]
        if method.selects_all:
            mask = jnp.arange(keys.shape[2]) < lengths[:, None, None]
            outs.append(attend(q[layer], kq[layer], vq[layer], jnp.broadcast_to(mask, q.shape[1:3] + keys.shape[2:3])))
            continue
        index = build_index(scored, None, method.parts, capacity=keys.shape[2], length=lengths)
        scores = scan_scores(method, q[layer], index, None, implementation="xla").scores
        sel, mask = select_topk(scores, lengths, attn.k, sink=attn.sink, local=attn.local, implementation="xla")
        outs.append(sparse_attention(q[layer], kq[layer], vq[layer], sel, mask))
    return np.stack([np.asarray(o) for o in outs])


@pytest.mark.parametrize("implementation", ["xla", pytest.param("triton", marks=ON_GPU, id="gpu")])
@pytest.mark.parametrize("spec,rows", [("sparq:2", "k8v8"), ("landmark", "k8v8"), ("exact", "k8v8"), ("dense", "k8v8"),
                                       ("sparq:2", "k8v4g8a"), ("sparq:2", "bf16"), ("exact", "bf16")])
def test_step_attends_over_the_dequantized_rows(spec, rows, implementation, full_f32_matmuls):
    """Three attention steps over a prefilled cache with compressed rows: each equals attention over the dequantized
    rows (selection by the method on its own index, the new token's row patched in), and the format changes the
    result. Full f32 GEMMs: with TF32 on the GPU the step and the reference differed by 3e-4 of 0.67."""
    kv = _random_dense(3, capacity=128)
    lengths = np.array([70, 45])
    attn = decode.from_spec(spec, k=24 if spec != "dense" else 128, sink=2, local=4, rows=rows,
                            implementation=implementation)
    cache, attn = decode.cache_from_dense(kv, lengths, attn)
    plain_cache, plain = decode.cache_from_dense(kv, lengths, dataclasses.replace(attn, rows=None, run=None))
    layers, groups, d = kv.k.shape[0], 4, kv.k.shape[-1]
    keys, values = (np.array(x).reshape(layers, groups, -1, d) for x in (kv.k, kv.v))
    group_lengths = np.repeat(lengths, 2)
    rng = np.random.default_rng(4)
    for t in range(3):
        q = jnp.asarray(rng.standard_normal((layers, groups, 3, d)), jnp.float32)
        new_k, new_v = (rng.standard_normal((layers, groups, d)).astype(np.float32) for _ in range(2))
        for g, n in enumerate(group_lengths + t):
            keys[:, g, n], values[:, g, n] = new_k[:, g], new_v[:, g]
        got, cache = decode.attention_step(q, jnp.asarray(new_k), jnp.asarray(new_v), cache, attn)
        want = reference_step(attn, cache.layout, jnp.asarray(keys), jnp.asarray(values),
                              jnp.asarray(group_lengths + t + 1), q)
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 * np.abs(want).max())
        without, plain_cache = decode.attention_step(q, jnp.asarray(new_k), jnp.asarray(new_v), plain_cache, plain)
        assert np.abs(np.asarray(got) - np.asarray(without)).max() > 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("implementation,split", [
    ("xla", {}), pytest.param("triton", dict(pipeline=2), marks=ON_GPU, id="gpu")])  # interpreted: ~30 s more on CPU
def test_row_cache_holds_compressed_rows(model, calib, implementation, split):
    """With a row cache the slots hold the stored words and every logit is the same bits as without one."""
    common = dict(calibration=calib, implementation=implementation, rows="k8v8", **SMALL)
    memory = "pinned_host" if split else "device"
    plain = decode.from_spec("fathom:16", placement=memory, step=StepConfig(**split), **common)
    cached = decode.from_spec("fathom:16", placement=memory, step=StepConfig(row_cache=16, **split), **common)
    lengths = np.array([60, 47])
    want, _, _ = sparse_forced(model, LONG, LONG[:, :STEPS], plain, capacity=72, lengths=lengths)
    got, cache, _ = sparse_forced(model, LONG, LONG[:, :STEPS], cached, capacity=72, lengths=lengths)
    np.testing.assert_array_equal(got, want)
    tags, rows, kv = (np.asarray(a) for a in (cache.row_cache.tags, cache.row_cache.rows, cache.kv))
    layer, group, slot = np.nonzero(tags)
    assert len(slot) > 0 and rows.dtype == np.uint32
    np.testing.assert_array_equal(rows[layer, group, slot], kv[layer, group, tags[layer, group, slot] - 1])


@pytest.mark.parametrize("rows", [None, "k8v8", "k4g8av4g8a"])
def test_bytes_count_the_format(rows):
    """cache_bytes (the host-memory check's sizes) and the allocated cache count the format's words per row."""
    attn = decode.from_spec("fathom:16", k=40, rows=rows)
    shape = CacheShape(layers=3, batch=2, kv_heads=3, capacity=200, head_dim=16, dtype=jnp.bfloat16)
    cache = attn.init_cache(shape)
    layout = attn.row_layout(shape)
    assert cache.nbytes() == decode.cache_bytes(attn.index_parts, layout, n_layers=3, groups=6, capacity=200)
    assert cache.nbytes()["kv"] == 3 * 6 * 256 * layout.row_bytes
    assert layout.row_bytes == {None: 64, "k8v8": 36, "k4g8av4g8a": 32}[rows]


def test_bad_row_formats_give_clear_errors(model):
    with pytest.raises(ValueError, match=r"rows='k4c64av4g32a'.*per block of tokens"):
        decode.from_spec("fathom:16", k=40, rows="k4c64av4g32a")
    with pytest.raises(ValueError, match="per block of tokens"):
        decode.from_spec("fathom:16", k=40, rows="kstorev8")
    with pytest.raises(ValueError, match="unknown row format"):
        decode.from_spec("fathom:16", k=40, rows="k3v8")
    attn = decode.from_spec("fathom:16", k=40, rows="k4g32av8")  # the tiny model's head_dim 8 has no 32-groups
    shape = CacheShape(layers=3, batch=1, kv_heads=2, capacity=64, head_dim=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match="head_dim 8 is not a multiple of the group of 32"):
        attn.bind(shape)
    big = KVCache(k=jnp.full((3, 1, 2, 64, 8), 1e6, jnp.float32), v=jnp.zeros((3, 1, 2, 64, 8), jnp.float32),
                  length=jnp.zeros((), jnp.int32))
    with pytest.raises(Exception, match="fp16 scales hold"):  # beyond what the scales hold: refused at the prefill
        decode.cache_from_dense(big, np.array([40]), decode.from_spec("fathom:16", k=40, rows="k8v8"))
