"""Gemma 3 270M against transformers: the numbers behind tests/models/test_gemma3_loading.py's parity test.

Runs the oracle (tests/oracle/hf_reference.py in .venv-ref, or $FATHOM_ORACLE_PYTHON) on the test's prompts, then
the JAX decoder on the same GGUF, and writes results/parity_gemma3_<backend>.{json,md}: per prompt the max absolute
logit difference, the logit scale (max |transformers' logit|), their ratio (the tests' max_rel_err, bound 1e-4),
and whether the greedy tokens agree.

    .venv/bin/python -m scripts.parity_gemma3 [--out results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import tempfile
import time

import jax
import numpy as np

from fathom_jax.models import DenseCache, generation, hub
from fathom_jax.models.generation import generate
from scripts import harness
from tests.models import conftest as prompts  # the parity test's prompts, one source
from tests.support import forced_logits

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def oracle(out: str) -> dict:
    python = os.environ.get("FATHOM_ORACLE_PYTHON", os.path.join(REPO, ".venv-ref", "bin", "python"))
    args = ["gguf", "--gguf", hub.fetch_model("gemma3-270m"), "--bos", "--prompt", prompts.GEMMA_PROMPT,
            "--new-tokens", str(prompts.GEMMA_NEW_TOKENS), "--out", out]
    for text in prompts.GEMMA_EXTRA_PROMPTS:
        args += ["--extra-prompt", text]
    subprocess.run([python, os.path.join(REPO, "tests", "oracle", "hf_reference.py"), *args], check=True,
                   stdout=subprocess.DEVNULL)
    return dict(np.load(out))


def compare(ours, ref) -> dict:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    diff, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    return {"max_abs_diff": diff, "scale": scale, "ratio": diff / scale}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "results"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        ref = oracle(os.path.join(tmp, "gemma3.npz"))
        oracle_s = time.time() - t0
    t0 = time.time()
    model, tok, cfg = hub.load_model("gemma3-270m")
    load_s = time.time() - t0
    rows = []
    texts = [("prompt", prompts.GEMMA_PROMPT, "tokens", "logits", "greedy")] + [
        (f"extra {i}", text, f"extra_tokens_{i}", f"extra_last_logits_{i}", f"extra_greedy_{i}")
        for i, text in enumerate(prompts.GEMMA_EXTRA_PROMPTS)]
    for name, text, tokens_key, logits_key, greedy_key in texts:
        ids = [tok.bos_id, *tok.encode(text)]
        assert ids == ref[tokens_key].tolist(), f"{name}: tokens differ from transformers'"
        last = logits_key != "logits"
        if last:  # the prompt's logits at its last token
            logits, _, _ = generation.prefill(model, np.asarray(ids)[None], [len(ids)], DenseCache(), len(ids))
        else:  # every position's, teacher-forced through decode steps
            logits, _ = forced_logits(model, np.asarray(ids)[None])
        gen = np.asarray(generate(model, np.asarray(ids), len(ref[greedy_key])))
        rows.append({"prompt": name, "tokens": len(ids), "positions_compared": 1 if last else len(ids),
                     **compare(logits[0], ref[logits_key]), "greedy_equal": bool((gen == ref[greedy_key]).all()),
                     "greedy_tokens": len(gen), "greedy_text": tok.decode(gen)})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    res = {"meta": {"command": harness.command("scripts.parity_gemma3"),
                    "commit": commit.stdout.strip() + ("-dirty" if dirty else ""),
                    "date": datetime.date.today().isoformat(), "jax": jax.__version__, "backend": jax.default_backend(),
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                    "model": "Gemma 3 270M, Q4_K_M GGUF dequantized to f32 (both sides)",
                    "oracle_seconds": round(oracle_s, 1), "load_seconds": round(load_s, 1)},
           "rows": rows}
    prefix = os.path.join(a.out, f"parity_gemma3_{jax.default_backend()}")
    with open(prefix + ".json", "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"# Gemma 3 270M: the JAX decoder against transformers ({res['meta']['date']}, {res['meta']['commit']})",
             "", f"`{res['meta']['command']}`; JAX {jax.__version__} on {jax.default_backend()}; "
             f"{res['meta']['model']}. Ratio: max |logit difference| / max |transformers' logit| (the parity "
             "tests' bound: 1e-4). Prompts start with BOS.", "",
             "| prompt | tokens | positions | max abs diff | scale | ratio | greedy equal | greedy text |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt']} | {r['tokens']} | {r['positions_compared']} | {r['max_abs_diff']:.3g} | "
                     f"{r['scale']:.3g} | {r['ratio']:.2e} | {r['greedy_equal']} ({r['greedy_tokens']}) | "
                     f"{json.dumps(r['greedy_text'])} |")
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
