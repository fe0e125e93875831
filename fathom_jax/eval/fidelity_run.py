"""How :func:`~fathom_jax.eval.fidelity.attention_errors_many` runs: two compiled programs per (evaluation,
layer), the compile cache they come from, and the runner that schedules them on worker threads.

Per (evaluation, layer): the method's scores at every position (:mod:`~fathom_jax.eval.prefix_scan` on XLA:
one product against the window's index, built once per layer and shared by the rows that read it), then
the selection and attention, one program for every method (:mod:`~fathom_jax.eval.ranking` on XLA).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax.eval import prefix_scan, ranking
from fathom_jax.eval.scoring import Evaluation, MethodScore, ScoreFn
from fathom_jax.index import build_index, prefix_index, unpack_index
from fathom_jax.index.parts import IndexPart
from fathom_jax.select import attend_rows, gather_rows, select_topk
from pallas_kernels import backend

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


def plan_tasks(evaluations: Sequence[Evaluation], n_layers: int, reuse_blocks: bool):
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


# Compiled programs by (key, argument signature), kept across calls (a sweep calls once per capture, tests
# often), and the one thread that compiles them, in order of request.
_COMPILED: dict[Hashable, Future] = {}
_COMPILED_LOCK = threading.Lock()
_COMPILER = ThreadPoolExecutor(1, thread_name_prefix="fidelity-compile")


def compile_program(key: Hashable, fn, args) -> Future:
    """The compiled ``fn`` for arguments like ``args`` (arrays or shape structs): cached, or compiling."""
    key = (key, _signature(args))
    with _COMPILED_LOCK:
        future = _COMPILED.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = _COMPILED[key] = _COMPILER.submit(lambda: jax.jit(fn).lower(*args).compile())
    return future


def compiles_pending() -> int:
    """Programs requested and not compiled yet (what a run waits for before its first results)."""
    with _COMPILED_LOCK:
        return sum(not future.done() for future in _COMPILED.values())


def cancel_compiles() -> None:
    """Drop the compiles not yet started (e.g. when the run they were for fails before it starts)."""
    with _COMPILED_LOCK:
        for key in [key for key, future in _COMPILED.items() if future.cancel()]:
            del _COMPILED[key]


class Run:
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
                self.compiled[task.index[1]] = compile_program(("index", task.index[1]), _window_index(task.index[1]),
                                                        self._build_args(task))
            if task.program not in self.compiled:
                self.compiled[task.program] = compile_program(task.program, self.programs[task.program],
                                                       self._score_args(task, self._index_shape(task)))
            if self.k_sel not in self.compiled:
                scores = jax.eval_shape(self.programs[task.program], *self._score_args(task, self._index_shape(task)))[0]
                self.compiled[self.k_sel] = compile_program(("errors", self.k_sel), _errors_program(self.k_sel),
                                                     self._errors_args(task, scores))

    def results(self, workers: int):
        self.compile_all()
        pool = ThreadPoolExecutor(workers)
        pending = [pool.submit(self._run_task, task) for task in self.tasks]
        try:
            for done in pending:
                done.result()
        except BaseException:
            # Stop now (Ctrl-C, a failed task): waiting for the running tasks waited for every compile queued
            # before their programs; dropped, those tasks end at once (CancelledError) and the process can exit.
            pool.shutdown(wait=False, cancel_futures=True)
            cancel_compiles()
            raise
        pool.shutdown()
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
