"""Decoder configuration for the Llama family (Llama 2/3.x, SmolLM2, Qwen2, Qwen3).

One frozen, hashable dataclass covers all of them: Qwen2 and Qwen3 are Llama with flags
(q/k/v bias, per-head q/k RMSNorm). Being hashable lets the config ride as a static jit argument.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

# HF `architectures[0]` -> our family name. Anything else is refused rather than silently run
# through a Llama graph (Mistral's sliding window or GPT-2's learned positions would give wrong
# logits with no error).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is HF's name: "linear" or "llama3" (Llama-3.1+)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The sizes every decoder family has, under one set of names, so that code that sizes a run from a config
    reads any family's."""

    vocab: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group G)."""
        return self.n_heads // self.n_kv_heads


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: always; Llama/Qwen3: flag)
    o_proj_bias: bool = False  # bias on the output projection (Llama/Qwen3 tie it to attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    max_position_embeddings: int = 8192
    family: str = "llama"

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike) -> "LlamaConfig":
        """Build from a HF `config.json` dict, the file, or the checkpoint directory holding it."""
        if not isinstance(config, Mapping):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            with open(path) as f:
                config = json.load(f)
        return _from_hf_dict(dict(config))


def gguf_field(reader, key: str, default=None):
    """The value of GGUF metadata ``key`` (llama.cpp's names), or ``default`` if the file lacks it."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _family(d: dict) -> str:
    archs = d.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    if archs:
        raise ValueError(
            f"unsupported architecture {archs[0]!r} (model_type={d.get('model_type')!r}); "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    mt = d.get("model_type")
    if mt in _MODEL_TYPES:
        return _MODEL_TYPES[mt]
    raise ValueError(f"unsupported model_type {mt!r}; supported: {sorted(_MODEL_TYPES)}")


def _rope(d: dict) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters` (theta included); 4.x writes rope_theta +
    # rope_scaling (with "type" in older files, "rope_type" in newer).
    params = d.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = d.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {_SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    kw = {"rope_type": rope_type, "factor": float(scaling["factor"])}
    if rope_type == "llama3":
        kw.update(
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    return theta, RopeScaling(**kw)


def _from_hf_dict(d: dict) -> LlamaConfig:
    family = _family(d)
    if d.get("use_sliding_window"):
        raise ValueError(f"{family}: sliding-window attention (use_sliding_window=True) is not supported")
    if d.get("mlp_bias"):
        raise ValueError(f"{family}: mlp_bias=True is not supported")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{family}: hidden_act={act!r} is not supported (SwiGLU with silu only)")
    n_heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    theta, scaling = _rope(d)
    bias = bool(d.get("attention_bias", False))
    return LlamaConfig(
        vocab=int(d["vocab_size"]),
        hidden=hidden,
        intermediate=int(d["intermediate_size"]),
        n_layers=int(d["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
        head_dim=int(d.get("head_dim") or hidden // n_heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        # Qwen2 hard-codes bias on q/k/v and none on o_proj; Llama and Qwen3 use one flag for all four.
        attention_bias=True if family == "qwen2" else bias,
        o_proj_bias=False if family == "qwen2" else bias,
        qk_norm=family == "qwen3",
        max_position_embeddings=int(d.get("max_position_embeddings", 8192)),
        family=family,
    )
