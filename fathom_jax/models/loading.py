"""Weight loading: HF safetensors checkpoints and llama.cpp GGUF files -> `LlamaForCausalLM`.

Both paths, and Gemma 3's (`gemma3_loading.py`), share `build_model`: the model is created abstractly
(`nnx.eval_shape`, no random init), then every parameter is filled from a name map `module path ->
TensorSpec(source name, transform)`. Per-layer source names contain `{i}`; their tensors are stacked on the
leading layer axis the decoder scans over. A tensor the map needs but the source lacks raises a
`MissingTensorError` naming it; a shape mismatch raises naming both shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Callable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from fathom_jax.models.config import LlamaConfig, RopeScaling, gguf_field
from fathom_jax.models.llama import LlamaForCausalLM

Path = tuple[str, ...]
Transform = Callable[[np.ndarray], np.ndarray]


class MissingTensorError(KeyError, ValueError):
    """A tensor the model needs is absent from the checkpoint."""

    def __str__(self):  # KeyError would repr() the message, quoting it
        return str(self.args[0])


def _identity(a: np.ndarray) -> np.ndarray:
    return a


def _transpose(a: np.ndarray) -> np.ndarray:
    # HF/GGUF linear weights are [out, in]; nnx.Linear kernels are [in, out].
    return a.T


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str  # source tensor name; "{i}" is replaced by the layer index for per-layer params
    transform: Transform = _identity


def _resolve_dtype(dtype):
    return jnp.dtype({"bf16": "bfloat16", "f32": "float32"}.get(dtype, dtype))


def build_model(
    make: Callable[..., nnx.Module],
    get_tensor: Callable[[str], np.ndarray | None],
    name_map: dict[Path, TensorSpec],
    stacks: Mapping[str, Sequence[int]],
    *,
    dtype="float32",
    source: str = "checkpoint",
) -> nnx.Module:
    """The model ``make(dtype=, rngs=)`` with every parameter filled from `get_tensor(name)` (None if absent).

    ``stacks``: each stacked module (parameters on a leading layer axis) -> the model layer index of each of its
    entries, in order; a per-layer source name's ``{i}`` is that index.
    """
    dtype = _resolve_dtype(dtype)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: make(dtype=dtype, rngs=nnx.Rngs(0))))

    def fetch(name: str) -> np.ndarray:
        a = get_tensor(name)
        if a is None:
            raise MissingTensorError(f"tensor {name!r} is missing from {source}")
        return a

    pure: dict = {}
    for path, var in nnx.to_flat_state(state):
        path = tuple(str(p) for p in path)
        if path not in name_map:
            raise ValueError(f"no name-map entry for model parameter {'.'.join(path)}")
        spec = name_map[path]
        if path[0] in stacks:
            arr = np.stack([spec.transform(fetch(spec.name.format(i=i))) for i in stacks[path[0]]])
        else:
            arr = spec.transform(fetch(spec.name))
        want = var.get_value().shape
        if arr.shape != want:
            raise ValueError(
                f"tensor {spec.name!r} from {source} has shape {arr.shape} after transform, "
                f"model parameter {'.'.join(path)} expects {want}"
            )
        node = pure
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = jnp.asarray(arr, dtype=dtype)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


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
        ("lm_head", "kernel"): TensorSpec("lm_head.weight", _transpose),
    }
    out: dict[Path, TensorSpec] = {}
    for path in _module_paths(config):
        if path[0] != "layers":
            out[path] = top[path]
            continue
        *mid, leaf = path[1:]
        hf_leaf = "weight" if leaf == "kernel" else leaf
        out[path] = TensorSpec(
            f"model.layers.{{i}}.{'.'.join(mid)}.{hf_leaf}", _transpose if leaf == "kernel" else _identity
        )
    return out


class SafetensorsDir:
    """Lazy name -> numpy reader over `model.safetensors` or a sharded `*.index.json` directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        index = os.path.join(self.path, "model.safetensors.index.json")
        single = os.path.join(self.path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.exists(single):
            weight_map = None
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {self.path}")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {f: self._open(os.path.join(self.path, f)) for f in files}
        self._where = weight_map or {k: "model.safetensors" for k in self._handles["model.safetensors"].keys()}

    @staticmethod
    def _open(file: str):
        from safetensors import safe_open

        try:
            # framework="flax" reads bf16 too (numpy has no bf16); np.asarray turns it into ml_dtypes.
            return safe_open(file, framework="flax")
        except Exception as err:  # safetensors raises its own error types for a damaged header
            raise ValueError(f"{file} is not a readable safetensors file ({err})") from err

    def __call__(self, name: str) -> np.ndarray | None:
        f = self._where.get(name)
        if f is None:
            return None
        try:
            return np.asarray(self._handles[f].get_tensor(name))
        except Exception as err:
            raise ValueError(f"{os.path.join(self.path, f)}: cannot read tensor {name!r} ({err}); the file "
                             "is truncated or damaged") from err


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


def hf_tokenizer(path: str | os.PathLike):
    """The `tokenizer.json` of a HF checkpoint directory."""
    from fathom_jax.models.tokenizer import from_tokenizer_json

    file = os.path.join(os.fspath(path), "tokenizer.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} does not exist: the checkpoint directory needs its tokenizer.json")
    try:
        return from_tokenizer_json(file)
    except Exception as err:  # the tokenizers library raises its own exception type
        raise ValueError(f"{file} is not a readable tokenizer ({err})") from err


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
        ("self_attn", "v_proj", "kernel"): TensorSpec("blk.{i}.attn_v.weight", _transpose),
        ("self_attn", "o_proj", "kernel"): TensorSpec("blk.{i}.attn_output.weight", _transpose),
        ("post_attention_layernorm", "weight"): TensorSpec("blk.{i}.ffn_norm.weight"),
        ("mlp", "gate_proj", "kernel"): TensorSpec("blk.{i}.ffn_gate.weight", _transpose),
        ("mlp", "up_proj", "kernel"): TensorSpec("blk.{i}.ffn_up.weight", _transpose),
        ("mlp", "down_proj", "kernel"): TensorSpec("blk.{i}.ffn_down.weight", _transpose),
    }
    out = {
        ("embed_tokens", "embedding"): TensorSpec("token_embd.weight"),
        ("norm", "weight"): TensorSpec("output_norm.weight"),
        ("lm_head", "kernel"): TensorSpec("output.weight", _transpose),
    }
    out.update({("layers", *k): v for k, v in layer.items()})
    return out


