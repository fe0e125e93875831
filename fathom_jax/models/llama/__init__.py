"""The Llama family (Llama 2/3.x, SmolLM2, Qwen2, Qwen3): ``model.py`` (:class:`LlamaForCausalLM`) and
``loading.py`` (HF safetensors and GGUF weights). Its config, :class:`~fathom_jax.models.LlamaConfig`, and its
layers, which Gemma 3 builds on, are the package's shared ``config.py`` and ``layers.py``; its record in the
registry is :data:`fathom_jax.models.families.LLAMA`. Names below are imported on first use."""

from fathom_jax.models import lazy_exports

_EXPORTS = {"LlamaForCausalLM": "model"}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


__all__ = sorted(_EXPORTS)
