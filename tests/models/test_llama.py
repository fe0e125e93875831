"""The Llama decoder on a tiny random model, through the decoder protocol: self-consistency of the prompt and the
decode step, the dense cache's attention function hook, bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fathom_jax.models import DenseCache, LayerwiseDecoder, LlamaForCausalLM, generate, generation, softmax_attention

from tests.support import TINY_TOKENS as TOKENS


def prompt_logits(model, tokens, capacity=16, attention=None):
    """The prompt's last-token logits and decode state (dense cache)."""
    lengths = np.full(tokens.shape[0], tokens.shape[1])
    logits, state, attention = generation.prefill(model, tokens, lengths, attention or DenseCache(), capacity)
    return np.asarray(logits), state, attention


def test_prompt_matches_decode_steps_at_every_length(model, full_logits):
    """The prompt path (a whole prompt, layer by layer) against the decode steps' teacher-forced logits."""
    logits, _ = full_logits
    assert isinstance(model, LayerwiseDecoder)
    for t in (1, 5, 12):
        last, state, _ = prompt_logits(model, TOKENS[:, :t])
        np.testing.assert_allclose(last, logits[:, t - 1], rtol=0, atol=1e-5 * np.abs(logits).max())
        assert int(state.length) == t
    fused, _ = model.forward_prompt(DenseCache(), jnp.asarray(TOKENS), jnp.full((2,), 12), model.init_state(
        DenseCache(), 2, 16))  # the one-program prompt (a layer scan) is the layer-by-layer one's
    np.testing.assert_array_equal(np.asarray(fused), prompt_logits(model, TOKENS)[0])


def test_attention_fn_hook_gets_documented_shapes(model, full_logits, CFG):
    logits, _ = full_logits
    seen = []

    def spy(q, k, v, length, layer):
        seen.append((q.shape, k.shape, v.shape, jnp.shape(length), jnp.shape(layer)))
        return softmax_attention(q, k, v, length, layer)

    _, state, attn = prompt_logits(model, TOKENS[:, :11], attention=DenseCache(spy))
    _, out, _ = generation.decode_step(model, TOKENS[:, 11], state, attn)
    g = CFG.n_heads // CFG.n_kv_heads
    assert seen == [((2, 2, g, 8), (2, 2, 16, 8), (2, 2, 16, 8), (), ())]  # traced once under scan
    np.testing.assert_allclose(out, logits[:, 11], atol=1e-5 * np.abs(logits).max())

    # A hook that ignores the newest key must change the output: the hook is really used.
    def drop_last(q, k, v, length, layer):
        return softmax_attention(q, k, v, length - 1, layer)

    _, state, attn = prompt_logits(model, TOKENS[:, :11], attention=DenseCache(drop_last))
    _, out2, _ = generation.decode_step(model, TOKENS[:, 11], state, attn)
    assert np.abs(np.asarray(out2) - logits[:, 11]).max() > 1e-3


def test_bad_attention_and_capacity_are_named(model):
    with pytest.raises(ValueError, match="exceeds cache capacity 10"):
        generate(model, TOKENS[0], 4, capacity=10)
    with pytest.raises(TypeError, match=r"DenseCache\(fn\)"):
        generate(model, TOKENS[0], 4, attention_fn=softmax_attention)
    with pytest.raises(TypeError, match=r"DenseCache\(fn\)"):
        generation.prefill(model, TOKENS, [12, 12], softmax_attention, 16)


def test_bf16_model_runs_close_to_f32(model, full_logits, CFG):
    logits, _ = full_logits
    m16 = nnx.eval_shape(lambda: LlamaForCausalLM(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    nnx.update(m16, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(model)))
    out, cache, _ = prompt_logits(m16, TOKENS)
    assert out.dtype == np.float32 and cache.k.dtype == jnp.bfloat16
    assert np.abs(out - logits[:, -1]).max() < 0.05 * np.abs(logits).max()
