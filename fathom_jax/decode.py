"""Sparse decoding with any scan method, inside the decoder's jit-compiled greedy loop.

    from fathom_jax.decode import SparseAttention, sparse_attention_from_spec
    from fathom_jax.models import generate
    attn = SparseAttention(ScanMethod.fathom(48), k=128, calibration=calib)     # corpus: calib [L, Hkv]
    attn = sparse_attention_from_spec("fathom_klt:48", k=128)                  # session calibration
    ids = generate(model, prompt, 64, attention_fn=attn)                        # one compiled program

`SparseAttention` is a `StatefulAttentionFn` of the decoder (`fathom_jax.models.llama`): after the
dense prefill, `init_state(cache)` builds every layer's :class:`~fathom_jax.scorers.KeyIndex` from
the prefill keys (and, with session calibration, the per-layer statistics of those keys,
`calibrate_session`); it lives in `cache.aux` ([n_layers] leading axis) and rides through the
decode loop. Every decode step, per layer:

1. append the new key (cache slot length - 1) to the index (`append_index`: the plane stores
   requantize their last 64-token block, landmarks their last 8-token mean) - the index equals one
   built from all keys at once, bit for bit;
2. `scan_scores` for the G query heads of each KV head;
3. `select_topk`: per query head 4 sink + 32 local + the top-(k - 36) by approximate score;
4. exact attention over each head's k selected rows of the cache (`select.sparse_attention`).

The exact oracle (`exact` / `dense` scans) reads the cache's own keys, so its index holds no copy of
them. Batched sequences share the cache length (the decoder's convention); each sequence has its own
index (and, with session calibration, its own statistics).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from fathom_jax.calibrate import SKIP_TOKENS, Calibration, calibrate_session
from fathom_jax.scorers import KeyIndex, ScanMethod, append_index, build_index, scan_scores
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS, select_topk, sparse_attention

_CALIBRATED = ("fathom", "fathom_klt", "double_sparsity", "loki")  # scans that read a Calibration
_SOURCES = ("corpus", "session")


def needs_calibration(method: ScanMethod) -> bool:
    """Whether ``method`` reads calibration statistics (Fathom, Fathom KLT, Double Sparsity, Loki)."""
    return method.kind in _CALIBRATED


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Per-layer decode state of :class:`SparseAttention` (stacked on [n_layers] in ``cache.aux``).

    index: the layer's KeyIndex, batch ``[B, Hkv]`` (no ``keys`` part: the exact oracle reads the
    cache); calib: the Calibration the scans use, ``[B, Hkv]`` (the corpus one broadcast over the
    batch, or each sequence's session statistics), None for scans that need none.
    """

    index: KeyIndex
    calib: Calibration | None = None


