"""Greedy generation and q/k/v capture on a tiny random model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fathom_jax.models import DenseCache, capture_qkv, generate, generation, softmax_attention

from tests.support import TINY_TOKENS as TOKENS
from tests.support import forced_logits


def test_generate_is_greedy_and_compiles_once(model, CFG):
    prompt = TOKENS[0, :5]
    out = np.asarray(generate(model, prompt, 6, capacity=16))
    # Greedy <=> each new token is the argmax of a teacher-forced prefill at the previous position.
    seq = np.concatenate([prompt, out[:-1]])[None]
    lg, _ = forced_logits(model, seq, 16)
    assert out.tolist() == np.argmax(lg[0, 4:], -1).tolist()
    size = generation.generate_program()._cache_size()
    generate(model, TOKENS[1, :5], 6, capacity=16)
    assert generation.generate_program()._cache_size() == size  # same shapes: no recompilation
    batched = np.asarray(generate(model, TOKENS[:, :5], 6, capacity=16))
    assert batched[0].tolist() == out.tolist()


def test_capture_qkv(model, full_logits, CFG):
    _, cache = full_logits
    got = capture_qkv(model, TOKENS[0])
    t = TOKENS.shape[1]
    assert got["q"].shape == (CFG.n_layers, CFG.n_heads, t, CFG.head_dim)
    assert got["k"].shape == got["v"].shape == (CFG.n_layers, CFG.n_kv_heads, t, CFG.head_dim)
    assert all(a.dtype == jnp.float32 for a in got.values())
    np.testing.assert_allclose(got["k"], cache.k[:, 0, :, :t], atol=1e-5)
    np.testing.assert_allclose(got["v"], cache.v[:, 0, :, :t], atol=1e-5)
    # q: the layer-0 query of the last position equals the one a decode step computes.
    q_last_l0 = got["q"][0, :, -1].reshape(CFG.n_kv_heads, -1, CFG.head_dim)
    lq = _layer0_query(model, TOKENS[0, t - 1], t - 1, CFG)
    np.testing.assert_allclose(q_last_l0, lq, atol=1e-5)


def _layer0_query(model, token, position, CFG):
    """Layer-0 post-RoPE query of one decode step, computed directly from the module."""
    layer0 = nnx.merge(*_split_layer0(model))
    x = model.embed(jnp.asarray([[token]]))
    q, _, _ = layer0.self_attn.qkv(CFG, layer0.input_layernorm(x), position + jnp.arange(1))
    return q[0, :, :, 0]


def _split_layer0(model):
    graphdef, state = nnx.split(model.layers)
    return graphdef, jax.tree.map(lambda a: a[0], state)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledAttention:
    """A callable pytree hook: per-layer logit scales are traced data, not baked constants."""

    scale: jax.Array  # [n_layers]

    def __call__(self, q, k, v, length, layer):
        return softmax_attention(q * self.scale[layer], k, v, length, layer)


def test_pytree_attention_fn_is_traced_not_recompiled(model, full_logits, CFG):
    logits, _ = full_logits
    prompt = TOKENS[:, :5]
    ones = DenseCache(ScaledAttention(jnp.ones(CFG.n_layers)))
    out = np.asarray(generate(model, prompt, 4, capacity=16, attention_fn=ones))
    assert out.tolist() == np.asarray(generate(model, prompt, 4, capacity=16)).tolist()
    size = generation.generate_program()._cache_size()
    hot = DenseCache(ScaledAttention(jnp.full(CFG.n_layers, 30.0, jnp.float32)))  # same dtype, not weak-typed
    generate(model, prompt, 4, capacity=16, attention_fn=hot)
    assert generation.generate_program()._cache_size() == size  # new arrays, same program
    a, _ = forced_logits(model, TOKENS, 16, ones)
    b, _ = forced_logits(model, TOKENS, 16, hot)
    np.testing.assert_allclose(a, logits, atol=1e-5 * np.abs(logits).max())
    assert np.abs(b[:, 11] - a[:, 11]).max() > 1e-3
