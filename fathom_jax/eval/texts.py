"""Real text without downloads: prose from Python's own documentation and code from its standard library.

Calibration and evaluation use disjoint texts: the prose of ``pydoc_data/topics.py`` (the language
reference topics) calibrates, and a fixed list of standard-library modules (long code contexts, like
the coding-agent sessions the paper targets) evaluates. Both ship with every CPython, so the study
runs anywhere; the exact files and their hashes are recorded in every results file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

# Large, stable pure-Python modules; order fixes the text.
EVAL_MODULES = ("argparse", "typing", "dataclasses", "inspect", "pathlib", "ast", "enum", "functools")


def _module_file(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise FileNotFoundError(f"standard-library module {name!r} has no Python source here")
    return spec.origin


def calibration_text() -> tuple[str, dict]:
    """The Python language reference topics (prose), with provenance."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[key] for key in sorted(topics.topics))
    return text, _provenance("pydoc_data.topics (prose)", [topics.__file__], text)


def evaluation_text(modules: tuple[str, ...] = EVAL_MODULES) -> tuple[str, dict]:
    """Standard-library source code, concatenated in a fixed order, with provenance."""
    files = [_module_file(m) for m in modules]
    parts = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            parts.append(f"# file: {os.path.basename(path)}\n{f.read()}")
    text = "\n\n".join(parts)
    return text, _provenance("stdlib sources (code)", files, text)


def _provenance(kind: str, files: list[str], text: str) -> dict:
    return {
        "kind": kind,
        "files": [os.path.basename(f) for f in files],
        "python": sys.version.split()[0],
        "chars": len(text),
        "sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
    }


def token_window(ids, length: int, *, name: str = "text") -> list[int]:
    """The first ``length`` token ids, or a clear error when the text is too short."""
    ids = list(ids)
    if len(ids) < length:
        raise ValueError(f"{name} has {len(ids)} tokens, fewer than the {length} the window needs")
    return ids[:length]