def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` over ``path``; a missing, truncated or foreign file raises naming the file.

    Parsing the metadata takes seconds, and a command reads one file's configuration, then its
    tokenizer, then its weights: each version of a file (size, modification time) is parsed once.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist (expected a GGUF file or a HF checkpoint directory)")
    stat = os.stat(path)
    return _read_gguf(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _read_gguf(path: str, size: int, mtime_ns: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # gguf reports damage as numpy reshape errors or a bare "GGUF magic invalid"
        raise ValueError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err}); it may be "
                         "truncated or not a GGUF model") from err


def _gguf_path(reader) -> str:
    return os.fspath(getattr(getattr(reader, "data", None), "filename", None) or "GGUF file")


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
    model = build_llama(config, gguf_tensors(reader), gguf_name_map(config), dtype=dtype, source=_gguf_path(reader))
    return model, config


def gguf_tensors(reader) -> Callable[[str], np.ndarray | None]:
    """``get(name)``: the GGUF tensor ``name`` dequantized to float32 (numpy's axis order: [out, in] for a
    weight), or None if the file has no such tensor."""
    import gguf

    source = _gguf_path(reader)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> np.ndarray | None:
        t = tensors.get(name)
        if t is None:
            return None
        try:
            return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except Exception as err:
            raise ValueError(f"{source}: cannot read tensor {name!r} ({err}); the file is truncated or damaged") from err

    return get
