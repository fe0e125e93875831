"""Gemma 3 loading: a GGUF round trip of a tiny random model, and the real Gemma 3 270M against transformers
(run in the oracle venv) -- its config, its tokenizer and the decoder's logits and greedy tokens on three
prompts, one longer than the 512-token window."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fathom_jax.models import DenseCache, generation
from fathom_jax.models import MissingTensorError, hub
from fathom_jax.models.gemma3 import Gemma3ForCausalLM
from fathom_jax.models.gemma3.config import Gemma3Config
from fathom_jax.models.gemma3.loading import load_gguf, name_map, stack_layers
from fathom_jax.models.generation import generate

from tests.support import forced_logits

gguf = pytest.importorskip("gguf")  # the GPU machine has no gguf: its -m gpu run skips this module, not aborts

TINY = Gemma3Config(vocab=50, hidden=16, intermediate=24, n_layers=6, n_heads=2, n_kv_heads=1, head_dim=8,
                    sliding_window=3, query_pre_attn_scalar=8.0, rms_norm_eps=float(np.float32(1e-6)),
                    max_position_embeddings=64)


def max_rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _write_gguf(path, drop=()):
    """A tiny random Gemma 3 in llama.cpp's layout: F32, norms stored as 1 + w, HF's row order."""
    model = Gemma3ForCausalLM(TINY, rngs=nnx.Rngs(3))
    w = gguf.GGUFWriter(str(path), "gemma3")
    for key, val in [("block_count", 6), ("context_length", 64), ("embedding_length", 16), ("feed_forward_length", 24),
                     ("attention.head_count", 2), ("attention.head_count_kv", 1), ("attention.key_length", 8),
                     ("attention.value_length", 8), ("attention.sliding_window", 3), ("vocab_size", 50)]:
        w.add_uint32(f"gemma3.{key}", val)
    w.add_float32("gemma3.rope.freq_base", 1e6)
    w.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    rng = np.random.default_rng(0)  # random norms (they start at 0), so that a dropped 1 + w shift shows
    nnx.update(model, jax.tree.map_with_path(
        lambda p, a: jnp.asarray(rng.normal(0, 0.3, a.shape), a.dtype) if "norm" in str(p) else a, nnx.state(model)))
    rows = stack_layers(TINY)
    for p, var in nnx.to_flat_state(nnx.state(model)):
        spec = name_map(TINY, "gguf")[tuple(p)]
        a = np.asarray(var.get_value())
        for i, layer_a in zip(rows.get(p[0], [None]), a if p[0] in rows else [a]):
            name = spec.name.format(i=i)
            stored = layer_a.T if p[-1] == "kernel" else layer_a + 1 if p[-1] == "weight" else layer_a
            if name not in drop:
                w.add_tensor(name, np.ascontiguousarray(stored, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def test_gguf_round_trip(tmp_path):
    model = _write_gguf(tmp_path / "m.gguf")
    loaded, cfg = load_gguf(tmp_path / "m.gguf")
    assert cfg == TINY
    tokens = jnp.arange(12)[None]  # four windows
    a, _ = forced_logits(model, tokens)
    b, _ = forced_logits(loaded, tokens)
    np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(np.asarray(a)).max())


def test_gguf_missing_tensor_is_named(tmp_path):
    _write_gguf(tmp_path / "short.gguf", drop=("blk.5.post_ffw_norm.weight",))
    with pytest.raises(MissingTensorError, match=r"blk\.5\.post_ffw_norm\.weight"):
        load_gguf(tmp_path / "short.gguf")


# ---------------------------------------------------------------------------------------------
# The real model


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    """(model, tokenizer, config), f32, loaded once for this module."""
    return hub.load_model("gemma3-270m")


def test_config_matches_metadata_and_transformers(gemma3, gemma3_ref):
    _, _, cfg = gemma3
    assert hub.model_config("gemma3-270m") == cfg
    assert (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta, cfg.max_position_embeddings) == (
        512, 1e6, 1e4, 32768)
    assert cfg.global_layers == (5, 11, 17) and cfg.query_scale == 1.0
    hf = json.loads(str(gemma3_ref["config"]))  # the Gemma3TextConfig transformers built from the same file
    rope = hf["rope_parameters"]
    assert (cfg.vocab, cfg.hidden, cfg.intermediate, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"],
        hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"])
    assert list(cfg.layer_types) == hf["layer_types"] and cfg.sliding_window == hf["sliding_window"]
    assert (cfg.rope_theta, cfg.rope_local_theta) == (rope["full_attention"]["rope_theta"],
                                                      rope["sliding_attention"]["rope_theta"])
    assert rope["full_attention"]["rope_type"] == rope["sliding_attention"]["rope_type"] == "default"
    assert cfg.rope_scaling is None
    assert (cfg.query_pre_attn_scalar, cfg.rms_norm_eps, cfg.final_logit_softcapping) == (
        hf["query_pre_attn_scalar"], hf["rms_norm_eps"], hf["final_logit_softcapping"])
    assert hf["attn_logit_softcapping"] is None and hf["hidden_activation"] == "gelu_pytorch_tanh"
    assert (cfg.max_position_embeddings, cfg.tie_word_embeddings) == (hf["max_position_embeddings"],
                                                                      hf["tie_word_embeddings"])


def test_tokenizer_matches_transformers(gemma3, gemma3_ref):
    _, tok, _ = gemma3
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (2, 1, True, 262144)
    for i, text in enumerate(gemma3_ref["texts"]):
        assert tok.encode(text) == gemma3_ref[f"tokenize_{i}"].tolist(), text
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<start_of_turn>") == [105] and len(tok.encode("\n\n\n")) == 1


def test_gemma3_gguf_parity_with_transformers(gemma3, gemma3_ref):
    model, tok, cfg = gemma3
    ref = gemma3_ref
    tokens = [tok.bos_id, *tok.encode(str(ref["prompt"]))]
    assert tokens == ref["tokens"].tolist(), "GGUF tokenizer disagrees with transformers' GGUF tokenizer"
    logits, _ = forced_logits(model, np.asarray(tokens)[None])
    err = max_rel_err(logits[0], ref["logits"])
    assert err < 1e-4, f"Gemma 3: max relative logit error {err:.2e}"
    gen = np.asarray(generate(model, np.asarray(tokens), len(ref["greedy"])))
    np.testing.assert_array_equal(gen, ref["greedy"])
    for i, text in enumerate(ref["extra_prompts"]):
        tokens = [tok.bos_id, *tok.encode(text)]
        assert tokens == ref[f"extra_tokens_{i}"].tolist()
        last, _, _ = generation.prefill(model, np.asarray(tokens)[None], [len(tokens)], DenseCache(), len(tokens))
        err = max_rel_err(last[0], ref[f"extra_last_logits_{i}"])
        assert err < 1e-4, f"Gemma 3, prompt {i} ({len(tokens)} tokens): max relative logit error {err:.2e}"
        gen = np.asarray(generate(model, np.asarray(tokens), len(ref["greedy"])))
        np.testing.assert_array_equal(gen, ref[f"extra_greedy_{i}"])
        if i == 0:  # the needle lies more than a window before the question: only the global layers reach it
            needle = len(tok.encode(text[:text.index("4839201")])) + 1
            assert len(tokens) - needle > cfg.sliding_window and "4839201" in tok.decode(gen)
