import json

import pytest

from fathom_jax.models.config import LlamaConfig, RopeScaling

BASE = dict(
    vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
)


def test_llama_defaults():
    c = LlamaConfig.from_hf_config(dict(BASE, architectures=["LlamaForCausalLM"], rope_theta=1e5))
    assert (c.family, c.head_dim, c.group_size, c.rope_theta) == ("llama", 16, 2, 1e5)
    assert not (c.attention_bias or c.o_proj_bias or c.qk_norm or c.tie_word_embeddings)
    assert c.rope_scaling is None
    hash(c)  # static jit argument


def test_qwen_flags():
    q2 = LlamaConfig.from_hf_config(dict(BASE, architectures=["Qwen2ForCausalLM"]))
    assert (q2.attention_bias, q2.o_proj_bias, q2.qk_norm) == (True, False, False)
    q3 = LlamaConfig.from_hf_config(dict(BASE, architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert (q3.attention_bias, q3.o_proj_bias, q3.qk_norm, q3.head_dim) == (False, False, True, 32)


@pytest.mark.parametrize(
    "rope",
    [
        # transformers 4.x layout
        dict(rope_theta=5e5, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=8192)),
        dict(rope_theta=5e5, rope_scaling=dict(type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=8192)),
        # transformers 5.x layout
        dict(rope_parameters=dict(rope_theta=5e5, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192)),
    ],
)
def test_llama3_rope_scaling_both_layouts(rope):
    c = LlamaConfig.from_hf_config(dict(BASE, model_type="llama", **rope))
    assert c.rope_theta == 5e5
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize(
    "arch, extra",
    [
        ("MistralForCausalLM", dict(sliding_window=4096)),
        ("GPT2LMHeadModel", {}),
    ],
)
def test_unsupported_architecture_is_named(arch, extra):
    with pytest.raises(ValueError, match=arch):
        LlamaConfig.from_hf_config(dict(BASE, architectures=[arch], **extra))


def test_unsupported_features_raise():
    with pytest.raises(ValueError, match="sliding"):
        LlamaConfig.from_hf_config(dict(BASE, architectures=["Qwen2ForCausalLM"], use_sliding_window=True))
    with pytest.raises(ValueError, match="yarn"):
        LlamaConfig.from_hf_config(dict(BASE, model_type="llama", rope_scaling=dict(rope_type="yarn", factor=4.0)))
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaConfig.from_hf_config(dict(BASE, model_type="llama", num_key_value_heads=3))


def test_from_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, architectures=["LlamaForCausalLM"])))
    assert LlamaConfig.from_hf_config(tmp_path) == LlamaConfig.from_hf_config(tmp_path / "config.json")
