"""Gemma 3 (text): interleaved sliding-window and global layers. ``config.py`` (:class:`Gemma3Config`), ``layers.py``
(its norms, attention and block over the Llama family's layers), ``windows.py`` (the sliding windows' ring buffers,
:class:`Gemma3State`), ``model.py`` (:class:`Gemma3ForCausalLM`), ``loading.py`` (GGUF and HF safetensors weights).
Its record in the registry is :data:`fathom_jax.models.families.GEMMA3`. Names below are imported on first use."""

from fathom_jax.models import lazy_exports

_EXPORTS = {"Gemma3Config": "config", "Gemma3ForCausalLM": "model", "Gemma3State": "windows", "Windows": "windows"}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


__all__ = sorted(_EXPORTS)
