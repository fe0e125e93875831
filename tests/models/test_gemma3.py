"""The Gemma 3 decoder on tiny models: window attention against a numpy reference, self-consistency of the prompt
and decode steps across the window's wrap, the global layers' attention hook, generate and capture; and logit
and greedy parity with transformers' Gemma3ForCausalLM on a tiny random checkpoint (tests/oracle)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fathom_jax import models
from fathom_jax.models import DenseCache, generation, softmax_attention
from fathom_jax.models import gemma3 as G
from fathom_jax.models.capture import causal_attention
from fathom_jax.models.gemma3.windows import window_attention

from tests.support import TINY_GEMMA3 as CFG
from tests.support import forced_logits

TOKENS = np.random.default_rng(0).integers(0, 97, (2, 13)).astype(np.int32)


def max_rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def model():
    m = G.Gemma3ForCausalLM(CFG, rngs=nnx.Rngs(0))
    # Zero-initialised norms (scale 1 + 0) would hide a swapped or dropped norm: randomise them.
    state = nnx.state(m)
    keys = iter(jax.random.split(jax.random.key(1), 64))
    nnx.update(m, jax.tree.map_with_path(
        lambda p, a: a + 0.3 * jax.random.normal(next(keys), a.shape) if "norm" in str(p) else a, state))
    return m


@pytest.fixture(scope="module")
def full_logits(model):
    """Teacher-forced logits [B, T, V] at every position (decode steps across the window's wrap), and the state."""
    return forced_logits(model, TOKENS, 16)


def prompt_logits(model, tokens, attention=None):
    lengths = np.full(tokens.shape[0], tokens.shape[1])
    logits, state, attention = generation.prefill(model, tokens, lengths, attention or DenseCache(), 16)
    return np.asarray(logits), state, attention


def test_config_layout():
    assert (CFG.global_layers, CFG.local_layers, CFG.n_blocks, CFG.n_tail) == ((2, 5), (0, 1, 3, 4), 2, 0)
    assert CFG.layer_types[2] == "full_attention" and CFG.layer_types[4] == "sliding_attention"
    assert CFG.query_scale == pytest.approx(np.sqrt(8 / 6))
    hash(CFG)  # static jit argument
    tail = dataclasses.replace(CFG, n_layers=8)
    assert (tail.global_layers, tail.local_layers[-2:], tail.n_tail) == ((2, 5), (6, 7), 2)


def _window_reference(q, keys, values, start, w):
    """Query t (position start + t) over keys at positions (p - w, p], from the whole history keys [B,H,N,D]."""
    d, t = q.shape[-1], q.shape[3]
    out = np.zeros(q.shape)
    for i in range(t):
        p = start + i
        lo = max(0, p - w + 1)
        s = np.einsum("bhgd,bhnd->bhgn", q[:, :, :, i], keys[:, :, lo:p + 1]) / np.sqrt(d)
        e = np.exp(s - s.max(-1, keepdims=True))
        out[:, :, :, i] = np.einsum("bhgn,bhnd->bhgd", e / e.sum(-1, keepdims=True), values[:, :, lo:p + 1])
    return out


_window_jit = jax.jit(window_attention, static_argnames="chunk")


# (ring part-filled, more new tokens than the window), (one decode step, ring wrapped), (queries by chunks of 3,
# padded, from an empty ring)
@pytest.mark.parametrize("start, t, chunk", [(3, 6, 1024), (9, 1, 1024), (0, 11, 3)])
def test_window_attention_matches_reference(start, t, chunk):
    rng = np.random.default_rng(start * 100 + t)
    b, h, g, d, w = 2, 2, 3, 8, 4
    keys = rng.standard_normal((b, h, start + t, d)).astype(np.float32)
    values = rng.standard_normal((b, h, start + t, d)).astype(np.float32)
    q = rng.standard_normal((b, h, g, t, d)).astype(np.float32)
    ring_k, ring_v = np.zeros((b, h, w, d), np.float32), np.zeros((b, h, w, d), np.float32)
    for p in range(start):  # the ring after positions [0, start): position p in slot p % w
        ring_k[:, :, p % w], ring_v[:, :, p % w] = keys[:, :, p], values[:, :, p]
    o, rk, rv = _window_jit(q, keys[:, :, start:], values[:, :, start:], ring_k, ring_v, np.int32(start), chunk=chunk)
    np.testing.assert_allclose(o, _window_reference(q, keys, values, start, w), atol=1e-5)
    for p in range(max(0, start + t - w), start + t):
        np.testing.assert_array_equal(rk[:, :, p % w], keys[:, :, p])
        np.testing.assert_array_equal(rv[:, :, p % w], values[:, :, p])


def test_capture_attention_by_chunks_matches_whole():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((1, 2, 2, 10, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 2, 10, 8)), jnp.float32) for _ in range(2))
    run = jax.jit(causal_attention, static_argnums=3)
    np.testing.assert_allclose(run(q, k, v, 4), run(q, k, v, None), atol=1e-6)


