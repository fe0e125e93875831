"""Flax NNX decoder for the Llama family, weight loading (HF safetensors, GGUF), tokenizers.

Heavy imports stay lazy: importing this package never touches the network or the disk cache.
"""

from fathom_jax.models.config import LlamaConfig, RopeScaling
from fathom_jax.models.llama import (
    AttentionFn,
    KVCache,
    LlamaForCausalLM,
    capture_qkv,
    dense_attention,
    generate,
)

__all__ = [
    "AttentionFn",
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "RopeScaling",
    "capture_qkv",
    "dense_attention",
    "generate",
]
