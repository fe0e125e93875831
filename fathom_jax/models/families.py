"""The model families, as data: one frozen :class:`Family` record each, looked up by what a checkpoint says it is
(a HF ``config.json``'s ``model_type``, a GGUF's ``general.architecture``) or by a config's ``family``.

The loader (``hub.py``), the tokenizer (``tokenizer.py``) and the sizing (``sizing.py``) read this registry; none of
them names a family. A new family is a package beside ``llama/`` and ``gemma3/`` (its model, config and a loading
module with ``hf_config``, ``load_hf_checkpoint``, ``config_from_gguf`` and ``load_gguf``) and a record here.

Light on purpose: importing it imports no JAX and no model code (the CLI sizes a run before it loads anything); a
record names its modules, imported on first use.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from typing import Any, Callable


def _whole_context(config) -> tuple[int, int, int]:
    return config.n_layers, 0, 0


def _global_and_windows(config) -> tuple[int, int, int]:
    return len(config.global_layers), len(config.local_layers), config.sliding_window


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder family: where its code lives, what checkpoints it reads, and the hooks sizing needs."""

    name: str
    config_families: tuple[str, ...]  # the ``family`` values of its configs
    hf_model_types: tuple[str, ...]  # config.json ``model_type`` values it loads
    gguf_architectures: tuple[str, ...]  # GGUF ``general.architecture`` values it loads
    model: str  # "module:name" of the model class (a Decoder)
    config: str  # "module:name" of the config class
    loader: str  # the module that loads it: hf_config, load_hf_checkpoint, config_from_gguf, load_gguf
    # Tokenizer: the GGUF architectures whose SentencePiece tokenizer ("llama" in tokenizer.ggml.model) this
    # family's builder reads, and that builder's name in ``tokenizer.py`` (byte-level BPE, "gpt2", needs none).
    sentencepiece_architectures: tuple[str, ...] = ()
    sentencepiece: str | None = None
    # Sizing: (layers that cache the whole context, layers that cache a window, the window) of a config, and
    # whether prefill attends by chunks of queries (``prompt_attention.PREFILL_QUERY_CHUNK``).
    cache_layers: Callable[[Any], tuple[int, int, int]] = _whole_context
    chunked_prefill: bool = False

    def loading(self):
        """The family's loading module (imports JAX and the model)."""
        return importlib.import_module(self.loader)

    def model_class(self):
        return _resolve(self.model)

    def config_class(self):
        return _resolve(self.config)


def _resolve(ref: str):
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


LLAMA = Family(
    name="llama", config_families=("llama", "qwen2", "qwen3"), hf_model_types=("llama", "qwen2", "qwen3"),
    gguf_architectures=("llama",), model="fathom_jax.models.llama.model:LlamaForCausalLM",
    config="fathom_jax.models.config:LlamaConfig", loader="fathom_jax.models.llama.loading",
)
GEMMA3 = Family(
    name="gemma3", config_families=("gemma3",), hf_model_types=("gemma3_text",), gguf_architectures=("gemma3",),
    model="fathom_jax.models.gemma3.model:Gemma3ForCausalLM", config="fathom_jax.models.gemma3.config:Gemma3Config",
    loader="fathom_jax.models.gemma3.loading", sentencepiece_architectures=("gemma", "gemma2", "gemma3"),
    sentencepiece="gemma", cache_layers=_global_and_windows, chunked_prefill=True,
)
FAMILIES: tuple[Family, ...] = (LLAMA, GEMMA3)
# What reads a checkpoint no family claims: the Llama loader names what it cannot load ("unsupported architecture").
FALLBACK = LLAMA


def for_config(config) -> Family:
    """The family of a config (its ``family`` field)."""
    family = getattr(config, "family", None)
    for f in FAMILIES:
        if family in f.config_families:
            return f
    raise ValueError(f"no model family has configs of family {family!r}; known: "
                     f"{sorted(n for f in FAMILIES for n in f.config_families)}")


def for_hf_model_type(model_type: str | None) -> Family:
    """The family that loads a HF checkpoint of ``model_type`` (:data:`FALLBACK` for any other)."""
    return next((f for f in FAMILIES if model_type in f.hf_model_types), FALLBACK)


def for_gguf_architecture(architecture: str | None) -> Family:
    """The family that loads a GGUF of ``general.architecture`` (:data:`FALLBACK` for any other)."""
    return next((f for f in FAMILIES if architecture in f.gguf_architectures), FALLBACK)


def for_sentencepiece(architecture: str | None) -> Family | None:
    """The family whose SentencePiece tokenizer a GGUF of ``architecture`` holds, or None."""
    return next((f for f in FAMILIES if architecture in f.sentencepiece_architectures), None)


def hf_model_type(path: str | os.PathLike) -> str | None:
    """The ``model_type`` of a HF checkpoint directory's config.json (None where it cannot be read: the fallback
    loader reports what is wrong with it)."""
    try:
        with open(os.path.join(os.fspath(path), "config.json")) as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def for_checkpoint(path: str | os.PathLike) -> Family:
    """The family that loads ``path``: a HF checkpoint directory, or a GGUF file (whose metadata is read)."""
    if os.path.isdir(path):
        return for_hf_model_type(hf_model_type(path))
    from fathom_jax.models.config import gguf_field
    from fathom_jax.models.loading import open_gguf

    return for_gguf_architecture(gguf_field(open_gguf(path), "general.architecture"))
