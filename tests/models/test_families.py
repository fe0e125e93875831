"""The model-family registry: what the loader, the tokenizer and the sizing read instead of branching on names."""

import json
import subprocess
import sys

import pytest

from fathom_jax.models import families


def test_checkpoints_find_their_family(tmp_path):
    for model_type, family in (("gemma3_text", families.GEMMA3), ("qwen3", families.LLAMA), ("llama", families.LLAMA)):
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert families.for_checkpoint(tmp_path / model_type) is family
    # what no family claims goes to the fallback, whose loader names what it cannot load
    assert families.for_hf_model_type("gpt2") is families.FALLBACK
    assert families.for_checkpoint(tmp_path) is families.FALLBACK  # no config.json
    assert families.for_gguf_architecture("gemma3") is families.GEMMA3
    assert families.for_gguf_architecture("llama") is families.LLAMA
    assert families.for_sentencepiece("gemma2") is families.GEMMA3 and families.for_sentencepiece("llama") is None


def test_configs_find_their_family(tiny_config):
    from fathom_jax.models import Gemma3Config

    gemma = Gemma3Config(vocab=64, hidden=32, intermediate=48, n_layers=6, n_heads=2, n_kv_heads=1, head_dim=8,
                         sliding_window=4, sliding_window_pattern=3)
    assert families.for_config(tiny_config) is families.LLAMA and families.for_config(gemma) is families.GEMMA3
    assert families.GEMMA3.cache_layers(gemma) == (2, 4, 4)
    with pytest.raises(ValueError, match="no model family has configs of family 'gpt2'"):
        families.for_config(type("C", (), {"family": "gpt2"})())


def test_each_family_names_code_that_exists():
    for family in families.FAMILIES:
        loading = family.loading()
        assert all(callable(getattr(loading, f)) for f in ("hf_config", "load_hf_checkpoint", "config_from_gguf",
                                                           "load_gguf"))
        assert family.config_class().family in family.config_families
        assert family.model_class().__name__.endswith("ForCausalLM")


def test_the_registry_imports_no_jax():
    code = "import sys, fathom_jax.models.families, fathom_jax.models.sizing; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
