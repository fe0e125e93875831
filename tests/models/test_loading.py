"""Weight loading, proved by logit parity with HF transformers (run in the oracle venv)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from fathom_jax.models import LlamaForCausalLM, generate
from fathom_jax.models.config import LlamaConfig
from fathom_jax.models.llama.loading import (
    config_from_gguf,
    gguf_name_map,
    load_gguf,
    load_hf_checkpoint,
    permute_rope_rows,
    unpermute_rope_rows,
)
from fathom_jax.models.loading import MissingTensorError

from tests.support import forced_logits, write_hf_checkpoint

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
    logits, _ = forced_logits(model, np.asarray(tokens)[None], 64)
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
    logits, _ = forced_logits(model, ref["tokens"][None], 64)
    assert max_rel_err(logits[0], ref["logits"]) < 5e-2


def test_hf_layout_roundtrip_without_oracle(tmp_path):
    model, cfg = write_hf_checkpoint(tmp_path)
    loaded, cfg2 = load_hf_checkpoint(tmp_path)
    assert cfg2 == cfg
    tokens = jnp.arange(10)[None]
    a, _ = forced_logits(model, tokens)
    b, _ = forced_logits(loaded, tokens)
    np.testing.assert_array_equal(a, b)


def test_missing_tensor_is_named(tmp_path):
    write_hf_checkpoint(tmp_path)
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(tmp_path)


def test_wrong_shape_and_no_weights_file(tmp_path):
    write_hf_checkpoint(tmp_path)
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    tensors["model.norm.weight"] = np.ones(17, np.float32)
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(17,\)"):
        load_hf_checkpoint(tmp_path)
    os.remove(os.path.join(tmp_path, "model.safetensors"))
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
    logits, _ = forced_logits(model, np.asarray(tokens)[None], 64)
    err = max_rel_err(logits[0], ref["logits"])
    assert err < 1e-4, f"SmolLM2: max relative logit error {err:.2e}"
    gen = np.asarray(generate(model, np.asarray(tokens), len(ref["greedy"]), capacity=64))
    np.testing.assert_array_equal(gen, ref["greedy"])
    assert "Paris" in tok.decode(gen)


def _write_gguf(path, arch="llama", drop=()):
    """A tiny random Llama in llama.cpp layout (F32, Q/K rows permuted as llama.cpp's converter does)."""
    import gguf

    cfg = LlamaConfig(vocab=50, hidden=16, intermediate=24, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4,
                      rms_norm_eps=float(np.float32(1e-5)), tie_word_embeddings=True, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(3))
    w = gguf.GGUFWriter(str(path), arch)
    for key, val in [("block_count", 2), ("context_length", 64), ("embedding_length", 16),
                     ("feed_forward_length", 24), ("attention.head_count", 4), ("attention.head_count_kv", 2),
                     ("vocab_size", 50)]:
        w.add_uint32(f"{arch}.{key}", val)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    permute = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}
    for p, var in nnx.to_flat_state(nnx.state(model)):
        spec = gguf_name_map(cfg)[tuple(p)]
        a = np.asarray(var.get_value())
        for i, layer_a in enumerate(a if p[0] == "layers" else [a]):
            name = spec.name.format(i=i)
            if p[-1] == "kernel":
                layer_a = layer_a.T  # back to [out, in]
            heads = permute.get(name.split(".")[-2])
            if heads:
                layer_a = permute_rope_rows(layer_a, heads)
            if name not in drop:
                w.add_tensor(name, np.ascontiguousarray(layer_a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, cfg


def test_gguf_roundtrip_undoes_qk_permutation(tmp_path):
    model, cfg = _write_gguf(tmp_path / "m.gguf")
    loaded, cfg2 = load_gguf(tmp_path / "m.gguf")
    assert cfg2 == cfg
    tokens = jnp.arange(12)[None]
    a, _ = forced_logits(model, tokens)
    b, _ = forced_logits(loaded, tokens)
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_gguf_bad_inputs(tmp_path):
    _write_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf(tmp_path / "gpt2.gguf")
    _write_gguf(tmp_path / "short.gguf", drop=("blk.1.ffn_down.weight",))
    with pytest.raises(MissingTensorError, match=r"blk\.1\.ffn_down\.weight"):
        load_gguf(tmp_path / "short.gguf")
