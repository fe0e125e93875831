"""What the fidelity study evaluates: a captured window, and score functions of scan methods.

A method enters the study as a *score function* ``score_fn(q, keys, length, layer_state) -> (scores, bits)``:
``q`` [Hkv, G, D] post-RoPE queries of position p grouped by KV head, ``keys`` [Hkv, T, D] the whole
window, ``length = p + 1`` (keys at or past it are the future and must be ignored: a store built with
that length is exactly the decode-time store), ``layer_state`` whatever per-layer pytree the method
needs (calibration slice, budget); it returns scores [Hkv, G, T] and the bits per token it read
[Hkv]. :func:`method_score_fn` makes one from any :class:`~fathom_jax.methods.ScanMethod`
(a :class:`MethodScore`, which the sweep evaluates without rebuilding the window's index per position).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from fathom_jax.index import KeyIndex, build_index
from fathom_jax.methods import ScanMethod
from fathom_jax.scan import scan_scores
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
