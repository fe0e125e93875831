"""Attention-output fidelity of a scan method (the paper's section 4 metric).

For each decode position p of a captured window, every layer and every query head: select
sink 4 + local 32 + top-(k - 36) keys among positions ``<= p`` by the method's approximate scores,
attend exactly over that set, and compare with dense attention over all ``p + 1`` keys:
``||o_sel - o_dense|| / ||o_dense||``. The reported number is the mean over positions, layers, heads.

A method enters as a *score function* (:mod:`~fathom_jax.eval.scoring`: :func:`method_score_fn` makes one from
any scan method); :class:`Capture` holds the window's queries, keys and values.

:func:`attention_errors_many` evaluates many methods on one capture, each (method, layer) in two compiled
programs: the method's scores at every position (:mod:`~fathom_jax.eval.prefix_scan` on XLA: one product
against the window's index, built once per layer and shared), then the selection and attention, one program
for every method (:mod:`~fathom_jax.eval.ranking` on XLA); :mod:`~fathom_jax.eval.fidelity_run` runs them. The numbers are those of the definition, a scan
on an index rebuilt at every position (``reuse_blocks=False``), bit for bit: ``tests/eval/test_fidelity.py``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from fathom_jax.eval.fidelity_run import SCORE_CHUNK, Run, cancel_compiles, plan_tasks  # noqa: F401  (re-exported)
from fathom_jax.eval.scoring import Capture, Evaluation, MethodScore, ScoreFn, method_score_fn  # noqa: F401  (re-exported)
from fathom_jax.select import dense_attention


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


def attention_errors(score_fn: ScoreFn | Sequence[ScoreFn], capture: Capture, k_sel: int | Sequence[int], *,
                     layer_states: Any = None, desc: str = "", **options
                     ) -> tuple[Float[np.ndarray, "*K L P Hkv G"], Float[np.ndarray, "L P Hkv"]]:
    """Relative L2 error of every (layer, position, head), and the bits per token read at each.

    ``score_fn`` is one function for every layer or a sequence of per-layer functions (per-layer
    budgets). ``k_sel`` is one selection size or several (a leading K axis on the errors: one scan
    serves every k). ``layer_states`` is a pytree with a leading layer axis (sliced per layer) or None.
    ``options`` are :func:`attention_errors_many`'s (``positions``, ``progress``, ``reuse_blocks``, ``references``);
    ``desc`` names the progress bar.
    """
    several = not isinstance(k_sel, (int, np.integer))
    [(errors, bits)] = attention_errors_many([Evaluation(score_fn, layer_states, desc)], capture,
                                             k_sel if several else (k_sel,), **options)
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
    tasks, programs = plan_tasks(evaluations, n_layers, reuse_blocks)
    bar = progress or None
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(evaluations) * n_layers, desc=evaluations[0].name or "layers", leave=False)
    inputs = (jnp.stack([capture.layer_queries(layer, positions) for layer in range(n_layers)]),
              jnp.asarray(capture.k), jnp.asarray(capture.v), jnp.asarray(positions), references.outputs)
    try:
        return Run(evaluations, inputs, ks, tasks, programs, bar).results(workers or os.cpu_count() or 1)
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
    tasks, programs = plan_tasks(evaluations, n_layers, reuse_blocks)
    Run(evaluations, inputs, ks, tasks, programs).compile_all()


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
