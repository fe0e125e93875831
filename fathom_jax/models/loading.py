"""Weight loading shared by the model families: a checkpoint's tensors -> a model's parameters.

Every family's loader (``llama/loading.py``, ``gemma3/loading.py``) builds its model with :func:`build_model`: the
model is created abstractly (``nnx.eval_shape``, no random init), then every parameter is filled from a name map
``module path -> TensorSpec(source name, transform)``. Per-layer source names contain ``{i}``; their tensors are
stacked on the leading layer axis the decoder scans over. A tensor the map needs but the source lacks raises a
:class:`MissingTensorError` naming it; a shape mismatch raises naming both shapes. The sources: a HF safetensors
directory (:class:`SafetensorsDir`) or a llama.cpp GGUF file (:func:`open_gguf`, :func:`gguf_tensors`); which
family reads a checkpoint is the registry's (``families.py``).
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

Path = tuple[str, ...]
Transform = Callable[[np.ndarray], np.ndarray]


class MissingTensorError(KeyError, ValueError):
    """A tensor the model needs is absent from the checkpoint."""

    def __str__(self):  # KeyError would repr() the message, quoting it
        return str(self.args[0])


def identity(a: np.ndarray) -> np.ndarray:
    return a


def transpose(a: np.ndarray) -> np.ndarray:
    # HF/GGUF linear weights are [out, in]; nnx.Linear kernels are [in, out].
    return a.T


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str  # source tensor name; "{i}" is replaced by the layer index for per-layer params
    transform: Transform = identity


def resolve_dtype(dtype):
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
    dtype = resolve_dtype(dtype)
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


# ---------------------------------------------------------------------------------------------
# Sources: HF safetensors directories and llama.cpp GGUF files


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


def gguf_path(reader) -> str:
    return os.fspath(getattr(getattr(reader, "data", None), "filename", None) or "GGUF file")


def gguf_tensors(reader) -> Callable[[str], np.ndarray | None]:
    """``get(name)``: the GGUF tensor ``name`` dequantized to float32 (numpy's axis order: [out, in] for a
    weight), or None if the file has no such tensor."""
    import gguf

    source = gguf_path(reader)
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
