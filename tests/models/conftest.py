"""Fixtures for the decoder tests: HF reference outputs from the oracle venv, the real SmolLM2.

The oracle (`tests/oracle/hf_reference.py`) runs under `.venv-ref` (Python 3.11 + CPU torch +
transformers), made by `scripts/setup_env.sh`. Parity tests skip only when that venv is absent.
"""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORACLE_SCRIPT = os.path.join(REPO, "tests", "oracle", "hf_reference.py")
ORACLE_PYTHON = os.environ.get("FATHOM_ORACLE_PYTHON", os.path.join(REPO, ".venv-ref", "bin", "python"))

TINY_CASES = ("llama", "llama3", "qwen2", "qwen3")
SMOL_PROMPT = (
    "<|im_start|>user\nWhat is the capital of France? Answer in 3 words.<|im_end|>\n<|im_start|>assistant\n"
)
SMOL_NEW_TOKENS = 16


def run_oracle(*args: str) -> None:
    if not os.path.exists(ORACLE_PYTHON):
        pytest.skip(f"HF oracle venv missing ({ORACLE_PYTHON}); create it with scripts/setup_env.sh")
    res = subprocess.run([ORACLE_PYTHON, ORACLE_SCRIPT, *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"oracle {args[0]} failed:\n{res.stderr[-4000:]}")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> str:
    """Directory with one tiny random HF checkpoint + ref.npz per case in TINY_CASES."""
    out = tmp_path_factory.mktemp("hf_tiny")
    run_oracle("tiny", "--out", str(out))
    return str(out)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from fathom_jax.models.hub import fetch_model

    return fetch_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_ref(smollm2_path, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("hf_smol") / "smol.npz"
    run_oracle("gguf", "--gguf", smollm2_path, "--prompt", SMOL_PROMPT,
               "--new-tokens", str(SMOL_NEW_TOKENS), "--out", str(out))
    return dict(np.load(out))


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(model, tokenizer, config), f32, loaded once per session."""
    from fathom_jax.models.hub import load_smollm2

    return load_smollm2()


def max_rel_err(a, b) -> float:
    """max |a - b| / max |b|: relative to the logit scale (elementwise ratios blow up near 0)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())
