"""Fixtures for the decoder tests: HF reference outputs from the oracle venv, the real SmolLM2.

The oracle (`tests/oracle/hf_reference.py`) runs under `.venv-ref` (Python 3.11 + CPU torch +
transformers), made by `scripts/setup_env.sh --with-oracle`. Parity tests skip only when that venv is absent.
Oracle runs take ~5-20 s each (mostly torch/transformers start-up and GGUF dequantisation), so
they are started in the background as soon as collection shows a test needs them, and overlap
with the JAX side's own loading and compiling.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORACLE_SCRIPT = os.path.join(REPO, "tests", "oracle", "hf_reference.py")
ORACLE_PYTHON = os.environ.get("FATHOM_ORACLE_PYTHON", os.path.join(REPO, ".venv-ref", "bin", "python"))

SMOL_PROMPT = (
    "<|im_start|>user\nWhat is the capital of France? Answer in 3 words.<|im_end|>\n<|im_start|>assistant\n"
)
SMOL_NEW_TOKENS = 16
# Further prompts for the downstream sweeps' dense path (tests/eval): a plain completion over prose with a
# needle, in RULER's template, and a span of code; greedy tokens only.
SMOL_EXTRA_PROMPTS = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the numbers afterwards.\nThe sky was clear over the harbor. One of the special magic numbers for "
    "lucky-kettle is: 4839201. Ships came and went all day.\nWhat are all the special magic numbers for "
    "lucky-kettle mentioned in the provided text? The special magic numbers for lucky-kettle mentioned in the "
    "provided text are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n",
)

_jobs: dict[str, tuple[subprocess.Popen | None, str]] = {}  # fixture name -> (process, output path)
_tmp = tempfile.mkdtemp(prefix="fathom_oracle_")


def _oracle_args(name: str) -> tuple[list[str], str]:
    if name == "tiny_checkpoints":
        out = os.path.join(_tmp, "tiny")
        return ["tiny", "--out", out], out
    from fathom_jax.models.hub import fetch_model

    out = os.path.join(_tmp, "smol.npz")
    args = ["gguf", "--gguf", fetch_model("smollm2"), "--prompt", SMOL_PROMPT,
            "--new-tokens", str(SMOL_NEW_TOKENS), "--out", out]
    for text in SMOL_EXTRA_PROMPTS:
        args += ["--extra-prompt", text]
    return args, out


def _start(name: str) -> None:
    if name in _jobs:
        return
    if not os.path.exists(ORACLE_PYTHON):
        _jobs[name] = (None, "")
        return
    args, out = _oracle_args(name)
    proc = subprocess.Popen([ORACLE_PYTHON, ORACLE_SCRIPT, *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _jobs[name] = (proc, out)


def _result(name: str) -> str:
    _start(name)
    proc, out = _jobs[name]
    if proc is None:
        pytest.skip(f"HF oracle venv missing ({ORACLE_PYTHON}); create it with scripts/setup_env.sh --with-oracle")
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"oracle for {name} failed (exit {proc.returncode}):\n{err[-4000:]}")
    return out


def pytest_collection_modifyitems(session, config, items):
    oracles = ("tiny_checkpoints", "smollm2_ref")
    wanted = {f for item in items for f in getattr(item, "fixturenames", ()) if f in oracles}
    for name in sorted(wanted):
        _start(name)


def pytest_sessionfinish(session, exitstatus):
    for proc, _ in _jobs.values():
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    shutil.rmtree(_tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_checkpoints() -> str:
    """Directory with one tiny random HF checkpoint + ref.npz per case (see hf_reference.CASES)."""
    return _result("tiny_checkpoints")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from fathom_jax.models.hub import fetch_model

    return fetch_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_ref() -> dict:
    """transformers' tokens, logits [T, V] and greedy tokens for SMOL_PROMPT on the SmolLM2 GGUF, and
    ``extra_tokens_<i>`` / ``extra_greedy_<i>`` for each of SMOL_EXTRA_PROMPTS."""
    return dict(np.load(_result("smollm2_ref")), prompt=SMOL_PROMPT, extra_prompts=SMOL_EXTRA_PROMPTS)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(model, tokenizer, config), f32, loaded once per session."""
    from fathom_jax.models.hub import load_smollm2

    return load_smollm2()
