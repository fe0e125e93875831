"""Long runs that survive interruption: each finished unit is one JSON line, written as it finishes; a resumed run
reads them back and skips those units.

    log = UnitLog("results/agreement_smollm2_4k.partial.jsonl", {"kind": "agreement", "config": {...}}, resume=True)
    saved = log.get("0:fathom:48@82")      # None: not finished yet
    log.add("0:fathom:48@82", {"tokens": [[...]]})
    log.remove()                           # once the run's results are written

The first line is the run's header (what it computes); resuming under another header is an error, so a resumed
run gives the results an uninterrupted one would. Every unit is deterministic given the header (the
prompts, the model and the programs are), which is what makes skipping it safe.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from collections.abc import Callable

from fathom_jax.eval import interrupt


class UnitLog:
    """The finished units of one run at ``path`` (``resume=False`` starts it afresh)."""

    def __init__(self, path: str, header: dict, *, resume: bool):
        self.path, self.header = path, json.loads(json.dumps(header))  # as it reads back
        self.saved: dict[str, dict] = {}
        if resume and os.path.exists(path):
            self.saved = self._read()
        else:
            with open(path, "w") as f:
                f.write(json.dumps({"header": self.header}) + "\n")

    def _read(self) -> dict[str, dict]:
        with open(self.path) as f:
            lines = f.read().split("\n")
        records, torn = [], False
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if i != len(lines) - 1:  # only the last line may be cut short (interrupted mid-write)
                    raise ValueError(f"--resume: {self.path} is damaged at line {i + 1}; delete it to start over") from None
                torn = True
        if not records or records[0].get("header") != self.header:
            got = records[0].get("header") if records else None
            raise ValueError(f"--resume: {self.path} holds a run of another configuration ({_difference(got, self.header)});"
                             " delete it, or run without --resume to start over")
        if torn:  # drop the cut line, or the next unit would be appended to it
            with open(self.path, "w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
        return {r["unit"]: r["data"] for r in records[1:] if "unit" in r}

    def get(self, unit: str) -> dict | None:
        return self.saved.get(unit)

    def add(self, unit: str, data: dict) -> None:
        """Append a finished unit (one line, flushed to the OS: a later interrupt does not lose it)."""
        line = json.dumps({"unit": unit, "data": data}) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
        self.saved[unit] = json.loads(json.dumps(data))

    def remove(self) -> None:
        if os.path.exists(self.path):
            os.remove(self.path)


def _difference(got: dict | None, want: dict) -> str:
    if not isinstance(got, dict):
        return "no header"
    keys = [k for k in sorted(set(got) | set(want)) if got.get(k) != want.get(k)]
    if "config" in keys and isinstance(got.get("config"), dict):
        fields = [f for f in want["config"] if got["config"].get(f) != want["config"][f]]
        return ", ".join(f"{f}: {got['config'].get(f)!r} there, {want['config'][f]!r} now" for f in fields)
    return ", ".join(f"{k}: {got.get(k)!r} there, {want.get(k)!r} now" for k in keys)


def finished(path: str, config: dict, say: Callable[[str], None] | None = None) -> bool:
    """Whether the results file ``path`` exists and was written for ``config`` (its ``meta.config``). Where it exists
    but is damaged or holds another configuration, ``say`` gets one line: this run computes it again (a damaged file
    was recomputed silently)."""
    if not os.path.exists(path):
        return False
    try:
        with open(path) as f:
            meta = json.load(f)["meta"]
        recorded = meta.get("config")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        if say is not None:
            why = " ".join(str(err).split())[:120] or type(err).__name__
            say(f"{path} is damaged ({type(err).__name__}: {why}); computing it again, to overwrite it")
        return False
    want = json.loads(json.dumps(config))
    if recorded == want:
        return True
    if say is not None:
        got = recorded if isinstance(recorded, dict) else {}
        say(f"{path} holds results of another configuration ({_difference({'config': got}, {'config': want})}); "
            "computing this one, to overwrite it")
    return False


@contextlib.contextmanager
def stop_on_interrupt(command: str, saved: Callable[[], str], argv: list[str]):
    """Ctrl-C in the block: one line on stderr saying what ``saved()`` kept and the command that resumes, then
    exit status 130 (``SystemExit``) instead of a ``KeyboardInterrupt`` traceback. Under
    :func:`fathom_jax.eval.interrupt.handled` (every command) the same line comes, and the process ends, within
    seconds even if the interrupt cannot reach this block."""
    def message() -> str:
        again = "fathom " + shlex.join(argv if "--resume" in argv else [*argv, "--resume"])
        return f"\n[{command}] interrupted: {saved()}; to continue where it stopped, run: {again}"

    with interrupt.reporting(message):
        try:
            yield
        except KeyboardInterrupt:
            interrupt.report()
            raise SystemExit(interrupt.EXIT_INTERRUPTED) from None
