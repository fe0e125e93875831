"""The real model's fixtures (SmolLM2 and the transformers oracle) for the downstream sweeps' tests, and a tiny random
model with SmolLM2's tokenizer served by the hub (the sweeps' commands end to end)."""

import pytest

from tests.models.conftest import smollm2, smollm2_path, smollm2_ref  # noqa: F401  (fixtures)


def serve(monkeypatch, model, tokenizer, config):
    """The hub hands out ``model`` (whatever ``--model`` names) and its config, without reading a file."""
    from fathom_jax.models import hub

    monkeypatch.setattr(hub, "model_config", lambda source=None: config)
    monkeypatch.setattr(hub, "load_model", lambda source=None, **kw: (model, tokenizer, config))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from fathom_jax.models.hub import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def _tiny_smollm2_model():
    from flax import nnx

    from fathom_jax.models.config import LlamaConfig
    from fathom_jax.models.llama import LlamaForCausalLM

    config = LlamaConfig(vocab=49152, hidden=64, intermediate=96, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=64,
                         rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192)
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0)), config


@pytest.fixture
def tiny_smollm2(monkeypatch, _tiny_smollm2_model, smollm2_tokenizer):
    """The hub's model is a 2-layer random model with SmolLM2's vocabulary, D = 64 and real tokenizer (built once per
    session: the commands only read it)."""
    model, config = _tiny_smollm2_model
    serve(monkeypatch, model, smollm2_tokenizer, config)
    return model