@dataclasses.dataclass(frozen=True)
class SparseAttention:
    """Top-k sparse decode attention driven by a scan method (a callable pytree, stateful hook).

    Static (part of the compiled program): ``method``, ``k`` (tokens per query head, sinks and
    local window included), ``calibration_source``, ``sink``, ``local``, ``skip_tokens``,
    ``implementation`` (``"xla"``: the jnp reference scan and ``lax.top_k``; ``"pallas"``: the Pallas
    plane scan and top-k kernels, interpreted on CPU).
    Traced: ``calibration``, a corpus :class:`Calibration` with leading axes ``[n_layers, Hkv]``
    (new arrays of the same shapes reuse the compiled program).

    ``calibration_source="corpus"`` scans with ``calibration``; ``"session"`` computes
    ``calibrate_session`` on each sequence's prefill keys, per layer, inside the compiled program
    (``calibration`` must then be None). Scans without statistics (SparQ, thumbnail, landmark,
    full 4-bit, exact) take neither.
    """

    method: ScanMethod
    k: int
    calibration: Calibration | None = None
    calibration_source: str = "corpus"
    sink: int = SINK_TOKENS
    local: int = LOCAL_TOKENS
    skip_tokens: int = SKIP_TOKENS
    implementation: str = "xla"

    def __post_init__(self):
        # Only static fields and `calibration is None` are checked here: jax rebuilds this object
        # from traced (or placeholder) leaves, so array contents are checked in init_state.
        if not isinstance(self.method, ScanMethod):
            raise TypeError(f"SparseAttention: method must be a ScanMethod, got {self.method!r}")
        for name in ("k", "sink", "local", "skip_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SparseAttention: {name} must be an int >= 0, got {value!r}")
        if self.k < 1:
            raise ValueError(f"SparseAttention: k must be >= 1, got {self.k}")
        if self.sink + self.local > self.k:
            raise ValueError(
                f"SparseAttention: sink + local = {self.sink} + {self.local} must not exceed k = {self.k}"
            )
        if self.implementation not in ("xla", "pallas"):
            raise ValueError(f"SparseAttention: implementation must be 'xla' or 'pallas', got {self.implementation!r}")
        if self.calibration_source not in _SOURCES:
            raise ValueError(
                f"SparseAttention: calibration_source must be one of {_SOURCES}, got {self.calibration_source!r}"
            )
        if self.calibration_source == "session" and self.calibration is not None:
            raise ValueError(
                "SparseAttention: session calibration is computed from the prefill; pass calibration=None"
            )
        if self.uses_calibration and self.calibration_source == "corpus" and self.calibration is None:
            raise ValueError(
                f"SparseAttention: {self.method.label} needs calibration statistics: pass calibration= "
                "(a Calibration [n_layers, Hkv] from fathom_jax.calibrate.calibrate) or "
                "calibration_source='session'"
            )

    @property
    def uses_calibration(self) -> bool:
        return needs_calibration(self.method)

    @property
    def _reads_cache_keys(self) -> bool:
        return self.method.needs == frozenset({"keys"})

    @property
    def label(self) -> str:
        src = f", {self.calibration_source} calibration" if self.uses_calibration else ""
        return f"{self.method.label}, k={self.k}{src}"

    # -- the decoder's StatefulAttentionFn protocol -----------------------------------------

    def init_state(self, cache) -> DecodeState:
        """Per-layer index (and session calibration) from the prefill cache ``k [L, B, Hkv, C, D]``."""
        n_layers, batch, hkv, capacity, d = cache.k.shape
        self._check(n_layers, hkv, capacity, d)
        keys = cache.k.astype(jnp.float32)
        length = jnp.asarray(cache.length, jnp.int32)
        calib = None
        if self.uses_calibration:
            if self.calibration_source == "session":
                calib = jax.lax.map(
                    lambda kl: calibrate_session(kl, length=length, skip_tokens=self.skip_tokens), keys
                )
            else:
                calib = jax.tree.map(
                    lambda a: jnp.broadcast_to(a[:, None], (n_layers, batch, *a.shape[1:])), self.calibration
                )
        parts = () if self._reads_cache_keys else (self.method,)
        index = jax.lax.map(
            lambda xs: build_index(xs[0], xs[1], parts, capacity=capacity, length=length), (keys, calib)
        )
        return DecodeState(index=index, calib=calib)

    def __call__(
        self,
        q: Float[Array, "B Hkv G D"],
        k: Float[Array, "B Hkv C D"],
        v: Float[Array, "B Hkv C D"],
        length: Int[Array, ""],
        layer: Int[Array, ""],
        state: DecodeState,
    ) -> tuple[Float[Array, "B Hkv G D"], DecodeState]:
        del layer  # the state slice is this layer's already
        index = state.index
        if self._reads_cache_keys:
            index = dataclasses.replace(index, length=index.length + 1)
            scan_index = dataclasses.replace(index, keys=k)
        else:
            new_key = jax.lax.dynamic_slice_in_dim(k, length - 1, 1, axis=-2)  # [B, Hkv, 1, D]
            index = append_index(index, new_key.astype(jnp.float32), check=False)  # decoder checked capacity
            scan_index = index
        scores = scan_scores(
            self.method, q.astype(jnp.float32), scan_index, state.calib, implementation=self.implementation
        ).scores
        idx, mask = select_topk(
            scores, length, self.k, sink=self.sink, local=self.local, implementation=self.implementation
        )
        idx = jnp.where(mask, idx, 0)  # masked slots may point past the cache (store capacity rounds up)
        out = sparse_attention(q, k, v, idx, mask)
        return out, DecodeState(index=index, calib=state.calib)

    def _check(self, n_layers: int, hkv: int, capacity: int, d: int) -> None:
        self.method.validate(d)
        if self.k > capacity:
            raise ValueError(
                f"SparseAttention: k={self.k} is larger than the KV cache capacity {capacity}; "
                "use a larger capacity or a smaller k"
            )
        if self.calibration is not None:
            c = self.calibration
            if not isinstance(c, Calibration):
                raise TypeError(f"SparseAttention: calibration must be a Calibration, got {type(c).__name__}")
            if c.batch_shape != (n_layers, hkv) or c.head_dim != d:
                raise ValueError(
                    f"SparseAttention: calibration has leading axes {c.batch_shape} and head_dim {c.head_dim}; "
                    f"the model needs [n_layers, Hkv] = {(n_layers, hkv)} and head_dim {d}"
                )


