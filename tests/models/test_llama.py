"""The decoder (prefill, decode step, attention hook) on a tiny random model: self-consistency."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fathom_jax.models import KVCache, LlamaForCausalLM, dense_attention, generate

from tests.support import TINY_TOKENS as TOKENS


def test_jitted_decode_matches_prefill_at_every_position(model, full_logits, CFG):
    logits, _ = full_logits
    step = nnx.jit(lambda m, tok, cache: m.decode_step(tok, cache))
    _, cache = model.prefill(jnp.asarray(TOKENS[:, :1]), KVCache.init(CFG, 2, 16))
    for t in range(1, TOKENS.shape[1]):
        out, cache = step(model, jnp.asarray(TOKENS[:, t]), cache)
        np.testing.assert_allclose(out, logits[:, t], rtol=0, atol=1e-5 * np.abs(logits).max())
    assert int(cache.length) == TOKENS.shape[1]


def test_chunked_prefill_matches_full(model, full_logits, CFG):
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


def test_attention_fn_hook_gets_documented_shapes(model, full_logits, CFG):
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


def test_prompt_longer_than_cache_raises(model, CFG):
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


def test_bf16_model_runs_close_to_f32(model, full_logits, CFG):
    logits, _ = full_logits
    m16 = nnx.eval_shape(lambda: LlamaForCausalLM(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    nnx.update(m16, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(model)))
    out, cache = m16.prefill(jnp.asarray(TOKENS), KVCache.init(CFG, 2, 16, jnp.bfloat16))
    assert out.dtype == jnp.float32 and cache.k.dtype == jnp.bfloat16
    assert np.abs(np.asarray(out) - logits).max() < 0.05 * np.abs(logits).max()


