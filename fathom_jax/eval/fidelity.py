"""Attention-output fidelity of a scan method (the paper's section 4 metric).

For each decode position p of a captured window, every layer and every query head: select
sink 4 + local 32 + top-(k - 36) keys among positions ``<= p`` by the method's approximate scores,
attend exactly over that set, and compare with dense attention over all ``p + 1`` keys:
``||o_sel - o_dense|| / ||o_dense||``. The reported number is the mean over positions, layers, heads.

A method enters as a *score function* ``score_fn(q, keys, length, layer_state) -> (scores, bits)``:
``q`` [Hkv, G, D] post-RoPE queries of position p grouped by KV head, ``keys`` [Hkv, T, D] the whole
window, ``length = p + 1`` (keys at or past it are the future and must be ignored: a store built with
that length is exactly the decode-time store), ``layer_state`` whatever per-layer pytree the method
needs (calibration slice, budget); it returns scores [Hkv, G, T] and the bits per token it read
[Hkv]. :func:`method_score_fn` makes one from any :class:`~fathom_jax.methods.ScanMethod`
(a :class:`MethodScore`, which the sweep evaluates without rebuilding the window's index per position).

:func:`attention_errors_many` evaluates many methods on one capture, each (method, layer) in two compiled
programs: the method's scores at every position (:mod:`~fathom_jax.eval.prefix_scan` on XLA: one product
against the window's index, built once per layer and shared), then the selection and attention, one program
for every method (:mod:`~fathom_jax.eval.ranking` on XLA). The numbers are those of the definition, a scan
on an index rebuilt at every position (``reuse_blocks=False``), bit for bit: ``tests/eval/test_fidelity.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from fathom_jax.eval import prefix_scan, ranking
from fathom_jax.index import KeyIndex, build_index, prefix_index, unpack_index
from fathom_jax.index_parts import IndexPart
from fathom_jax.methods import ScanMethod
from fathom_jax.scan import scan_scores
from fathom_jax.select import attend_rows, dense_attention, gather_rows, select_topk
from pallas_kernels import backend

ScoreFn = Callable[[Array, Array, Array, Any], Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Capture:
    """Post-RoPE queries, keys and values of one text window, for every layer."""

    q: Float[Array, "L H T D"]
    k: Float[Array, "L Hkv T D"]
    v: Float[Array, "L Hkv T D"]

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    def layer_queries(self, layer: int, positions: np.ndarray) -> jax.Array:
        """``[P, Hkv, G, D]`` queries of one layer at ``positions``."""
        _, n_heads, _, d = self.q.shape
        n_kv = self.k.shape[1]
        q = jnp.asarray(self.q[layer])[:, positions]  # [H, P, D]
        return jnp.moveaxis(q.reshape(n_kv, n_heads // n_kv, positions.size, d), 2, 0)

    def __post_init__(self):
        q, k, v = self.q, self.k, self.v
        if not (hasattr(q, "ndim") and hasattr(k, "ndim") and hasattr(v, "ndim")):
            return  # pytree internals (tracers / placeholders)
        if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
            raise ValueError(f"Capture wants q [L,H,T,D], k and v [L,Hkv,T,D]; got {q.shape}, {k.shape}, {v.shape}")
        if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
            raise ValueError(f"Capture: q {q.shape} does not match k {k.shape} (layers, tokens, D, H % Hkv)")


@dataclasses.dataclass(frozen=True)
class MethodScore:
    """The score function of a :class:`~fathom_jax.methods.ScanMethod` (a :data:`ScoreFn`).

    Called as a score function it builds the index with ``length = p + 1``: exactly the store a decode
    loop holds at position p (building with a length equals appending token by token; see the store
    tests). :func:`attention_errors` instead builds the window's index once per layer and cuts it to
    each position with :func:`~fathom_jax.index.prefix_index` (the same index, bit for bit, for one
    block of work). Rows whose methods differ only in data fields (Fathom's budget) share one compiled
    program (:meth:`program`).
    """

    method: ScanMethod

    def index(self, keys, calib, length=None) -> KeyIndex:
        if length is not None:
            length = jnp.broadcast_to(length, keys.shape[:-2])
        return build_index(keys, calib, self.method.parts, length=length)

    def scores(self, q, index: KeyIndex, calib):
        result = scan_scores(self.method, q, index, calib)
        return result.scores, result.bits_per_token

    def __call__(self, q, keys, length, calib):
        return self.scores(q, self.index(keys, calib, length), calib)

    def program(self) -> tuple[Hashable, dict[str, np.ndarray]]:
        """The key of the compiled sweep program that serves this score function, and the data it takes.

        On XLA a method's ``data_fields`` (Fathom's budget) enter as data, so every budget shares one
        program; the Pallas kernels size their run lists from the budget, so there each budget has its own.
        """
        names = self.method.data_fields if backend.resolve_implementation(None) == "xla" else ()
        static = tuple((f.name, getattr(self.method, f.name)) for f in dataclasses.fields(self.method)
                       if f.name not in names)
        return (type(self.method), static), {name: np.int32(getattr(self.method, name)) for name in names}

    def with_data(self, data: dict[str, Any]) -> "MethodScore":
        """This score function with its data fields set to ``data`` (traced values inside a program)."""
        return MethodScore(dataclasses.replace(self.method, **data)) if data else self


def method_score_fn(method: ScanMethod) -> MethodScore:
    """The score function of ``method``; ``layer_state`` is that layer's Calibration (or None)."""
    return MethodScore(method)


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One row of a sweep: a score function (one for every layer, or a sequence of per-layer ones) and the
    state it reads (a pytree with a leading layer axis, e.g. a Calibration, or None); ``name`` labels it
    on a progress bar."""

    score_fn: ScoreFn | Sequence[ScoreFn]
    layer_states: Any = None
    name: str = ""


def default_positions(num_tokens: int, count: int = 128) -> np.ndarray:
    """The last ``count`` positions of the window (the paper's decode positions)."""
    count = min(count, num_tokens)
    return np.arange(num_tokens - count, num_tokens, dtype=np.int32)


def _reference(q_p, keys, values, p):
    lengths = jnp.full(q_p.shape[:1], p + 1, jnp.int32)
    return dense_attention(q_p, keys, values, lengths)


@jax.jit
def _dense_layer(q, keys, values, positions):
    """Dense attention of one layer at every position ``[P, Hkv, G, D]`` (shared by every method)."""
    return jax.lax.map(lambda a: _reference(a[0], keys, values, a[1]), (q, positions))


# Positions scored together (vmapped; the same numbers as one at a time): bounds the dequantized windows held.
SCORE_CHUNK = 8


def _score_program(score_fn: ScoreFn, reuse: bool):
    """Scores [P, Hkv, G, T] and bits [P, Hkv] of one layer at every position: what one compiled program of a
    method runs. ``full`` is the window's index (``reuse``; see :func:`_window_index`), cut to each position's
    length, or None (the definition: ``score_fn`` rebuilds the index at every position)."""

    def run(queries, keys, positions, layer_states, layer, full, data):
        q, keys, layer_state = _take_layer((queries, keys, layer_states), layer)  # q [P, Hkv, G, D]
        fn = score_fn.with_data(data) if isinstance(score_fn, MethodScore) else score_fn
        if full is None:  # batched: the index rounds the same built at one position or several
            return jax.lax.map(lambda a: fn(a[0], keys, a[1] + 1, layer_state), (q, positions), batch_size=SCORE_CHUNK)
        index, windows = full
        if windows is not None:
            return prefix_scan.prefix_scores(fn.method, q, index, keys, positions + 1, layer_state, windows=windows)
        return jax.lax.map(lambda a: fn.scores(a[0], prefix_index(index, keys, a[1] + 1), layer_state),
                           (q, positions), batch_size=SCORE_CHUNK)

    return run


def _errors_program(k_sel: tuple[int, ...]):
    """Errors [P, K, Hkv, G] of one layer at every position from its scores: what one compiled program runs
    for every method (the same selection and attention whatever scored the keys)."""
    k_max = max(k_sel)

    def position_errors(q_p, keys, values, idx, mask, ref):
        # The largest k's rows once: every smaller k's selection is a prefix of its ranking.
        rows_k, rows_v = gather_rows(keys, values, idx)
        ref_norm = jnp.maximum(jnp.linalg.norm(ref, axis=-1), 1e-30)
        errs = [jnp.linalg.norm(attend_rows(q_p, rows_k[..., :k, :], rows_v[..., :k, :], mask[..., :k]) - ref,
                                axis=-1) / ref_norm for k in k_sel]
        return jnp.stack(errs)

    def run(queries, keys, values, positions, references, layer, scores):
        q, keys, values, refs = _take_layer((queries, keys, values, references), layer)
        lengths = jnp.broadcast_to((positions + 1)[:, None], scores.shape[:2])
        # One ranking serves every k: top-k orders by score, ties by lower position, so the top-k of a smaller
        # k is a prefix of the largest one's (the same sets, in the same order).
        idx, mask = _select(scores[..., : keys.shape[-2]], lengths, k_max)
        # Attention one position at a time: batched, XLA:CPU sums the softmax in another order.
        return jax.lax.map(lambda a: position_errors(a[0], keys, values, a[1], a[2], a[3]), (q, idx, mask, refs))

    return run


def _select(scores, lengths, k):
    """:func:`~fathom_jax.select.select_topk` of every position: the faster exact ranking where it runs on XLA."""
    if backend.resolve_implementation(None) == "xla":
        return ranking.select_topk(scores, lengths, k)
    return select_topk(scores, lengths, k)


def _window_index(parts: frozenset[IndexPart]):
    """The index of a layer's whole window with ``parts``, which every position of every row reading those
    parts cuts to its own length, and on XLA the windows plane reads multiply (:func:`~fathom_jax.eval.
    prefix_scan.plane_windows`; None elsewhere): built once, shared by those rows."""

    def build(keys, layer_states, layer):
        keys, calib = _take_layer((keys, layer_states), layer)
        full = build_index(keys, calib, parts)
        if backend.resolve_implementation(None) != "xla":
            return full, None
        full = unpack_index(full)  # the xla scan then reads codes without extracting bits each time
        return full, prefix_scan.plane_windows(full)

    return build


def _take_layer(tree, layer):
    """Layer ``layer`` of every leaf of ``tree`` (leading layer axis)."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, layer, keepdims=False), tree)


# Index parts built from rotated keys: they depend on the calibration, so only rows sharing it share them.


@dataclasses.dataclass(frozen=True)
class _Task:
    """One (evaluation, layer): the compiled program that computes it, the data it takes, and the window
    index it reads (``(layer, parts, calibration id)``, shared by the tasks of that layer reading the same
    parts; None: the program builds its own)."""

    row: int
    layer: int
    program: Hashable
    data: dict[str, np.ndarray]
    index: tuple[int, frozenset[IndexPart], int | None] | None
    also: list[int] = dataclasses.field(default_factory=list)  # rows whose same (evaluation, layer) this computes


def _signature(tree) -> Hashable:
    """The structure, shapes and dtypes of a pytree: what a compiled program's arguments must match."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((np.shape(x), np.dtype(x.dtype)) for x in leaves)


def _plan(evaluations: Sequence[Evaluation], n_layers: int, reuse_blocks: bool):
    """The tasks, layer by layer (a layer's window indexes are freed once its tasks are done), and the
    programs they run by key, in order of first use. A repeated (program, data, layer, state) - a per-layer
    plan picks budgets that flat rows already ran - is computed once."""
    tasks, programs, seen = [], {}, {}
    for row, ev in enumerate(evaluations):
        fns = list(ev.score_fn) if isinstance(ev.score_fn, Sequence) else [ev.score_fn] * n_layers
        if len(fns) != n_layers:
            raise ValueError(f"score_fn: got {len(fns)} per-layer functions for {n_layers} layers")
        for layer, fn in enumerate(fns):
            reuse = bool(reuse_blocks and isinstance(fn, MethodScore))
            key, data = fn.program() if isinstance(fn, MethodScore) else (fn, {})
            program = (key, reuse, _signature(ev.layer_states))
            programs.setdefault(program, _score_program(fn, reuse))
            index = None
            if reuse:
                # Rotated stores are built with the calibration: only rows sharing it share them.
                parts = fn.method.parts
                index = (layer, parts, id(ev.layer_states) if any(p.needs_calibration for p in parts) else None)
            same = (program, tuple((name, int(value)) for name, value in data.items()), layer, id(ev.layer_states))
            if same in seen:
                seen[same].also.append(row)
                continue
            seen[same] = _Task(row, layer, program, data, index)
            tasks.append(seen[same])
    return sorted(tasks, key=lambda task: task.layer), programs


def attention_errors(
    score_fn: ScoreFn | Sequence[ScoreFn],
    capture: Capture,
    k_sel: int | Sequence[int],
    *,
    positions: Int[Array, "P"] | None = None,
    layer_states: Any = None,
    progress: bool | Any = False,
    desc: str = "",
    reuse_blocks: bool = True,
    references: Any = None,
) -> tuple[Float[np.ndarray, "*K L P Hkv G"], Float[np.ndarray, "L P Hkv"]]:
    """Relative L2 error of every (layer, position, head), and the bits per token read at each.

    ``score_fn`` is one function for every layer or a sequence of per-layer functions (per-layer
    budgets). ``k_sel`` is one selection size or several (a leading K axis on the errors: one scan
    serves every k). ``layer_states`` is a pytree with a leading layer axis (sliced per layer) or None.
    The other arguments are :func:`attention_errors_many`'s (``desc`` names the progress bar).
    """
    several = not isinstance(k_sel, (int, np.integer))
    [(errors, bits)] = attention_errors_many([Evaluation(score_fn, layer_states, desc)], capture,
                                             k_sel if several else (k_sel,), positions=positions,
                                             progress=progress, reuse_blocks=reuse_blocks, references=references)
    return (errors if several else errors[0]), bits


def attention_errors_many(
    evaluations: Sequence[Evaluation],
    capture: Capture,
    k_sel: Sequence[int],
    *,
    positions: Int[Array, "P"] | None = None,
    progress: bool | Any = False,
    reuse_blocks: bool = True,
    references: Any = None,
    workers: int | None = None,
) -> list[tuple[Float[np.ndarray, "K L P Hkv G"], Float[np.ndarray, "L P Hkv"]]]:
    """:func:`attention_errors` of every evaluation on one capture: ``[(errors [K, L, P, Hkv, G], bits
    [L, P, Hkv]), ...]`` in their order, the same numbers as evaluating them one by one.

    Each (evaluation, layer) runs as one compiled program (:meth:`MethodScore.program`: one per method,
    whatever its budget). The programs of one layer that read the same index parts share one build of the
    window's index (``reuse_blocks``, :class:`MethodScore` functions: the index is built once per layer and
    cut to every position, :func:`~fathom_jax.index.prefix_index`; the same numbers, bit for bit, as
    rebuilding it per position, which ``reuse_blocks=False`` does). ``workers`` threads (default: one per
    core) run them while another compiles each program ahead of its first use.

    ``references``: :func:`dense_references` of the same capture and positions, to share dense attention
    between calls. ``progress``: True for a bar over (evaluation, layer) pairs, or a tqdm bar to advance
    by one per pair (an overall bar over many calls).
    """
    n_layers, _, n_tokens, _ = capture.q.shape
    positions = default_positions(n_tokens) if positions is None else np.asarray(positions, np.int32)
    if positions.size == 0 or positions.min() < 0 or positions.max() >= n_tokens:
        raise ValueError(f"positions must lie in [0, {n_tokens}), got {positions}")
    ks = tuple(int(k) for k in k_sel)
    if not ks:
        raise ValueError("k_sel: give at least one selection size")
    for k in ks:
        if k > n_tokens:
            raise ValueError(f"k={k} is larger than the captured context of {n_tokens} tokens")
    if references is None:
        references = dense_references(capture, positions)
    elif references.positions.shape != positions.shape or np.any(references.positions != positions):
        raise ValueError("references were computed at other positions than these")
    tasks, programs = _plan(evaluations, n_layers, reuse_blocks)
    bar = progress or None
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(evaluations) * n_layers, desc=evaluations[0].name or "layers", leave=False)
    inputs = (jnp.stack([capture.layer_queries(layer, positions) for layer in range(n_layers)]),
              jnp.asarray(capture.k), jnp.asarray(capture.v), jnp.asarray(positions), references.outputs)
    try:
        return _Run(evaluations, inputs, ks, tasks, programs, bar).results(workers or os.cpu_count() or 1)
    finally:
        if progress is True:
            bar.close()