def test_prompt_matches_decode_steps_across_the_window(model, full_logits):
    """Prompts shorter and longer than the window against the decode steps' logits, and the state they leave."""
    logits, state13 = full_logits
    for t in (1, 6, 13):
        last, state, _ = prompt_logits(model, TOKENS[:, :t])
        np.testing.assert_allclose(last, logits[:, t - 1], rtol=0, atol=1e-5 * np.abs(logits).max())
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state13)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_the_global_layers_attention_hook(model, full_logits):
    """A spying dense-cache hook sees the documented shapes, is called once per global layer with its ordinal, and
    gets the queries capture_qkv reports."""
    logits, _ = full_logits
    seen, queries = [], {}

    def spy(q, k, v, length, layer):
        seen.append((q.shape, k.shape, v.shape, jnp.shape(length), jnp.shape(layer)))
        jax.debug.callback(lambda g, q: queries.__setitem__(int(g), np.asarray(q)), layer, q)
        return softmax_attention(q, k, v, length, layer)

    _, state, attn = prompt_logits(model, TOKENS[:, :12], DenseCache(spy))
    _, out, after = generation.decode_step(model, TOKENS[:, 12], state, attn)
    jax.effects_barrier()
    assert np.all(np.asarray(after.windows.length) == 13) and int(after.cache.length) == 13
    assert seen == [((2, 2, 2, 8), (2, 2, 16, 8), (2, 2, 16, 8), (), ())]  # traced once, global layers only
    assert sorted(queries) == [0, 1]
    np.testing.assert_allclose(out, logits[:, 12], atol=1e-5 * np.abs(logits).max())
    got = models.capture_qkv(model, TOKENS[0])
    for g in range(2):
        np.testing.assert_allclose(got["q"][g, :, -1], queries[g][0].reshape(CFG.n_heads, 8), atol=1e-5)

    def drop_last(q, k, v, length, layer):  # the hook is really used
        return softmax_attention(q, k, v, length - 1, layer)

    _, state, attn = prompt_logits(model, TOKENS[:, :12], DenseCache(drop_last))
    _, out2, _ = generation.decode_step(model, TOKENS[:, 12], state, attn)
    assert np.abs(np.asarray(out2) - logits[:, 12]).max() > 1e-3


def test_generate_is_greedy_and_compiles_once(model, full_logits):
    """Generation (window rings, the dense CacheAttention on the global layers) against teacher-forced prefill."""
    out = np.asarray(models.generate(model, TOKENS[:, :5], 9, capacity=16))
    seq = np.concatenate([TOKENS[:, :5], out[:, :-1]], 1)
    lg, _ = forced_logits(model, seq, 16)
    assert out.tolist() == np.argmax(lg[:, 4:], -1).tolist()
    program = generation.generate_program()
    size = program._cache_size()
    again = models.generate(model, TOKENS[:, 1:6], 9, capacity=16)  # the same program
    assert program._cache_size() == size and again.shape == (2, 9)
    with pytest.raises(ValueError, match="equal-length"):
        models.generate(model, TOKENS[:, :5], 9, lengths=np.array([5, 4]))
    with pytest.raises(ValueError, match="exceeds cache capacity 10"):
        models.generate(model, TOKENS[0], 4, capacity=10)


def test_sparse_attention_plugs_into_the_global_layers(model):
    """Fathom's sparse decode step (fathom_jax.decode, its own cache and key index over the global layers only) as
    the global layers' attention: with k = the capacity it selects every token, so greedy tokens are dense
    decoding's."""
    from fathom_jax import decode

    dense = np.asarray(models.generate(model, TOKENS[:, :5], 9, capacity=16))
    sparse = decode.from_spec("fathom:16", k=16, sink=2, local=4, calibration="session")
    np.testing.assert_array_equal(models.generate(model, TOKENS[:, :5], 9, capacity=16, attention_fn=sparse), dense)


def test_capture_qkv_of_the_global_layers(model, full_logits):
    _, state = full_logits
    t = TOKENS.shape[1]
    got = models.capture_qkv(model, TOKENS[0])
    assert got["q"].shape == (2, CFG.n_heads, t, CFG.head_dim) and got["k"].shape == (2, CFG.n_kv_heads, t, 8)
    np.testing.assert_allclose(got["k"], state.cache.k[:, 0, :, :t], atol=1e-5)
    np.testing.assert_allclose(got["v"], state.cache.v[:, 0, :, :t], atol=1e-5)
    with pytest.raises(ValueError, match="one non-empty sequence"):
        models.capture_qkv(model, TOKENS)


def test_embedding_scale_is_rounded_to_the_model_dtype(model):
    m16 = nnx.eval_shape(lambda: G.Gemma3ForCausalLM(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    nnx.update(m16, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(model)))
    x = m16.embed(jnp.asarray(TOKENS[:, :3]))
    table = m16.embed_tokens.embedding[...]
    want = table[TOKENS[:, :3]] * jnp.bfloat16(np.sqrt(32.0))  # transformers: the scale cast to the weights' dtype
    assert x.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(want, np.float32))


def test_hf_tiny_logit_and_greedy_parity(tiny_checkpoints):
    from fathom_jax.models import hub
    from fathom_jax.models.gemma3 import loading as gemma3_loading

    path = os.path.join(tiny_checkpoints, "gemma3")
    ref = np.load(os.path.join(path, "ref.npz"))
    model, cfg = gemma3_loading.load_hf_checkpoint(path)
    assert hub.model_config(path) == cfg  # the hub tells a Gemma 3 checkpoint from a Llama one
    assert (cfg.n_layers, cfg.sliding_window, cfg.global_layers, cfg.n_tail) == (5, 4, (1, 3), 1)
    assert (cfg.query_pre_attn_scalar, cfg.final_logit_softcapping, cfg.rope_scaling.factor) == (12.0, 10.0, 2.0)
    tokens = ref["tokens"]  # 24 tokens: six windows
    logits, _ = forced_logits(model, tokens[None], 64)
    err = max_rel_err(logits[0], ref["logits"])
    assert err < 1e-4, f"gemma3: max relative logit error {err:.2e}"
    gen = np.asarray(models.generate(model, tokens[:8], len(ref["greedy"]), capacity=64))
    np.testing.assert_array_equal(gen, ref["greedy"])