jax.tree_util.register_dataclass(
    SparseAttention,
    data_fields=["calibration"],
    meta_fields=["method", "k", "calibration_source", "sink", "local", "skip_tokens", "implementation"],
)


# ----------------------------------------------------------------------------------------------
# Spec strings (the CLI's --method)

_SPEC_PARAM = {  # kind -> (parameter name, required)
    "fathom": ("budget", True),
    "fathom_klt": ("budget", True),
    "sparq": ("r", True),
    "sparq_union": ("r", True),
    "double_sparsity": ("r", True),
    "loki": ("r", True),
    "thumbnail": ("depth", False),
    "landmark": (None, False),
    "full4": (None, False),
    "exact": (None, False),
}
SPEC_HELP = (
    "dense | exact | fathom:BUDGET[:exact] | fathom_klt:BUDGET[:exact] | sparq:R | sparq_union:R | "
    "double_sparsity:C | loki:R | thumbnail[:DEPTH] | landmark | full4"
)


def parse_method(spec: str) -> ScanMethod:
    """A ScanMethod from ``kind[:param][:planner]``, e.g. ``fathom:48``, ``fathom:48:exact``,
    ``sparq:8``, ``loki:16``, ``thumbnail:2``, ``landmark``, ``exact``. Fathom budgets are code
    bits per token at the model's own head_dim (not rescaled from D = 128)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"method spec must be a non-empty string ({SPEC_HELP}), got {spec!r}")
    kind, *args = spec.strip().lower().split(":")
    if kind not in _SPEC_PARAM:
        raise ValueError(f"unknown scan method {kind!r} in {spec!r}; expected {SPEC_HELP}")
    param, required = _SPEC_PARAM[kind]
    planner = None
    if kind in ("fathom", "fathom_klt") and len(args) == 2:
        args, planner = args[:1], args[1]
    if len(args) > (1 if param else 0) or (required and not args):
        raise ValueError(f"bad method spec {spec!r}: expected {SPEC_HELP}")
    kwargs = {}
    if args:
        try:
            kwargs[param] = int(args[0])
        except ValueError:
            raise ValueError(f"bad method spec {spec!r}: {param} must be an integer, got {args[0]!r}") from None
    if planner is not None:
        kwargs["planner"] = planner
    return ScanMethod(kind, **kwargs)


def sparse_attention_from_spec(
    spec: str,
    *,
    k: int,
    calibration: Calibration | str | None = "session",
    sink: int = SINK_TOKENS,
    local: int = LOCAL_TOKENS,
    implementation: str = "xla",
):
    """The decode attention for a method spec (see :func:`parse_method`).

    ``"dense"`` gives the decoder's dense attention (every token); anything else a
    :class:`SparseAttention` selecting ``k`` tokens per query head. ``calibration``: ``"session"``
    (default: statistics of the prompt's own keys), a :class:`Calibration` ``[n_layers, Hkv]`` (corpus),
    or None; it is ignored by scans that read no statistics. ``implementation``: ``"xla"`` or
    ``"pallas"`` (the plane-scan and top-k kernels).
    """
    if isinstance(spec, str) and spec.strip().lower() == "dense":
        from fathom_jax.models.llama import dense_attention

        return dense_attention
    method = parse_method(spec)
    if not needs_calibration(method):
        return SparseAttention(method, k, sink=sink, local=local, implementation=implementation)
    if isinstance(calibration, str):
        if calibration != "session":
            raise ValueError(f"calibration must be 'session', a Calibration or None, got {calibration!r}")
        return SparseAttention(method, k, calibration_source="session", sink=sink, local=local,
                               implementation=implementation)
    return SparseAttention(method, k, calibration=calibration, sink=sink, local=local, implementation=implementation)
