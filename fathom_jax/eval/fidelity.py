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
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from fathom_jax.index import KeyIndex, build_index, prefix_index, unpack_index
from fathom_jax.methods import ScanMethod
from fathom_jax.scan import scan_scores
from fathom_jax.select import dense_attention, select_topk, sparse_attention
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
    block of work). Hashable, so rows with the same method share one compiled program.
    """

    method: ScanMethod

    def index(self, keys, calib, length=None) -> KeyIndex:
        if length is not None:
            length = jnp.broadcast_to(length, keys.shape[:-2])
        return build_index(keys, calib, (self.method,), length=length)

    def scores(self, q, index: KeyIndex, calib):
        result = scan_scores(self.method, q, index, calib)
        return result.scores, result.bits_per_token

    def __call__(self, q, keys, length, calib):
        return self.scores(q, self.index(keys, calib, length), calib)


def method_score_fn(method: ScanMethod) -> MethodScore:
    """The score function of ``method``; ``layer_state`` is that layer's Calibration (or None)."""
    return MethodScore(method)


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


@functools.lru_cache(maxsize=64)
def _layer_errors(score_fn: ScoreFn, k_sel: tuple[int, ...], reuse: bool, batch: int):
    """One compiled program per (score function, k's, path): errors of one layer at every position."""
    k_max = max(k_sel)

    def one_position(q_p, keys, values, p, ref, layer_state, full):
        length = p + 1
        if full is None:  # the definition: rebuild the index for this position
            scores, bits = score_fn(q_p, keys, length, layer_state)
        else:
            scores, bits = score_fn.scores(q_p, prefix_index(full, keys, length), layer_state)
        lengths = jnp.broadcast_to(length, scores.shape[:1])
        ref_norm = jnp.maximum(jnp.linalg.norm(ref, axis=-1), 1e-30)
        # One ranking serves every k: lax.top_k orders by score, ties by lower position, so the top-k of a
        # smaller k is a prefix of the largest one's (the same sets, in the same order).
        # The barrier keeps XLA from recomputing the ranking for every slice of it.
        idx_max, mask_max = jax.lax.optimization_barrier(select_topk(scores[..., : keys.shape[-2]], lengths, k_max))
        errs = []
        for k in k_sel:
            out = sparse_attention(q_p, keys, values, idx_max[..., :k], mask_max[..., :k])
            errs.append(jnp.linalg.norm(out - ref, axis=-1) / ref_norm)
        return jnp.stack(errs), jnp.broadcast_to(bits, lengths.shape)

    @jax.jit
    def run(q, keys, values, positions, refs, layer_state):
        full = None
        if reuse:  # the window's index once; each position cuts it to its own length (one block of work)
            full = score_fn.index(keys, layer_state)
            if backend.resolve_implementation(None) == "xla":
                full = unpack_index(full)  # the xla scan then reads codes without extracting bits each time
        # q [P, Hkv, G, D]: positions run in chunks of `batch` (vmapped) to bound memory at long contexts.
        return jax.lax.map(lambda a: one_position(a[0], keys, values, a[1], a[2], layer_state, full),
                           (q, positions, refs), batch_size=batch)

    return run


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
    batch: int = 1,
    references: Any = None,
) -> tuple[Float[np.ndarray, "*K L P Hkv G"], Float[np.ndarray, "L P Hkv"]]:
    """Relative L2 error of every (layer, position, head), and the bits per token read at each.

    ``score_fn`` is one function for every layer or a sequence of per-layer functions (per-layer
    budgets). ``k_sel`` is one selection size or several (a leading K axis on the errors: one scan
    serves every k). ``layer_states`` is a pytree with a leading layer axis (sliced per layer) or None.

    ``reuse_blocks`` (for :class:`MethodScore` functions) builds each layer's index once and cuts it to
    every position (:func:`~fathom_jax.index.prefix_index`): the same numbers, bit for bit, as rebuilding
    it per position, which ``reuse_blocks=False`` does. ``batch`` > 1 vmaps that many positions together
    (faster where the machine has the width, but vmapped reductions round differently: the numbers then
    differ in the last bits). ``references``: :func:`dense_references` of the same capture and positions,
    to share dense attention between calls. ``progress``: True for a bar over layers, or a tqdm bar to
    advance by one per layer (an overall bar over many calls).
    """
    n_layers, n_heads, n_tokens, d = capture.q.shape
    if positions is None:
        positions = default_positions(n_tokens)
    positions = np.asarray(positions, np.int32)
    if positions.size == 0 or positions.min() < 0 or positions.max() >= n_tokens:
        raise ValueError(f"positions must lie in [0, {n_tokens}), got {positions}")
    several = not isinstance(k_sel, (int, np.integer))
    ks = tuple(int(k) for k in (k_sel if several else (k_sel,)))
    for k in ks:
        if k > n_tokens:
            raise ValueError(f"k={k} is larger than the captured context of {n_tokens} tokens")
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    fns = list(score_fn) if isinstance(score_fn, Sequence) else [score_fn] * n_layers
    if len(fns) != n_layers:
        raise ValueError(f"score_fn: got {len(fns)} per-layer functions for {n_layers} layers")
    if references is None:
        references = dense_references(capture, positions)
    elif references.positions.shape != positions.shape or np.any(references.positions != positions):
        raise ValueError("references were computed at other positions than these")
    bar = None
    if progress is True:
        from tqdm.auto import tqdm

        bar = tqdm(total=n_layers, desc=desc or "layers", leave=False)
    elif progress:
        bar = progress
    pending = []
    for layer in range(n_layers):  # dispatched asynchronously: layers overlap where cores are free
        fn = fns[layer]
        run = _layer_errors(fn, ks, bool(reuse_blocks and isinstance(fn, MethodScore)), batch)
        state = None if layer_states is None else jax.tree.map(lambda x: x[layer], layer_states)
        pending.append(run(_layer_queries(capture, layer, positions), capture.k[layer], capture.v[layer],
                           jnp.asarray(positions), references.outputs[layer], state))
    errors, bits = [], []
    for err, b in pending:
        errors.append(np.moveaxis(np.asarray(err), 1, 0))  # [K, P, Hkv, G]
        bits.append(np.asarray(b))
        if bar is not None:
            bar.update(1)
    if progress is True:
        bar.close()
    errors = np.stack(errors, axis=1)  # [K, L, P, Hkv, G]
    return (errors if several else errors[0]), np.stack(bits)


def _layer_queries(capture: Capture, layer: int, positions: np.ndarray) -> jax.Array:
    """``[P, Hkv, G, D]`` queries of one layer at ``positions``."""
    _, n_heads, _, d = capture.q.shape
    n_kv = capture.k.shape[1]
    q = jnp.asarray(capture.q[layer])[:, positions]  # [H, P, D]
    return jnp.moveaxis(q.reshape(n_kv, n_heads // n_kv, positions.size, d), 2, 0)


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
    outs = [_dense_layer(_layer_queries(capture, layer, positions), capture.k[layer], capture.v[layer], pos)
            for layer in range(capture.q.shape[0])]
    return References(positions=positions, outputs=jnp.stack(outs))


def mean_attention_error(score_fn: ScoreFn, capture: Capture, k_sel: int, **kwargs) -> tuple[float, float]:
    """The paper's fidelity number (mean relative L2 error over positions, layers and heads) and the
    mean bits per token read."""
    errors, bits = attention_errors(score_fn, capture, k_sel, **kwargs)
    return float(np.mean(errors)), float(np.mean(bits))
