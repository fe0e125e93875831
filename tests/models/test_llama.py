"""Decoder self-consistency on tiny random models (no reference needed)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fathom_jax.models import llama
from fathom_jax.models.config import LlamaConfig, RopeScaling
from fathom_jax.models.llama import KVCache, LlamaForCausalLM, capture_qkv, dense_attention, generate

CFG = LlamaConfig(
    vocab=97, hidden=32, intermediate=48, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=8,
    rope_theta=1e4, rms_norm_eps=1e-6, attention_bias=True, qk_norm=True,
)
TOKENS = np.random.default_rng(0).integers(0, CFG.vocab, (2, 12)).astype(np.int32)


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def full_logits(model):
    logits, cache = model.prefill(jnp.asarray(TOKENS), KVCache.init(CFG, 2, 16))
    assert int(cache.length) == TOKENS.shape[1]
    return np.asarray(logits), cache


def test_jitted_decode_matches_prefill_at_every_position(model, full_logits):
    logits, _ = full_logits
    step = nnx.jit(lambda m, tok, cache: m.decode_step(tok, cache))
    _, cache = model.prefill(jnp.asarray(TOKENS[:, :1]), KVCache.init(CFG, 2, 16))
    for t in range(1, TOKENS.shape[1]):
        out, cache = step(model, jnp.asarray(TOKENS[:, t]), cache)
        np.testing.assert_allclose(out, logits[:, t], rtol=0, atol=1e-5 * np.abs(logits).max())
    assert int(cache.length) == TOKENS.shape[1]


def test_chunked_prefill_matches_full(model, full_logits):
    logits, full_cache = full_logits
    first, cache = model.prefill(jnp.asarray(TOKENS[:, :5]), KVCache.init(CFG, 2, 16))
    second, cache = model.prefill(jnp.asarray(TOKENS[:, 5:]), cache)
    np.testing.assert_allclose(np.concatenate([first, second], 1), logits, atol=1e-5 * np.abs(logits).max())
    np.testing.assert_allclose(cache.k[:, :, :, :12], full_cache.k[:, :, :, :12], atol=1e-5)
    last, _ = model.prefill(jnp.asarray(TOKENS), KVCache.init(CFG, 2, 16), last_only=True)
    np.testing.assert_allclose(last, logits[:, -1], atol=1e-5 * np.abs(logits).max())


def test_decode_at_explicit_position_overwrites_slot(model, full_logits):
    logits, cache = full_logits
    # Re-decoding token 7 at position 7 over a cache filled to 12 must ignore slots 8..11.
    out, new = model.decode_step(jnp.asarray(TOKENS[:, 7]), cache, 7)
    assert int(new.length) == 8
    np.testing.assert_allclose(out, logits[:, 7], atol=1e-5 * np.abs(logits).max())


def test_attention_fn_hook_gets_documented_shapes(model, full_logits):
    logits, _ = full_logits
    seen = []

    def spy(q, k, v, length, layer):
        seen.append((q.shape, k.shape, v.shape, jnp.shape(length), jnp.shape(layer)))
        return dense_attention(q, k, v, length, layer)

    _, cache = model.prefill(jnp.asarray(TOKENS[:, :11]), KVCache.init(CFG, 2, 16))
    out, _ = model.decode_step(jnp.asarray(TOKENS[:, 11]), cache, attention_fn=spy)
    g = CFG.n_heads // CFG.n_kv_heads
    assert seen == [((2, 2, g, 8), (2, 2, 16, 8), (2, 2, 16, 8), (), ())]  # traced once under scan
    np.testing.assert_allclose(out, logits[:, 11], atol=1e-5 * np.abs(logits).max())

    # A hook that ignores the newest key must change the output: the hook is really used.
    def drop_last(q, k, v, length, layer):
        return dense_attention(q, k, v, length - 1, layer)

    out2, _ = model.decode_step(jnp.asarray(TOKENS[:, 11]), cache, attention_fn=drop_last)
    assert np.abs(np.asarray(out2) - logits[:, 11]).max() > 1e-3


def test_generate_is_greedy_and_compiles_once(model):
    prompt = TOKENS[0, :5]
    out = np.asarray(generate(model, prompt, 6, capacity=16))
    # Greedy <=> each new token is the argmax of a teacher-forced prefill at the previous position.
    seq = np.concatenate([prompt, out[:-1]])[None]
    lg, _ = model.prefill(jnp.asarray(seq), KVCache.init(CFG, 1, 16))
    assert out.tolist() == np.argmax(np.asarray(lg[0, 4:]), -1).tolist()
    size = llama._generate._cache_size()
    generate(model, TOKENS[1, :5], 6, capacity=16)
    assert llama._generate._cache_size() == size  # same shapes: no recompilation
    batched = np.asarray(generate(model, TOKENS[:, :5], 6, capacity=16))
    assert batched[0].tolist() == out.tolist()


def test_prompt_longer_than_cache_raises(model):
    with pytest.raises(ValueError, match="capacity 8"):
        model.prefill(jnp.asarray(TOKENS), KVCache.init(CFG, 2, 8))
    with pytest.raises(ValueError, match="exceeds cache capacity 10"):
        generate(model, TOKENS[0], 4, capacity=10)
    _, cache = model.prefill(jnp.asarray(TOKENS[:, :6]), KVCache.init(CFG, 2, 8))
    with pytest.raises(ValueError, match="exceeds capacity 8"):
        model.prefill(jnp.asarray(TOKENS[:, :3]), cache)
    with pytest.raises(ValueError, match=r"tokens \[batch, T\]"):
        model.prefill(jnp.asarray(TOKENS[0]), KVCache.init(CFG, 1, 16))
    full = dataclasses.replace(cache, length=jnp.int32(8))
    with pytest.raises(ValueError, match="exceeds capacity 8"):
        model.decode_step(jnp.asarray(TOKENS[:, 0]), full)


def test_capture_qkv(model, full_logits):
    _, cache = full_logits
    got = capture_qkv(model, TOKENS[0])
    t = TOKENS.shape[1]
    assert got["q"].shape == (CFG.n_layers, CFG.n_heads, t, CFG.head_dim)
    assert got["k"].shape == got["v"].shape == (CFG.n_layers, CFG.n_kv_heads, t, CFG.head_dim)
    assert all(a.dtype == jnp.float32 for a in got.values())
    np.testing.assert_allclose(got["k"], cache.k[:, 0, :, :t], atol=1e-5)
    np.testing.assert_allclose(got["v"], cache.v[:, 0, :, :t], atol=1e-5)
    # q: the layer-0 query of the last position equals the one a decode step computes.
    _, pre = model.prefill(jnp.asarray(TOKENS[:1, : t - 1]), KVCache.init(CFG, 1, 16))
    q_last_l0 = got["q"][0, :, -1].reshape(CFG.n_kv_heads, -1, CFG.head_dim)
    lq = _layer0_query(model, TOKENS[0, t - 1], pre)
    np.testing.assert_allclose(q_last_l0, lq, atol=1e-5)


def _layer0_query(model, token, cache):
    """Layer-0 post-RoPE query of one decode step, computed directly from the module."""
    layer0 = nnx.merge(*_split_layer0(model))
    x = model.embed_tokens(jnp.asarray([[token]]))
    q, _, _ = layer0.self_attn.qkv(CFG, layer0.input_layernorm(x), cache.length + jnp.arange(1))
    return q[0, :, :, 0]


def _split_layer0(model):
    graphdef, state = nnx.split(model.layers)
    return graphdef, jax.tree.map(lambda a: a[0], state)


def test_llama3_inv_freq_regimes():
    cfg = dataclasses.replace(CFG, head_dim=16, rope_theta=5e5,
                              rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    base = llama.rope_inv_freq(dataclasses.replace(cfg, rope_scaling=None))
    scaled = llama.rope_inv_freq(cfg)
    wavelen = 2 * np.pi / base
    np.testing.assert_allclose(scaled[wavelen < 16], base[wavelen < 16])  # high freq: kept
    np.testing.assert_allclose(scaled[wavelen > 64], base[wavelen > 64] / 8)  # low freq: / factor
    mid = (wavelen >= 16) & (wavelen <= 64)
    assert mid.any() and np.all((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8))


def test_bf16_model_runs_close_to_f32(model, full_logits):
    logits, _ = full_logits
    m16 = nnx.eval_shape(lambda: LlamaForCausalLM(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    nnx.update(m16, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(model)))
    out, cache = m16.prefill(jnp.asarray(TOKENS), KVCache.init(CFG, 2, 16, jnp.bfloat16))
    assert out.dtype == jnp.float32 and cache.k.dtype == jnp.bfloat16
    assert np.abs(np.asarray(out) - logits).max() < 0.05 * np.abs(logits).max()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledAttention:
    """A callable pytree hook: per-layer logit scales are traced data, not baked constants."""

    scale: jax.Array  # [n_layers]

    def __call__(self, q, k, v, length, layer):
        return dense_attention(q * self.scale[layer], k, v, length, layer)


def test_pytree_attention_fn_is_traced_not_recompiled(model, full_logits):
    logits, _ = full_logits
    prompt = TOKENS[:, :5]
    ones = ScaledAttention(jnp.ones(CFG.n_layers))
    out = np.asarray(generate(model, prompt, 4, capacity=16, attention_fn=ones))
    assert out.tolist() == np.asarray(generate(model, prompt, 4, capacity=16)).tolist()
    size = llama._generate._cache_size()
    hot = ScaledAttention(jnp.full(CFG.n_layers, 30.0, jnp.float32))  # same dtype, not weak-typed
    generate(model, prompt, 4, capacity=16, attention_fn=hot)
    assert llama._generate._cache_size() == size  # new arrays, same program
    _, cache = model.prefill(jnp.asarray(TOKENS[:, :11]), KVCache.init(CFG, 2, 16))
    a, _ = model.decode_step(jnp.asarray(TOKENS[:, 11]), cache, attention_fn=ones)
    b, _ = model.decode_step(jnp.asarray(TOKENS[:, 11]), cache, attention_fn=hot)
    np.testing.assert_allclose(a, logits[:, 11], atol=1e-5 * np.abs(logits).max())
    assert np.abs(np.asarray(b) - np.asarray(a)).max() > 1e-3
