"""The Llama family (Llama 2/3.x, SmolLM2, Qwen2, Qwen3): ``model.py`` (:class:`LlamaForCausalLM`) and
``loading.py`` (HF safetensors and GGUF weights). Its config, :class:`~fathom_jax.models.LlamaConfig`, and its
layers, which Gemma 3 builds on, are the package's shared ``config.py`` and ``layers.py``; its record in the
registry is :data:`fathom_jax.models.families.LLAMA`. Names below are imported on first use."""

import importlib

_EXPORTS = {"LlamaForCausalLM": "model"}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = sorted(_EXPORTS)
