"""Gemma 3 weights: llama.cpp GGUF files and HF safetensors checkpoints -> :class:`Gemma3ForCausalLM`.

As for the Llama family (``llama/loading.py``), over the shared ``models/loading.py``: the model is created
abstractly, then every parameter is filled from a name map ``module path -> TensorSpec``; per-layer names hold
``{i}``, the model layer index, and each stacked module reads its own layers (``local_layers``: the local layers
before the last global one, in order; ``global_layers``; ``tail_layers``). llama.cpp stores every Gemma norm as
``1 + w`` and keeps HF's row order (no Q/K permutation: Gemma uses NeoX-style RoPE there); the norms are shifted
back in f32, as transformers does.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from fathom_jax.models import loading
from fathom_jax.models.gemma3.config import Gemma3Config, config_from_gguf, from_hf_dict
from fathom_jax.models.gemma3.model import Gemma3ForCausalLM
from fathom_jax.models.loading import (Path, SafetensorsDir, TensorSpec, gguf_path, gguf_tensors, identity, open_gguf,
                                      transpose)

# module path inside a layer -> (HF name inside model.layers.{i}, llama.cpp name inside blk.{i})
_LAYER = {
    ("input_layernorm", "weight"): ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn", "q_proj", "kernel"): ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn", "k_proj", "kernel"): ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn", "v_proj", "kernel"): ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn", "o_proj", "kernel"): ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn", "q_norm", "weight"): ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn", "k_norm", "weight"): ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("post_attention_layernorm", "weight"): ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    ("pre_feedforward_layernorm", "weight"): ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    ("mlp", "gate_proj", "kernel"): ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp", "up_proj", "kernel"): ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp", "down_proj", "kernel"): ("mlp.down_proj.weight", "ffn_down.weight"),
    ("post_feedforward_layernorm", "weight"): ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
}
_TOP = {
    ("embed_tokens", "embedding"): ("model.embed_tokens.weight", "token_embd.weight"),
    ("norm", "weight"): ("model.norm.weight", "output_norm.weight"),
}
_STACKS = ("local_layers", "global_layers", "tail_layers")


def _unshift_norm(a: np.ndarray) -> np.ndarray:
    return (np.asarray(a, np.float32) - np.float32(1.0)).astype(np.float32)


def name_map(config: Gemma3Config, source: str) -> dict[Path, TensorSpec]:
    """Module path -> tensor name and transform, for ``source`` "hf" or "gguf"."""
    col = {"hf": 0, "gguf": 1}[source]
    out: dict[Path, TensorSpec] = {}
    for path, names in _TOP.items():
        shift = source == "gguf" and path[0] == "norm"
        out[path] = TensorSpec(names[col], _unshift_norm if shift else identity)
    for stack in _STACKS:
        for sub, names in _LAYER.items():
            prefix = "model.layers.{i}." if source == "hf" else "blk.{i}."
            if sub[-1] == "kernel":
                transform = transpose  # [out, in] -> nnx.Linear's [in, out]
            else:
                transform = _unshift_norm if source == "gguf" else identity
            out[(stack, *sub)] = TensorSpec(prefix + names[col], transform)
    return out


def stack_layers(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Model layer indices each stacked module holds, in its order."""
    n = config.n_blocks * (config.sliding_window_pattern - 1)
    return {"local_layers": config.local_layers[:n], "global_layers": config.global_layers,
            "tail_layers": config.local_layers[n:]}


def build_model(config: Gemma3Config, get, names: dict[Path, TensorSpec], *, dtype="float32",
                source: str = "checkpoint") -> Gemma3ForCausalLM:
    """A model with every parameter filled from ``get(name)`` (None if absent): :func:`loading.build_model`."""
    return loading.build_model(functools.partial(Gemma3ForCausalLM, config), get, names, stack_layers(config),
                               dtype=dtype, source=source)


def load_gguf(path, *, dtype="float32") -> tuple[Gemma3ForCausalLM, Gemma3Config]:
    """A llama.cpp Gemma 3 GGUF (a path or an open ``gguf.GGUFReader``), dequantized to ``dtype``."""
    import gguf

    reader = path if isinstance(path, gguf.GGUFReader) else open_gguf(path)
    config = config_from_gguf(reader)
    model = build_model(config, gguf_tensors(reader), name_map(config, "gguf"), dtype=dtype,
                        source=gguf_path(reader))
    return model, config


def hf_config(path: str | os.PathLike) -> Gemma3Config:
    with open(os.path.join(os.fspath(path), "config.json")) as f:
        return from_hf_dict(json.load(f))


def load_hf_checkpoint(path: str | os.PathLike, *, dtype="float32") -> tuple[Gemma3ForCausalLM, Gemma3Config]:
    """A HF ``Gemma3ForCausalLM`` checkpoint directory (config.json + safetensors)."""
    config = hf_config(path)
    model = build_model(config, SafetensorsDir(path), name_map(config, "hf"), dtype=dtype, source=os.fspath(path))
    return model, config
