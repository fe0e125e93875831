"""Guards on compiled programs: no copy of a host-resident (``pinned_host``) array.

No Pallas GPU lowering documents host-memory operands; on JAX 0.11.2 the Triton backend reads them in
place (the ``S(5)`` host parameters go straight into the kernels' custom calls). A JAX or XLA upgrade that
silently staged the store or the K/V cache through device memory would read hundreds of MB per layer;
:func:`host_array_copies` finds such instructions in a compiled module's text so a test can fail loudly.
"""

from __future__ import annotations

import math
import re

HOST_SPACE = "S(5)"  # XLA's memory space annotation of pinned host memory in GPU HLO layouts
# Instructions that may take a host operand without moving its bytes (kernels read it in place; the rest is
# plumbing of tuples, loops and aliases).
PASS_THROUGH = {"custom-call", "get-tuple-element", "tuple", "while", "parameter", "bitcast", "call",
                "conditional", "opt-barrier", "async-start", "async-done", "async-update"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)\)", re.S)
_ARRAY = re.compile(r"(pred|[sufbc]\d+|bf16|f8\w*)\[([\d,]*)\]\{([^}]*)\}")
_BYTES = {"pred": 1, "bf16": 2}


def _nbytes(dtype: str, dims: str) -> int:
    size = _BYTES.get(dtype) or max(1, int(re.sub(r"\D", "", dtype) or 8) // 8)
    return size * math.prod(int(d) for d in dims.split(",") if d)


def host_array_copies(hlo_text: str, *, min_bytes: int = 1 << 20) -> list[str]:
    """Instructions that read a host-memory array of at least ``min_bytes`` other than in place.

    A copy (``copy``, ``copy-start``), a slice, a fusion or any other op than the pass-through ones
    (custom calls, tuples, loops, bitcasts) with a large ``S(5)`` operand moves that array's bytes.
    """
    found = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        _, _, op, operands = m.groups()
        if op in PASS_THROUGH:
            continue
        for dtype, dims, layout in _ARRAY.findall(operands):
            if HOST_SPACE in layout and _nbytes(dtype, dims) >= min_bytes:
                found.append(line.strip()[:300])
                break
    return found
