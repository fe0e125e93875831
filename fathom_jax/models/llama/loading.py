"""The Llama family's weights: HF safetensors checkpoints and llama.cpp GGUF files -> :class:`LlamaForCausalLM`.

Its name maps (HF's names, llama.cpp's ``blk.N.*`` names with the Q/K rows permuted back to HF's rotate-half order)
and config readers, over the shared machinery of ``fathom_jax/models/loading.py`` (:func:`~fathom_jax.models.loading.
build_model`, the safetensors and GGUF sources). It is also the loader of a checkpoint no family claims: it names what
it cannot load.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
from flax import nnx

from fathom_jax.models.config import LlamaConfig, RopeScaling, gguf_field
from fathom_jax.models.llama.model import LlamaForCausalLM
from fathom_jax.models.loading import (Path, SafetensorsDir, TensorSpec, build_model, gguf_path, gguf_tensors, identity,
                                      open_gguf, transpose)


def build_llama(config: LlamaConfig, get_tensor, name_map: dict[Path, TensorSpec], *, dtype="float32",
                source: str = "checkpoint") -> LlamaForCausalLM:
    """A Llama-family model filled by :func:`build_model` (its one stack: ``layers``)."""
    return build_model(functools.partial(LlamaForCausalLM, config), get_tensor, name_map,
                       {"layers": range(config.n_layers)}, dtype=dtype, source=source)


def _module_paths(config: LlamaConfig) -> list[Path]:
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    return [tuple(str(p) for p in path) for path, _ in nnx.to_flat_state(nnx.state(abstract))]


# ---------------------------------------------------------------------------------------------
# Hugging Face safetensors


def hf_name_map(config: LlamaConfig) -> dict[Path, TensorSpec]:
    """Module path -> HF tensor name. Our module names follow HF's, so the map is mechanical:
    `kernel` is HF's transposed `weight`, `embedding` is `weight`."""
    top = {
        ("embed_tokens", "embedding"): TensorSpec("model.embed_tokens.weight"),
        ("norm", "weight"): TensorSpec("model.norm.weight"),
        ("lm_head", "kernel"): TensorSpec("lm_head.weight", transpose),
    }
    out: dict[Path, TensorSpec] = {}
    for path in _module_paths(config):
        if path[0] != "layers":
            out[path] = top[path]
            continue
        *mid, leaf = path[1:]
        hf_leaf = "weight" if leaf == "kernel" else leaf
        out[path] = TensorSpec(
            f"model.layers.{{i}}.{'.'.join(mid)}.{hf_leaf}", transpose if leaf == "kernel" else identity
        )
    return out


def hf_config(path: str | os.PathLike) -> LlamaConfig:
    """The config of a HF checkpoint directory, with errors that name the file."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} does not exist: a HF checkpoint directory holds config.json and "
                                "model.safetensors (or a sharded model.safetensors.index.json)")
    try:
        return LlamaConfig.from_hf_config(file)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON ({err})") from err
    except KeyError as err:
        raise ValueError(f"{file} lacks the field {err} a Llama-family config needs") from err


def load_hf_checkpoint(path: str | os.PathLike, *, dtype="float32") -> tuple[LlamaForCausalLM, LlamaConfig]:
    """Load a HF Llama/Qwen2/Qwen3 checkpoint directory (config.json + safetensors)."""
    config = hf_config(path)
    reader = SafetensorsDir(path)
    model = build_llama(config, reader, hf_name_map(config), dtype=dtype, source=os.fspath(path))
    return model, config


# ---------------------------------------------------------------------------------------------
# GGUF (llama.cpp), Llama architecture


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter order: per head, rows (i, i + D/2) -> (2i, 2i + 1) (interleaved pairs)."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `permute_rope_rows`: back to HF's rotate-half row order."""
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name_map(config: LlamaConfig) -> dict[Path, TensorSpec]:
    """Module path -> GGUF tensor name (llama.cpp's `blk.N.*` naming) for the Llama architecture."""
    q_fix = lambda a: unpermute_rope_rows(a, config.n_heads).T  # noqa: E731
    k_fix = lambda a: unpermute_rope_rows(a, config.n_kv_heads).T  # noqa: E731
    layer = {
        ("input_layernorm", "weight"): TensorSpec("blk.{i}.attn_norm.weight"),
        ("self_attn", "q_proj", "kernel"): TensorSpec("blk.{i}.attn_q.weight", q_fix),
        ("self_attn", "k_proj", "kernel"): TensorSpec("blk.{i}.attn_k.weight", k_fix),
        ("self_attn", "v_proj", "kernel"): TensorSpec("blk.{i}.attn_v.weight", transpose),
        ("self_attn", "o_proj", "kernel"): TensorSpec("blk.{i}.attn_output.weight", transpose),
        ("post_attention_layernorm", "weight"): TensorSpec("blk.{i}.ffn_norm.weight"),
        ("mlp", "gate_proj", "kernel"): TensorSpec("blk.{i}.ffn_gate.weight", transpose),
        ("mlp", "up_proj", "kernel"): TensorSpec("blk.{i}.ffn_up.weight", transpose),
        ("mlp", "down_proj", "kernel"): TensorSpec("blk.{i}.ffn_down.weight", transpose),
    }
    out = {
        ("embed_tokens", "embedding"): TensorSpec("token_embd.weight"),
        ("norm", "weight"): TensorSpec("output_norm.weight"),
        ("lm_head", "kernel"): TensorSpec("output.weight", transpose),
    }
    out.update({("layers", *k): v for k, v in layer.items()})
    return out


def config_from_gguf(reader) -> LlamaConfig:
    """LlamaConfig from GGUF metadata (`general.architecture` must be "llama")."""
    import gguf

    if not isinstance(reader, gguf.GGUFReader):
        reader = open_gguf(reader)
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; only 'llama' is supported")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF carries rope_freqs (Llama-3 rope scaling): not supported by the GGUF loader")
    g = lambda k, d=None: gguf_field(reader, f"llama.{k}", d)  # noqa: E731
    hidden, n_heads = int(g("embedding_length")), int(g("attention.head_count"))
    scaling = None
    if g("rope.scaling.type") not in (None, "none"):
        if g("rope.scaling.type") != "linear":
            raise ValueError(f"unsupported GGUF rope scaling {g('rope.scaling.type')!r}")
        scaling = RopeScaling("linear", float(g("rope.scaling.factor")))
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return LlamaConfig(
        vocab=int(vocab),
        hidden=hidden,
        intermediate=int(g("feed_forward_length")),
        n_layers=int(g("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(g("attention.head_count_kv", n_heads)),
        head_dim=int(g("attention.key_length", hidden // n_heads)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(g("context_length", 8192)),
        family="llama",
    )


def load_gguf(path: str | os.PathLike, *, dtype="float32") -> tuple[LlamaForCausalLM, LlamaConfig]:
    """Load a llama.cpp GGUF (Llama architecture, a path or an open reader); quantized tensors are
    dequantized to `dtype`."""
    import gguf

    reader = path if isinstance(path, gguf.GGUFReader) else open_gguf(path)
    config = config_from_gguf(reader)
    model = build_llama(config, gguf_tensors(reader), gguf_name_map(config), dtype=dtype, source=gguf_path(reader))
    return model, config
