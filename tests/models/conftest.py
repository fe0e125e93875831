"""Fixtures for the decoder tests: HF reference outputs from the oracle venv, the real SmolLM2.

The oracle (`tests/oracle/hf_reference.py`) runs under `.venv-ref` (Python 3.11 + CPU torch +
transformers), made by `scripts/setup_env.sh --with-oracle`. Parity tests skip only when that venv is absent.
Oracle runs take ~5-20 s each (mostly torch/transformers start-up and GGUF dequantisation), so
they are started in the background as soon as collection shows a test needs them, and overlap
with the JAX side's own loading and compiling.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.support import TINY_TOKENS, forced_logits, oracle_dir

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

# Gemma 3 270M (a base model; prompts start with BOS, as its GGUF asks): a completion, a needle more than one
# 512-token window before the question (only the global layers reach it), a span of code. GEMMA_TEXTS: further
# texts compared token for token with transformers' tokenizer from the same GGUF.
_FILLER = ("The sky was clear over the harbor. Ships came and went all day, and the gulls followed them out past "
           "the breakwater. In the market, traders argued about the price of salt and rope. ")
GEMMA_PROMPT = "The capital of France is"
GEMMA_EXTRA_PROMPTS = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the numbers afterwards.\nOne of the special magic numbers for lucky-kettle is: 4839201.\n" + _FILLER * 12
    + "\nWhat is the special magic number for lucky-kettle mentioned in the provided text? The special magic number "
    "for lucky-kettle mentioned in the provided text is",
    SMOL_EXTRA_PROMPTS[1],
)
GEMMA_NEW_TOKENS = 10  # the long prompt's answer, ": 4839201.", is 10 tokens
GEMMA_TEXTS = (
    "  two leading spaces,   three inside, a tab\there and trailing  ",
    "<start_of_turn>user\nHéllo wörld! 你好, 12345 squares ≈ 1.5e-3<end_of_turn>\n<start_of_turn>model\n",
    "\n\n\nthree newlines, a bell \x07 and an emoji 🦜 in byte fallback; ẞ ǅ ﬁ",
    "def f(x):\n    return x ** 2  # comment\n\n\n\n",
)

_jobs: dict[str, subprocess.Popen | None] = {}  # oracles this process started (None: no oracle venv)
_WAIT_S = 900


def _shared_dir() -> str:
    path = oracle_dir()  # pytest-xdist's workers each collect every test: the first to claim an oracle runs it
    os.makedirs(path, exist_ok=True)
    return path


_OUTPUTS = {"tiny_checkpoints": "tiny", "smollm2_ref": "smol.npz", "gemma3_ref": "gemma3.npz"}


def _output(name: str) -> str:
    return os.path.join(_shared_dir(), _OUTPUTS[name])


def _oracle_args(name: str) -> list[str]:
    out = _output(name)
    if name == "tiny_checkpoints":
        return ["tiny", "--out", out]
    from fathom_jax.models.hub import fetch_model

    if name == "gemma3_ref":
        args = ["gguf", "--gguf", fetch_model("gemma3-270m"), "--bos", "--prompt", GEMMA_PROMPT,
                "--new-tokens", str(GEMMA_NEW_TOKENS), "--out", out]
        extra, texts = GEMMA_EXTRA_PROMPTS, GEMMA_TEXTS
    else:
        args = ["gguf", "--gguf", fetch_model("smollm2"), "--prompt", SMOL_PROMPT,
                "--new-tokens", str(SMOL_NEW_TOKENS), "--out", out]
        extra, texts = SMOL_EXTRA_PROMPTS, ()
    for text in extra:
        args += ["--extra-prompt", text]
    for text in texts:
        args += ["--tokenize", text]
    return args


def _start(name: str) -> None:
    """Start oracle ``name`` in the background unless this run has (another worker may have claimed it)."""
    if name in _jobs:
        return
    if not os.path.exists(ORACLE_PYTHON):
        _jobs[name] = None
        return
    marker = os.path.join(_shared_dir(), name)
    try:
        os.close(os.open(marker + ".claimed", os.O_CREAT | os.O_EXCL))
    except FileExistsError:  # another worker runs it
        _jobs[name] = None
        return
    args = _oracle_args(name)
    # The exit status lands in NAME.rc (written whole by a rename), which every worker waits for.
    script = ('"$0" "$@" >/dev/null 2>"$ORACLE_MARKER.err"; echo $? >"$ORACLE_MARKER.rc.tmp"; '
              'mv "$ORACLE_MARKER.rc.tmp" "$ORACLE_MARKER.rc"')
    _jobs[name] = subprocess.Popen(["/bin/sh", "-c", script, ORACLE_PYTHON, ORACLE_SCRIPT, *args],
                                   env={**os.environ, "ORACLE_MARKER": marker}, start_new_session=True)


def _result(name: str) -> str:
    if not os.path.exists(ORACLE_PYTHON):
        pytest.skip(f"HF oracle venv missing ({ORACLE_PYTHON}); create it with scripts/setup_env.sh --with-oracle")
    _start(name)
    marker = os.path.join(_shared_dir(), name)
    deadline = time.monotonic() + _WAIT_S
    while not os.path.exists(marker + ".rc"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"oracle for {name} gave no result in {_WAIT_S} s ({marker})")
        time.sleep(0.2)
    code = int(pathlib.Path(marker + ".rc").read_text().strip() or -1)
    if code != 0:
        err = pathlib.Path(marker + ".err").read_text() if os.path.exists(marker + ".err") else ""
        raise RuntimeError(f"oracle for {name} failed (exit {code}):\n{err[-4000:]}")
    return _output(name)


def pytest_collection_modifyitems(session, config, items):
    oracles = tuple(_OUTPUTS)
    wanted = {f for item in items for f in getattr(item, "fixturenames", ()) if f in oracles}
    for name in sorted(wanted):
        _start(name)


def pytest_sessionfinish(session, exitstatus):
    # An oracle this worker started may still serve the other worker: let it finish, unless the run was stopped.
    for proc in _jobs.values():
        if proc is None or proc.poll() is not None:
            continue
        try:
            proc.wait(timeout=0 if exitstatus == pytest.ExitCode.INTERRUPTED else _WAIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the shell and the oracle under it
            proc.wait()


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


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    from fathom_jax.models.hub import fetch_model

    return fetch_model("gemma3-270m")


@pytest.fixture(scope="session")
def gemma3_ref() -> dict:
    """transformers' tokens (with BOS), logits [T, V] and greedy tokens for GEMMA_PROMPT on the Gemma 3 GGUF;
    ``extra_tokens_<i>`` / ``extra_last_logits_<i>`` / ``extra_greedy_<i>`` for each of GEMMA_EXTRA_PROMPTS, and
    ``tokenize_<i>`` (no BOS) for each of GEMMA_TEXTS."""
    return dict(np.load(_result("gemma3_ref")), prompt=GEMMA_PROMPT, extra_prompts=GEMMA_EXTRA_PROMPTS,
                texts=GEMMA_TEXTS)


# The tiny random model of tests/conftest.py under the names its decoder tests use, and its prefill of TINY_TOKENS.
@pytest.fixture(scope="module")
def CFG(tiny_config):
    return tiny_config


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def full_logits(model, CFG):
    """Teacher-forced logits [B, T, V] at every position of TINY_TOKENS, and the dense cache after them."""
    logits, cache = forced_logits(model, TINY_TOKENS, 16)
    assert int(cache.length) == TINY_TOKENS.shape[1]
    return logits, cache
