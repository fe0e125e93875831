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
import re
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


# The calibration window is the first few thousand tokens of the topics text (~4 characters per token);
# haystacks skip far past it, so calibration and evaluation text stay disjoint.
HAYSTACK_SKIP_CHARS = 64_000


def prose_sentences(skip_chars: int = HAYSTACK_SKIP_CHARS) -> tuple[list[str], dict]:
    """Sentences of the prose paragraphs of ``pydoc_data/topics.py`` (tables, code and indented blocks
    dropped, lines joined), from ``skip_chars`` on: a haystack of real English text, with provenance."""
    from pydoc_data import topics

    text, _ = calibration_text()
    sentences = []
    start = text.find("\n\n", skip_chars)  # from a paragraph boundary, not mid-word
    for para in re.split(r"\n\s*\n", text[start:]):
        lines = para.split("\n")
        if any(line.startswith((" ", "\t", "|", "+", ">>>", "*")) or "|" in line for line in lines):
            continue  # indented code, tables, lists
        flat = " ".join(line.strip() for line in lines).strip()
        letters = sum(ch.isalpha() or ch == " " for ch in flat)
        if len(flat) < 40 or letters < 0.85 * len(flat) or not flat.endswith((".", ":")):
            continue
        sentences += [x.strip() for x in re.split(r"(?<=[.!?])\s+", flat) if len(x.strip()) > 1]
    info = _provenance("pydoc_data.topics prose sentences", [topics.__file__], "\n".join(sentences))
    info["skip_chars"] = skip_chars
    info["sentences"] = len(sentences)
    return sentences, info


def stdlib_package_sources(min_chars: int = 0) -> list[tuple[str, list[str]]]:
    """``(package, [module paths])`` for every pure-Python standard-library package here (sorted by name),
    its modules in sorted order, test packages and the packages the study evaluates on left out."""
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    out = []
    for name in sorted(os.listdir(root)):
        pkg = os.path.join(root, name)
        # test suites, the IDE and the codec tables (encodings: generated, repetitive) are not sessions
        if name in ("test", "idlelib", "encodings", "site-packages", "__pycache__", "pydoc_data") or name.startswith("."):
            continue
        if not os.path.isfile(os.path.join(pkg, "__init__.py")):
            continue
        files = []
        for dirpath, dirnames, filenames in os.walk(pkg):
            dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "test", "tests", "idle_test"))
            files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
        if sum(os.path.getsize(f) for f in files) >= min_chars:
            out.append((name, files))
    return out