def compile_ahead(
    evaluations: Sequence[Evaluation],
    shape: tuple[int, int, int, int, int],
    k_sel: Sequence[int],
    positions: int,
    *,
    reuse_blocks: bool = True,
) -> None:
    """Start compiling, in a background thread, what :func:`attention_errors_many` will run for these
    evaluations on a capture of ``shape = (layers, heads, kv_heads, tokens, head_dim)`` at ``positions``
    decode positions; it returns at once. ``layer_states`` may be shape structs (``jax.eval_shape``). The
    compiles (seconds each) then overlap whatever comes first, e.g. loading the model and capturing."""
    n_layers, n_heads, n_kv, n_tokens, d = shape
    f32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32)  # noqa: E731
    queries = f32(n_layers, positions, n_kv, n_heads // n_kv, d)
    inputs = (queries, f32(n_layers, n_kv, n_tokens, d), f32(n_layers, n_kv, n_tokens, d),
              jax.ShapeDtypeStruct((positions,), jnp.int32), queries)
    ks = tuple(int(k) for k in k_sel)
    tasks, programs = _plan(evaluations, n_layers, reuse_blocks)
    _Run(evaluations, inputs, ks, tasks, programs).compile_all()


# Compiled programs by (key, argument signature), kept across calls (a sweep calls once per capture, tests
# often), and the one thread that compiles them, in order of request.
_COMPILED: dict[Hashable, Future] = {}
_COMPILED_LOCK = threading.Lock()
_COMPILER = ThreadPoolExecutor(1, thread_name_prefix="fidelity-compile")


def _compile(key: Hashable, fn, args) -> Future:
    """The compiled ``fn`` for arguments like ``args`` (arrays or shape structs): cached, or compiling."""
    key = (key, _signature(args))
    with _COMPILED_LOCK:
        future = _COMPILED.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = _COMPILED[key] = _COMPILER.submit(lambda: jax.jit(fn).lower(*args).compile())
    return future


def cancel_compiles() -> None:
    """Drop the compiles not yet started (e.g. when the run they were for fails before it starts)."""
    with _COMPILED_LOCK:
        for key in [key for key, future in _COMPILED.items() if future.cancel()]:
            del _COMPILED[key]


class _Run:
    """One :func:`attention_errors_many` call: compiles every program in a background thread, in order of
    first use, while ``workers`` threads run the tasks (XLA:CPU runs a program on about one core, so several
    at once keep the machine busy). Each layer's window index is built once per (parts, calibration) and
    kept while tasks still need it."""

    def __init__(self, evaluations, inputs, k_sel, tasks, programs, bar=None):
        self.evaluations, self.inputs, self.tasks, self.programs, self.bar = evaluations, inputs, tasks, programs, bar
        self.k_sel = k_sel
        self.compiled: dict[Hashable, Future] = {}
        self.indexes: dict[Hashable, Future] = {}
        self.uses = collections.Counter(t.index for t in tasks if t.index is not None)
        self.lock = threading.Lock()
        n_layers, n_pos, n_kv, g, _ = inputs[0].shape
        # [K, L, P, Hkv, G] laid out position-major, as stacking every layer's [P, K, ...] output lays it out:
        # numpy's float32 means add in memory order, and the reports' numbers were taken from this layout.
        self.errors = [np.zeros((n_pos, len(k_sel), n_layers, n_kv, g), np.float32).transpose(1, 2, 0, 3, 4)
                       for _ in evaluations]
        self.bits = [np.zeros((n_layers, n_pos, n_kv), np.float32) for _ in evaluations]

    def compile_all(self) -> None:
        """Request every index build and program, in order of first use (cached ones are not recompiled)."""
        for task in self.tasks:
            if task.index is not None and task.index[1] not in self.compiled:
                self.compiled[task.index[1]] = _compile(("index", task.index[1]), _window_index(task.index[1]),
                                                        self._build_args(task))
            if task.program not in self.compiled:
                self.compiled[task.program] = _compile(task.program, self.programs[task.program],
                                                       self._score_args(task, self._index_shape(task)))
            if self.k_sel not in self.compiled:
                scores = jax.eval_shape(self.programs[task.program], *self._score_args(task, self._index_shape(task)))[0]
                self.compiled[self.k_sel] = _compile(("errors", self.k_sel), _errors_program(self.k_sel),
                                                     self._errors_args(task, scores))

    def results(self, workers: int):
        self.compile_all()
        with ThreadPoolExecutor(workers) as pool:
            pending = [pool.submit(self._run_task, task) for task in self.tasks]
            try:
                for done in pending:
                    done.result()
            finally:
                for future in pending:
                    future.cancel()
        return list(zip(self.errors, self.bits))

    def _build_args(self, task: _Task):
        """The index build's arguments: the keys, the calibration (rotated parts only) and the layer."""
        _, parts, state = task.index
        calib = self.evaluations[task.row].layer_states if state is not None else None
        return self.inputs[1], calib, np.int32(task.layer)

    def _score_args(self, task: _Task, full):
        queries, keys, _, positions, _ = self.inputs
        return queries, keys, positions, self.evaluations[task.row].layer_states, np.int32(task.layer), full, task.data

    def _errors_args(self, task: _Task, scores):
        return (*self.inputs, np.int32(task.layer), scores)

    def _index_shape(self, task: _Task):
        if task.index is None:
            return None
        return jax.eval_shape(_window_index(task.index[1]), *self._build_args(task))

    def _index(self, task: _Task):
        """The window index the task reads: built by the first task of its layer that needs it."""
        with self.lock:
            future = self.indexes.get(task.index)
            owner = future is None
            if owner:
                future = self.indexes[task.index] = Future()
        if owner:
            try:
                future.set_result(self.compiled[task.index[1]].result()(*self._build_args(task)))
            except BaseException as err:
                future.set_exception(err)
        return future.result()

    def _release(self, task: _Task):
        with self.lock:
            self.uses[task.index] -= 1
            if not self.uses[task.index]:
                del self.indexes[task.index]

    def _run_task(self, task: _Task):
        full = None if task.index is None else self._index(task)
        scores, bits = self.compiled[task.program].result()(*self._score_args(task, full))
        errors = self.compiled[self.k_sel].result()(*self._errors_args(task, scores))
        errors, bits = np.moveaxis(np.asarray(errors), 1, 0), np.asarray(bits)  # [K, P, Hkv, G], [P, Hkv]
        for row in (task.row, *task.also):
            self.errors[row][:, task.layer] = errors
            self.bits[row][task.layer] = bits
        if task.index is not None:
            self._release(task)
        if self.bar is not None:
            self.bar.set_postfix_str(self.evaluations[task.row].name, refresh=False)
            self.bar.update(1 + len(task.also))


@dataclasses.dataclass(frozen=True)
class References:
    """Dense attention outputs ``[L, P, Hkv, G, D]`` of a capture at ``positions``: every method's target."""

    positions: np.ndarray
    outputs: Any


def dense_references(capture: Capture, positions: Int[Array, "P"] | None = None) -> References:
    """Dense attention of every layer at ``positions`` (default: :func:`default_positions`), computed once
    and shared by every method evaluated on the capture."""
    n_tokens = capture.q.shape[2]
    positions = default_positions(n_tokens) if positions is None else np.asarray(positions, np.int32)
    pos = jnp.asarray(positions)
    outs = [_dense_layer(capture.layer_queries(layer, positions), capture.k[layer], capture.v[layer], pos)
            for layer in range(capture.q.shape[0])]
    return References(positions=positions, outputs=jnp.stack(outs))


def mean_attention_error(score_fn: ScoreFn, capture: Capture, k_sel: int, **kwargs) -> tuple[float, float]:
    """The paper's fidelity number (mean relative L2 error over positions, layers and heads) and the
    mean bits per token read."""
    errors, bits = attention_errors(score_fn, capture, k_sel, **kwargs)
    return float(np.mean(errors)), float(np.mean(bits))
