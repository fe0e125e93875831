"""Reading compiled programs' HLO text: guards (no copy of a host-resident array, no copy of a layer's weights) and
the instructions and kernel launches a program runs.

No Pallas GPU lowering documents host-memory operands; on JAX 0.11.2 the Triton backend reads them in
place (the ``S(5)`` host parameters go straight into the kernels' custom calls). A JAX or XLA upgrade that
silently staged the store or the K/V cache through device memory would read hundreds of MB per layer, and a
program that returns a host array makes XLA copy all of it (``results/offload_h200_before_inplace.md``);
:func:`host_array_copies` finds such instructions in a compiled module's text so a test can fail loudly.

The layer scan slices each layer's weights out of the stacked ``[L, ...]`` arrays. A GEMM that XLA emits as a Triton
fusion cannot read such a slice in place, so XLA copies it first (386 MB per Qwen3-8B layer, every decode step:
``results/decode_step_h200.md``); :data:`fathom_jax.models.generation.WEIGHT_GEMM_OPTIONS` makes the GEMMs cuBLAS calls
under XLA's dynamic-slice fusion, which read the slice where it lies. :func:`device_copies` lists the copies and
dynamic slices a compiled program still runs, so a test catches an XLA that drops that fusion.

Under both: :func:`hlo_instructions` (every instruction with its bytes, computation and JAX source line) and
:func:`running_instructions` (those that run as work of their own). :func:`kernel_launches` counts the kernels a GPU
program launches, in its entry and per loop iteration and branch (``scripts/offload_measure.py``'s launches a layer);
:func:`hlo_collectives` the collectives a sharded program issues, each with how many times one run of the program runs
it (:func:`trip_counts`; ``scripts/step_collectives.py``).
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
_META = re.compile(r'op_name="([^"]*)"(?:.*?source_file="([^"]*)")?(?:.*?source_line=(\d+))?')
# An async op's "-start" shape holds its operands too (a 3.7 GB stack for a 100 MB slice): it counts at its "-done".
_NOT_WORK = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "constant", "fusion-start", "copy-start",
             "async-start", "call-start"}
_COPY_OPS = {"copy", "copy-done", "dynamic-slice"}
_COPY_NAMES = ("copy", "input_dynamic_slice", "loop_dynamic_slice")


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


def hlo_instructions(hlo_text: str) -> list[dict]:
    """Every instruction of an HLO module's text: ``name``, ``opcode``, output ``bytes``, ``shape`` (truncated), the
    ``computation`` it is in, fusion ``kind``, and the JAX ``op`` and ``source`` line it came from."""
    out, computation = [], None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            computation = line.split()[0].lstrip("%") if not line.startswith("ENTRY") else "ENTRY"
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, opcode, _ = m.groups()
        meta = _META.search(line)
        kind = re.search(r"kind=(\w+)", line)
        kind = "kCustom" if "custom_fusion_config" in line else kind.group(1) if kind else None
        out.append({"name": name, "opcode": opcode, "shape": shape[:120], "computation": computation,
                    "bytes": sum(_nbytes(d, dims) for d, dims, _ in _ARRAY.findall(shape)),
                    "kind": kind, "op": meta.group(1)[-160:] if meta else None,
                    "source": (f"{meta.group(2).rsplit('/', 1)[-1]}:{meta.group(3)}"
                               if meta and meta.group(2) else None)})
    return out


def running_instructions(hlo_text: str, *, min_bytes: int = 0) -> list[dict]:
    """The instructions that run as work of their own (the entry computation, loop bodies, called computations; not
    the insides of fusions), with outputs of at least ``min_bytes``, largest first."""
    fused = {m.group(1) for m in re.finditer(r"calls=%?([\w.\-]+)", hlo_text)}
    bodies = {m.group(1) for m in re.finditer(r"body=%?([\w.\-]+)", hlo_text)} | {"ENTRY"}
    found = [i for i in hlo_instructions(hlo_text)
             if i["computation"] is not None and (i["computation"] not in fused or i["computation"] in bodies)
             and i["bytes"] >= min_bytes and i["opcode"] not in _NOT_WORK]
    return sorted(found, key=lambda i: -i["bytes"])


def device_copies(hlo_text: str, *, min_bytes: int = 1 << 20) -> list[dict]:
    """Copies and dynamic slices of at least ``min_bytes`` that a compiled program runs: ``copy``/``copy-done``,
    ``dynamic-slice`` and the fusions XLA names after them, or whose JAX op is a dynamic slice. Not a copy: an
    in-place ``dynamic-update-slice`` of a loop's output (it writes only its update), nor XLA's dynamic-slice
    fusion of a cuBLAS call (a ``kCustom`` fusion named ``dynamic_slice_fusion``: the GEMM reads the slice in
    place; its output is the GEMM's result and workspace)."""
    return [i for i in running_instructions(hlo_text, min_bytes=min_bytes) if i["kind"] != "kCustom" and (
            i["opcode"] in _COPY_OPS or i["name"].startswith(_COPY_NAMES) or (i["op"] or "").endswith("/dynamic_slice"))]


# Instructions that launch no kernel of their own: tuples and aliases, control flow (counted by what it runs), the
# completion half of an asynchronous op (its start launched it).
_NO_LAUNCH = _NOT_WORK | {"conditional", "call", "opt-barrier", "after-all", "add-dependency", "partition-id",
                          "replica-id", "copy-done", "async-done", "async-update", "call-done", "fusion-done"}
_CALLED = re.compile(r"(body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def kernel_launches(hlo_text: str) -> dict:
    """The kernels a compiled GPU program launches, where they run: ``{"entry": n, "loops": [{"body": name,
    "kernels": n, "branches": [[n, ...], ...], "captured": n, "triton_outside": n}, ...]}``. A loop's ``kernels`` run
    once an iteration (a decode step's layer scan: once a layer); ``branches`` lists, per conditional in its body, the
    kernels of each branch (only one of which runs). Fusions, custom calls (the Pallas kernels, cuBLAS), sorts, copies
    and collectives count one each; a called computation counts as its instructions. ``captured``: the body's kernels
    inside XLA's command buffers (computations ``command_buffer*``, launched as one CUDA graph), and
    ``triton_outside`` its Pallas Triton kernels launched one by one beside them."""
    instructions = hlo_instructions(hlo_text)
    by_computation: dict[str, list[dict]] = {}
    for inst in instructions:
        by_computation.setdefault(inst["computation"], []).append(inst)
    lines = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            lines[m.group(1)] = line

    def count(computation: str, loops: list, captured: bool = False) -> tuple[int, list, int, int]:
        kernels, branches, in_buffers, triton_outside = 0, [], 0, 0
        for inst in by_computation.get(computation, []):
            line = lines.get(inst["name"], "")
            called = dict((kind, name) for kind, name in _CALLED.findall(line))
            if inst["opcode"] == "while":
                inner, inner_branches, inner_captured, inner_triton = count(called["body"], loops)
                loops.append({"body": called["body"], "kernels": inner, "branches": inner_branches,
                              "captured": inner_captured, "triton_outside": inner_triton})
            elif inst["opcode"] == "conditional":
                names = _BRANCHES.search(line)
                names = ([n.strip().lstrip("%") for n in names.group(1).split(",")] if names else
                         [called[k] for k in ("false_computation", "true_computation") if k in called])
                branches.append([count(name, loops, captured)[0] for name in names])
            elif inst["opcode"] == "call":
                buffer = captured or called["to_apply"].startswith(_COMMAND_BUFFER)
                inner, inner_branches, inner_captured, inner_triton = count(called["to_apply"], loops, buffer)
                kernels, branches = kernels + inner, branches + inner_branches
                in_buffers, triton_outside = in_buffers + inner_captured, triton_outside + inner_triton
            elif inst["opcode"] not in _NO_LAUNCH:
                kernels += 1
                in_buffers += captured
                triton_outside += not captured and _TRITON in line
        return kernels, branches, in_buffers, triton_outside

    loops: list = []
    entry, entry_branches, _, _ = count("ENTRY", loops)
    return {"entry": entry, "entry_branches": entry_branches, "loops": loops}


_COMMAND_BUFFER = "command_buffer"  # XLA's command buffer scheduling outlines each captured run into one
_TRITON = 'custom_call_target="__gpu$xla.gpu.triton"'


_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all",
                "collective-broadcast", "ragged-all-to-all")
_REF = re.compile(r"\b(?:calls|body|condition|to_apply)=%?([\w.\-]+)")
_REFS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def trip_counts(hlo_text: str) -> dict[str, int]:
    """How many times one run of the module runs each computation (a while body: its known trip count times its
    caller's; everything else: its caller's)."""
    callers: dict[str, list[tuple[str, int]]] = {}
    computation = None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            computation = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
            continue
        trips = _TRIPS.search(line)
        body = re.search(r"body=%?([\w.\-]+)", line)
        callees = _REF.findall(line) + [c for group in _REFS.findall(line) for c in re.findall(r"[\w.\-]+", group)]
        for callee in callees:
            n = int(trips.group(1)) if trips and body and callee == body.group(1) else 1
            callers.setdefault(callee, []).append((computation, n))
    memo: dict[str, int] = {"ENTRY": 1}

    def count(name: str, depth: int = 0) -> int:
        if name not in memo:
            memo[name] = 0 if depth > 50 else sum(n * count(c, depth + 1) for c, n in callers.get(name, []))
        return memo[name]

    return {name: count(name) for name in set(callers) | {"ENTRY"}}


def hlo_collectives(hlo_text: str) -> list[dict]:
    """Every collective of an HLO module (an async pair once, at its ``-done``... or its ``-start`` shape where XLA
    keeps the pair): opcode, shape, bytes, ``per_step`` (runs per module run: :func:`trip_counts`), its computation and
    the JAX op and source line it came from."""
    runs = trip_counts(hlo_text)
    return [{"opcode": i["opcode"].removesuffix("-done"), "shape": i["shape"], "bytes": i["bytes"],
             "per_step": runs.get(i["computation"], 1), "computation": i["computation"], "op": i["op"],
             "source": i["source"]}
            for i in hlo_instructions(hlo_text)
            if i["opcode"].startswith(_COLLECTIVES) and not i["opcode"].endswith("-start")]
