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
[Hkv]. :func:`method_score_fn` makes one from any :class:`~fathom_jax.methods.ScanMethod`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from fathom_jax.index import build_index
from fathom_jax.methods import ScanMethod
from fathom_jax.scan import scan_scores
from fathom_jax.select import dense_attention, select_topk, sparse_attention

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


def method_score_fn(method: ScanMethod) -> ScoreFn:
    """A score function for ``method``; ``layer_state`` is that layer's Calibration (or None).

    The index is built with ``length = p + 1``, which is exactly the store a decode loop holds at
    position p (building with a length equals appending token by token; see the store tests).
    """

    def score_fn(q, keys, length, calib):
        index = build_index(keys, calib, (method,), length=jnp.broadcast_to(length, keys.shape[:-2]))
        result = scan_scores(method, q, index, calib)
        return result.scores, result.bits_per_token

    return score_fn


def default_positions(num_tokens: int, count: int = 128) -> np.ndarray:
    """The last ``count`` positions of the window (the paper's decode positions)."""
    count = min(count, num_tokens)
    return np.arange(num_tokens - count, num_tokens, dtype=np.int32)


def _layer_errors(score_fn: ScoreFn, k_sel: tuple[int, ...]):
    def one_position(q_p, keys, values, p, layer_state):
        length = p + 1
        scores, bits = score_fn(q_p, keys, length, layer_state)
        lengths = jnp.broadcast_to(length, scores.shape[:1])
        ref = dense_attention(q_p, keys, values, lengths)
        ref_norm = jnp.maximum(jnp.linalg.norm(ref, axis=-1), 1e-30)
        errs = []
        for k in k_sel:  # one scan, every selection size
            idx, mask = select_topk(scores[..., : keys.shape[-2]], lengths, k)
            out = sparse_attention(q_p, keys, values, idx, mask)
            errs.append(jnp.linalg.norm(out - ref, axis=-1) / ref_norm)
        return jnp.stack(errs), jnp.broadcast_to(bits, lengths.shape)

    @jax.jit
    def run(q, keys, values, positions, layer_state):
        # q [P, Hkv, G, D]: positions run sequentially to bound memory at long contexts.
        return jax.lax.map(lambda a: one_position(a[0], keys, values, a[1], layer_state), (q, positions))

    return run


def attention_errors(
    score_fn: ScoreFn | Sequence[ScoreFn],
    capture: Capture,
    k_sel: int | Sequence[int],
    *,
    positions: Int[Array, "P"] | None = None,
    layer_states: Any = None,
    progress: bool = False,
    desc: str = "",
) -> tuple[Float[np.ndarray, "*K L P Hkv G"], Float[np.ndarray, "L P Hkv"]]:
    """Relative L2 error of every (layer, position, head), and the bits per token read at each.

    ``score_fn`` is one function for every layer or a sequence of per-layer functions (per-layer
    budgets). ``k_sel`` is one selection size or several (a leading K axis on the errors: one scan
    serves every k). ``layer_states`` is a pytree with a leading layer axis (sliced per layer) or None.
    """
    n_layers, n_heads, n_tokens, d = capture.q.shape
    n_kv = capture.k.shape[1]
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
    fns = list(score_fn) if isinstance(score_fn, Sequence) else [score_fn] * n_layers
    if len(fns) != n_layers:
        raise ValueError(f"score_fn: got {len(fns)} per-layer functions for {n_layers} layers")
    runs: dict[int, Callable] = {}
    layers = range(n_layers)
    if progress:
        from tqdm.auto import tqdm

        layers = tqdm(layers, desc=desc or "layers", leave=False)
    errors, bits = [], []
    for layer in layers:
        fn = fns[layer]
        run = runs.setdefault(id(fn), _layer_errors(fn, ks))
        q = capture.q[layer][:, positions]  # [H, P, D]
        q = jnp.moveaxis(q.reshape(n_kv, n_heads // n_kv, positions.size, d), 2, 0)  # [P, Hkv, G, D]
        state = None if layer_states is None else jax.tree.map(lambda x: x[layer], layer_states)
        err, b = run(q, capture.k[layer], capture.v[layer], jnp.asarray(positions), state)
        errors.append(np.moveaxis(np.asarray(err), 1, 0))  # [K, P, Hkv, G]
        bits.append(np.asarray(b))
    errors = np.stack(errors, axis=1)  # [K, L, P, Hkv, G]
    return (errors if several else errors[0]), np.stack(bits)


def mean_attention_error(score_fn: ScoreFn, capture: Capture, k_sel: int, **kwargs) -> tuple[float, float]:
    """The paper's fidelity number (mean relative L2 error over positions, layers and heads) and the
    mean bits per token read."""
    errors, bits = attention_errors(score_fn, capture, k_sel, **kwargs)
    return float(np.mean(errors)), float(np.mean(bits))
