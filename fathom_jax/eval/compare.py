"""Two results files compared number by number, their run records left out: did a run reproduce a committed one?

    fathom compare runs/fidelity_smollm2_4k_64pos.json results/fidelity_smollm2_4k_64pos.json

    c = compare.files("runs/fidelity_smollm2_4k_64pos.json", "results/fidelity_smollm2_4k_64pos.json")
    c.same(), c.line()

A results file's run record (``meta``: command line, commit, date, wall time, machine; or top-level ``command`` and
``machine``) differs between any two runs; everything else is what the run measured, and is compared: numbers by
their relative difference, every other value for equality, and the structure (keys, list lengths) itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

RECORD_KEYS = ("meta", "command", "machine")  # a run's record, not its measurement

# The committed results of this checkout (absent in an installed package): what a run's files are compared with.
COMMITTED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "results")


@dataclasses.dataclass
class Comparison:
    """What two results files' measurements share: ``numbers`` compared, those differing by more than ``rtol``
    (the largest relative difference and where), and the other fields that differ (paths)."""

    a: str
    b: str
    rtol: float = 0.0
    numbers: int = 0
    differing: int = 0
    largest: float = 0.0
    where: str = ""
    other: list[str] = dataclasses.field(default_factory=list)

    def same(self) -> bool:
        return not self.differing and not self.other

    def line(self) -> str:
        left_out = "/".join(RECORD_KEYS)
        if self.same():
            exact = "equal" if self.rtol == 0 else f"within {self.rtol:g} (relative)"
            return f"{self.a} measures what {self.b} does: its {self.numbers} numbers {exact} (the run records, " \
                   f"{left_out}, left out)"
        parts = []
        if self.differing:
            parts.append(f"{self.differing} of {self.numbers} numbers differ, by up to {self.largest:.3g} (relative) "
                         f"at {self.where}")
        if self.other:
            parts.append(f"{len(self.other)} other field(s) differ, first {self.other[0]}")
        return f"{self.a} differs from {self.b}: " + "; ".join(parts) + f" ({left_out} left out)"


def load(path: str) -> dict:
    """A results file's JSON (ValueError naming the file when it is not one)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as err:
        raise ValueError(f"cannot read {path!r} ({err.strerror or err})") from None
    except ValueError as err:
        raise ValueError(f"{path!r} is not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path!r} is no results file (its JSON is a {type(data).__name__}, not an object)")
    return data


def files(a: str, b: str, rtol: float = 0.0) -> Comparison:
    """Results files ``a`` and ``b`` compared (:func:`compare`)."""
    return compare(load(a), load(b), a, b, rtol)


def compare(a: dict, b: dict, name_a: str = "a", name_b: str = "b", rtol: float = 0.0) -> Comparison:
    """The measurements of results ``a`` and ``b`` (every top-level key but :data:`RECORD_KEYS`) compared."""
    out = Comparison(name_a, name_b, rtol)
    strip = lambda d: {k: v for k, v in d.items() if k not in RECORD_KEYS}  # noqa: E731
    _walk(strip(a), strip(b), "", out)
    return out


def _walk(a, b, path: str, out: Comparison) -> None:
    if _number(a) and _number(b):
        out.numbers += 1
        diff = _relative(float(a), float(b))
        if diff > out.rtol:
            out.differing += 1
            if diff > out.largest or not out.where:
                out.largest, out.where = diff, path or "(top)"
    elif isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key in a and key in b:
                _walk(a[key], b[key], where, out)
            else:
                out.other.append(f"{where} (only in {out.a if key in a else out.b})")
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.other.append(f"{path} ({len(a)} against {len(b)} entries)")
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{path}[{i}]", out)
    elif type(a) is not type(b) or a != b:  # (True == 1 in Python; a flag is no number)
        out.other.append(path or "(top)")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _relative(x: float, y: float) -> float:
    if x == y or (math.isnan(x) and math.isnan(y)):
        return 0.0
    scale = max(abs(x), abs(y))
    return math.inf if not math.isfinite(scale) else abs(x - y) / scale


def committed_twin(path: str) -> str | None:
    """The committed results file of ``path``'s name (``results/NAME`` of this checkout), if there is one and it is
    another file."""
    twin = os.path.join(COMMITTED, os.path.basename(path))
    if os.path.isfile(twin) and os.path.abspath(twin) != os.path.abspath(path):
        return twin
    return None
