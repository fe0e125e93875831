"""Gemma 3 configs from HF config.json dicts (transformers 4.x and 5.x layouts) and their checks."""

import dataclasses

import pytest

from fathom_jax.models.config import RopeScaling
from fathom_jax.models.gemma3.config import Gemma3Config, from_hf_dict

# google/gemma-3-270m's config.json (transformers 4.x layout), abridged.
HF_270M = dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=262144, hidden_size=640,
               intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
               head_dim=256, sliding_window=512, rope_theta=1000000.0, rope_local_base_freq=10000.0,
               rope_scaling=None, query_pre_attn_scalar=256, rms_norm_eps=1e-6, final_logit_softcapping=None,
               attn_logit_softcapping=None, max_position_embeddings=32768, hidden_activation="gelu_pytorch_tanh",
               _sliding_window_pattern=6)


def test_270m_from_hf_4x_layout():
    cfg = from_hf_dict(HF_270M)
    assert cfg == Gemma3Config(vocab=262144, hidden=640, intermediate=2048, n_layers=18, n_heads=4, n_kv_heads=1,
                               head_dim=256, sliding_window=512, max_position_embeddings=32768)
    assert cfg.global_layers == (5, 11, 17) and len(cfg.local_layers) == 15 and cfg.n_tail == 0


def test_5x_layout_reads_rope_per_layer_type_and_the_pattern_from_layer_types():
    types = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2
    d = dict(HF_270M, num_hidden_layers=6, layer_types=types, _sliding_window_pattern=6, rope_parameters={
        "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=5e5),
        "sliding_attention": dict(rope_type="default", rope_theta=2e4)})
    del d["rope_theta"], d["rope_local_base_freq"]
    cfg = from_hf_dict(d)
    assert (cfg.sliding_window_pattern, cfg.global_layers, cfg.n_tail) == (4, (3,), 2)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (5e5, 2e4, RopeScaling("linear", 8.0))


@pytest.mark.parametrize("change, match", [
    (dict(model_type="gemma2"), "gemma3_text"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation"),
    (dict(layer_types=["sliding_attention", "full_attention", "full_attention"] * 6), "one global layer in every 2"),
    (dict(tie_word_embeddings=False), "untied"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "yarn"),
])
def test_unsupported_configs_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        from_hf_dict(dict(HF_270M, **change))


def test_config_checks():
    base = from_hf_dict(HF_270M)
    with pytest.raises(ValueError, match="no global layer"):
        dataclasses.replace(base, n_layers=5)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        dataclasses.replace(base, n_kv_heads=3)
