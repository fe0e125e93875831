"""Weight loading, proved by logit parity with HF transformers (run in the oracle venv)."""

import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from fathom_jax.models.llama import KVCache, generate
from fathom_jax.models.loading import (
    MissingTensorError,
    config_from_gguf,
    load_hf_checkpoint,
    permute_rope_rows,
    unpermute_rope_rows,
)

TINY_CASES = ("llama", "llama3", "qwen2", "qwen3")  # the cases tests/oracle/hf_reference.py writes


def max_rel_err(a, b) -> float:
    """max |a - b| / max |b|: relative to the logit scale (elementwise ratios blow up near 0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("case", TINY_CASES)
def test_hf_tiny_logit_and_greedy_parity(tiny_checkpoints, case):
    path = os.path.join(tiny_checkpoints, case)
    ref = np.load(os.path.join(path, "ref.npz"))
    model, cfg = load_hf_checkpoint(path, dtype="float32")
    tokens = ref["tokens"]
    logits, _ = model.prefill(jnp.asarray(tokens)[None], KVCache.init(cfg, 1, 64))
    err = max_rel_err(logits[0], ref["logits"])
    assert err < 1e-4, f"{case}: max relative logit error {err:.2e}"
    prompt_len, n = 8, len(ref["greedy"])
    gen = np.asarray(generate(model, tokens[:prompt_len], n, capacity=64))
    np.testing.assert_array_equal(gen, ref["greedy"])


def test_hf_bf16_load_is_close(tiny_checkpoints):
    path = os.path.join(tiny_checkpoints, "qwen2")
    ref = np.load(os.path.join(path, "ref.npz"))
    model, cfg = load_hf_checkpoint(path, dtype="bfloat16")
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    logits, _ = model.prefill(jnp.asarray(ref["tokens"])[None], KVCache.init(cfg, 1, 64, jnp.bfloat16))
    assert max_rel_err(logits[0], ref["logits"]) < 5e-2


def test_missing_tensor_is_named(tiny_checkpoints, tmp_path):
    src = os.path.join(tiny_checkpoints, "llama")
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(tmp_path)


def test_no_weights_file(tmp_path, tiny_checkpoints):
    shutil.copy(os.path.join(tiny_checkpoints, "llama", "config.json"), tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(tmp_path)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)  # 3 heads of head_dim 8
    back = unpermute_rope_rows(permute_rope_rows(w, 3), 3)
    np.testing.assert_array_equal(back, w)
    # llama.cpp pairs rows (i, i + D/2) of each head as adjacent rows (2i, 2i + 1).
    p = permute_rope_rows(w, 3)
    np.testing.assert_array_equal(p[8 + 2 * 1], w[8 + 1])
    np.testing.assert_array_equal(p[8 + 2 * 1 + 1], w[8 + 1 + 4])


def test_gguf_config_from_metadata(smollm2_path):
    cfg = config_from_gguf(smollm2_path)
    assert (cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.vocab, cfg.intermediate, cfg.rope_theta, cfg.tie_word_embeddings) == (49152, 1536, 1e5, True)


def test_smollm2_gguf_parity_with_transformers(smollm2, smollm2_ref):
    model, tok, cfg = smollm2
    ref = smollm2_ref
    tokens = tok.encode(str(ref["prompt"]))
    assert tokens == ref["tokens"].tolist(), "GGUF tokenizer disagrees with transformers' GGUF tokenizer"
    logits, _ = model.prefill(jnp.asarray(tokens)[None], KVCache.init(cfg, 1, 64))
    err = max_rel_err(logits[0], ref["logits"])
    assert err < 1e-4, f"SmolLM2: max relative logit error {err:.2e}"
    gen = np.asarray(generate(model, np.asarray(tokens), len(ref["greedy"]), capacity=64))
    np.testing.assert_array_equal(gen, ref["greedy"])
    assert "Paris" in tok.decode(gen)
