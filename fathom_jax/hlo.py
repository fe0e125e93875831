"""Guards on compiled programs: no copy of a host-resident (``pinned_host``) array.

No Pallas GPU lowering documents host-memory operands; on JAX 0.11.2 the Triton backend reads them in
place (the ``S(5)`` host parameters go straight into the kernels' custom calls). A JAX or XLA upgrade that
silently staged the store or the K/V cache through device memory would read hundreds of MB per layer, and a
program that returns a host array makes XLA copy all of it (seen: ~1 s per step at 1M tokens);
:func:`host_array_copies` finds such instructions in a compiled module's text so a test can fail loudly.
"""

from __future__ import annotations

import math
import re

HOST_SPACE = "S(5)"  # XLA's memory space annotation of pinned host memory in GPU HLO layouts
# Instructions that may take a host operand without moving its bytes (kernels read it in place; the rest is
# plumbing of tuples, loops and aliases).
PASS_THROUGH = {"get-tuple-element", "tuple", "while", "parameter", "bitcast", "call", "conditional", "opt-barrier",
                "async-start", "async-done", "async-update",
                "call-start", "call-done", "call-update"}  # a computation run on another GPU stream (Placement.streams)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)\)", re.S)
_ARRAY = re.compile(r"(pred|[sufbc]\d+|bf16|f8\w*)\[([\d,]*)\]\{([^}]*)\}")
_BYTES = {"pred": 1, "bf16": 2}


def _nbytes(dtype: str, dims: str) -> int:
    size = _BYTES.get(dtype) or max(1, int(re.sub(r"\D", "", dtype) or 8) // 8)
    return size * math.prod(int(d) for d in dims.split(",") if d)


def _large_host_arrays(text: str, min_bytes: int) -> bool:
    return any(HOST_SPACE in layout and _nbytes(dtype, dims) >= min_bytes for dtype, dims, layout in _ARRAY.findall(text))


def host_array_copies(hlo_text: str, *, min_bytes: int = 1 << 20) -> list[str]:
    """Instructions that move a host-memory array of at least ``min_bytes``.

    * any op but the pass-through ones (tuples, loops, bitcasts) and custom calls with a large ``S(5)``
      operand: a copy (``copy``, ``copy-start``), a slice or a fusion reads that array's bytes;
    * any op but the pass-through ones that *produces* a large ``S(5)`` array, custom calls included: a
      program that returns (or aliases into) a host array makes XLA allocate a new one and copy into it.
    """
    found = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        _, result, op, operands = m.groups()
        if op in PASS_THROUGH:
            continue
        if (op != "custom-call" and _large_host_arrays(operands, min_bytes)) or _large_host_arrays(result, min_bytes):
            found.append(line.strip()[:300])
    return found
