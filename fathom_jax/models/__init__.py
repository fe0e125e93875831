"""Flax NNX decoder for the Llama family, weight loading (HF safetensors, GGUF), tokenizers.

Heavy imports stay lazy: importing this package never touches the network or the disk cache.
"""

from fathom_jax.models.config import LlamaConfig, RopeScaling
from fathom_jax.models.hub import fetch_model, load_smollm2
from fathom_jax.models.llama import (
    AttentionFn,
    KVCache,
    LlamaForCausalLM,
    capture_qkv,
    dense_attention,
    generate,
)
from fathom_jax.models.loading import MissingTensorError, load_gguf, load_hf_checkpoint
from fathom_jax.models.tokenizer import Tokenizer

__all__ = [
    "AttentionFn",
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "RopeScaling",
    "capture_qkv",
    "MissingTensorError",
    "Tokenizer",
    "dense_attention",
    "fetch_model",
    "generate",
    "load_gguf",
    "load_hf_checkpoint",
    "load_smollm2",
]
