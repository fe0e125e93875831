"""Step agreement on long code sessions (paper 5.6, Table 8), built from the standard library's sources.

A session is a window of one standard-library package's modules concatenated in order (``# file:`` headers
between them), exactly ``prompt_tokens`` long; the target is the next real span of code. Every method
decodes the next tokens from the same prefill, and its score is the word-level sequence-match ratio
(:class:`difflib.SequenceMatcher` over whitespace-separated words) between its step and the exact top-k
step at the same k: what every scan is built to reproduce.

    sessions = make_sessions(tokenizer, count=40, prompt_tokens=4032, steps=64)
    step_agreement(method_text, oracle_text)
"""

from __future__ import annotations

import dataclasses
import difflib
import os

MAX_PER_PACKAGE = 3  # sessions from one package at most, so that no package dominates


@dataclasses.dataclass(frozen=True)
class Session:
    """A prompt of one package's code and the real next span (token ids)."""

    package: str
    start: int  # token offset of the prompt in the package's text
    prompt: tuple[int, ...]
    target: tuple[int, ...]


def step_agreement(step: str, reference: str) -> float:
    """Word-level sequence-match ratio of two decoded steps (1.0 for two empty steps)."""
    a, b = step.split(), reference.split()
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def package_text(files: list[str], root: str) -> str:
    parts = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            parts.append(f"# file: {os.path.relpath(path, root)}\n{f.read()}")
    return "\n\n".join(parts)


def _leading_tokens(tokenizer, text: str, need: int) -> list[int]:
    """The tokens of ``text`` (at least its first ``need`` exactly as the whole text tokenizes) without
    tokenizing all of it: a prefix of ~8 characters per token, then the whole text only if that falls
    short. The tokenizer splits on whitespace and punctuation before merging, so a cut changes only the
    tokens at the cut, which lie past the first ``need`` (kept with a margin of 64 tokens)."""
    ids = tokenizer.encode(text[: 8 * (need + 64)])
    if len(ids) > need + 64 or len(text) <= 8 * (need + 64):
        return ids[:need] if len(text) > 8 * (need + 64) else ids
    return tokenizer.encode(text)


def make_sessions(tokenizer, count: int, prompt_tokens: int, steps: int) -> tuple[list[Session], dict]:
    """``count`` sessions: non-overlapping windows of ``prompt_tokens + steps`` tokens, at most
    :data:`MAX_PER_PACKAGE` per package, taken round-robin over the packages in name order (the first
    window of every package, then the second...). Raises if the standard library holds fewer."""
    import sysconfig

    from fathom_jax.eval import texts

    if count < 1:
        raise ValueError(f"sessions must be >= 1, got {count}")
    root = sysconfig.get_paths()["stdlib"]
    span = prompt_tokens + steps
    windows: list[list[Session]] = []
    for name, files in texts.stdlib_package_sources(min_chars=2 * span):  # ~3.5 characters per token of code
        ids = _leading_tokens(tokenizer, package_text(files, root), MAX_PER_PACKAGE * span)
        n = min(MAX_PER_PACKAGE, len(ids) // span)
        windows.append([Session(name, i * span, tuple(ids[i * span: i * span + prompt_tokens]),
                                tuple(ids[i * span + prompt_tokens: (i + 1) * span])) for i in range(n)])
    order = [w[i] for i in range(MAX_PER_PACKAGE) for w in windows if i < len(w)]
    if len(order) < count:
        raise ValueError(f"the standard library here yields {len(order)} sessions of {span} tokens "
                         f"(at most {MAX_PER_PACKAGE} per package), fewer than the {count} asked for")
    chosen = order[:count]
    info = {"kind": "stdlib packages (code)", "python": texts.sys.version.split()[0],
            "packages": sorted({s.package for s in chosen}), "max_per_package": MAX_PER_PACKAGE}
    return chosen, info
