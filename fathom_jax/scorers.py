"""Every key scan behind one interface: approximate scores of all n keys for the G query heads of a KV
group, plus an exact bits-per-token count under the paper's byte convention.

    method = ScanMethod.fathom(48)                        # static, hashable
    index = build_index(keys, calib, [method, ...])       # once per sequence (pytree)
    index = append_index(index, new_keys)                 # decode: the same index, bit for bit
    result = scan_scores(method, q, index, calib)         # jit with method static; vmap over layers

Every method reads the *same* 4-bit codes with the *same* fp16 64-token block scales (a
:class:`~fathom_jax.store.PlaneStore`); the rotated methods read the same kind of store built over
rotated keys. Byte convention (bits per token per KV head per layer): code bits read + 16 bits per 64
tokens for the fp16 scale of every channel read (``store.bits_per_token``). At D = 128 that is 136 for
32 channels at 4 bits, 68 for 16, 288 for the 2-bit thumbnail, 544 for the full 4-bit scan and 256 for
the fp16 8-token landmark; Fathom reports its planes plus the scales of its active channels.
``exact`` and ``dense`` report ``16 D`` (the bf16 keys they read); they return exact scores, and the
difference between them (top-k of the exact scores versus attending to everything) belongs to selection.

Semantics (``q`` post-RoPE, ``[*B, G, D]``; scores approximate ``q . k`` for every method):

* ``fathom``: ``g = sum_h q^2 Var(k)`` (raw-basis calibration variance), depths by the planner
  (bisection or exact), scores ``q . k_hat(depths)``.
* ``fathom_klt``: ``qV``, ``g = sum_h (qV)^2 lambda``, planes of ``(k - mu) V``; scores
  ``qV . khat + q . mu`` (the constant ``q . mu`` is added back so scores stay on the scale of
  ``q . k``; it changes no ranking).
* ``sparq`` (grouped-query rule): ``sum_h |q_j|`` over the group, top-r channels per KV head (ties by
  lower channel index, as ``lax.top_k`` and Appendix A), read at 4 bits by every head.
* ``sparq_union``: each head picks its own top-r of ``|q_j|`` and scores with its own r channels; the
  union of the picks is what is read and what the bits count (as in the authors' ablation).
* ``double_sparsity``: the first c channels of the calibration ``ds_order``, 4 bits.
* ``loki``: the first r coordinates of ``(k - mu) V_loki`` at 4 bits, from a separate rotated store
  (block scales are per channel, so one store of all D coordinates gives every r the same codes as a
  store of r coordinates); scores ``(q V)_{:r} . khat_{:r} + q . mu``.
* ``thumbnail``: every channel at ``depth`` planes (default 2).
* ``landmark`` (ShadowKV-style): the fp16 mean key of each 8-token block; every token of the block gets
  its block's score ``q . landmark``; ``16 D / 8`` bits per token. The mean is over the block's valid
  tokens only (the authors zero-pad a partial last block and divide by 8). Ties inside a block are left
  to the selection (``lax.top_k`` takes lower indices first, the same order as the authors' tiny
  within-block ramp).
* ``full4``: all channels at 4 planes. ``exact`` / ``dense``: ``q . k`` from the keys as given.

Rows ``>= length`` (capacity padding) score ``-inf`` for every method.

Where we follow the authors' prototype (``vivekkalyanarangan30/fathom``, ``scripts/sketch.py``,
``scripts/l4_final_alloc.py``, ``scripts/R_agent.py``; read, not copied): importance from the raw
post-RoPE calibration variance (not from dequantized keys); KLT gains with eigenvalues; SparQ's group
sum of |q| and the union variant's per-head scoring; DS by mean|q| x mean|k|; Loki on the
score-variance-ordered, mean-centred basis; thumbnail as uniform depth; landmark block mean in fp16.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from fathom_jax import planner as planner_lib
from fathom_jax import store as store_lib
from fathom_jax.calibrate import Calibration, key_rotation, loki_rotation
from fathom_jax.store import BLOCK_TOKENS, N_PLANES, SCALE_BITS, PlaneStore

LANDMARK_TOKENS = 8
KEY_BITS = 16  # bf16 keys for exact / dense

KINDS = (
    "fathom",
    "fathom_klt",
    "sparq",
    "sparq_union",
    "double_sparsity",
    "loki",
    "thumbnail",
    "landmark",
    "full4",
    "exact",
    "dense",
)
_NEEDS_BUDGET = ("fathom", "fathom_klt")
_NEEDS_R = ("sparq", "sparq_union", "double_sparsity", "loki")
_PLANNERS = ("bisection", "exact")


@dataclasses.dataclass(frozen=True)
class ScanMethod:
    """A scan method and its static parameters (hashable: pass it as a static argument to ``jit``).

    ``budget``: Fathom's code-bit budget per token (``sum_j t_j <= budget``); ``r``: channels (SparQ,
    Double Sparsity's c, Loki's rank); ``depth``: planes for the thumbnail; ``planner``: ``"bisection"``
    (the paper's) or ``"exact"`` (integer greedy) for Fathom.
    """

    kind: str
    budget: int | None = None
    r: int | None = None
    depth: int | None = None
    planner: str = "bisection"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"ScanMethod: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind in _NEEDS_BUDGET:
            if not isinstance(self.budget, int) or isinstance(self.budget, bool):
                raise ValueError(f"ScanMethod {self.kind!r}: budget must be an int, got {self.budget!r}")
            if self.budget < 0:
                raise ValueError(f"ScanMethod {self.kind!r}: budget must be >= 0 code bits, got {self.budget}")
            if self.planner not in _PLANNERS:
                raise ValueError(f"ScanMethod {self.kind!r}: planner must be one of {_PLANNERS}, got {self.planner!r}")
        elif self.budget is not None:
            raise ValueError(f"ScanMethod {self.kind!r} takes no budget (got {self.budget})")
        if self.kind in _NEEDS_R:
            if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
                raise ValueError(f"ScanMethod {self.kind!r}: r must be an int >= 1, got {self.r!r}")
        elif self.r is not None:
            raise ValueError(f"ScanMethod {self.kind!r} takes no r (got {self.r})")
        if self.kind == "thumbnail":
            if self.depth is None:
                object.__setattr__(self, "depth", 2)
            if not isinstance(self.depth, int) or not 1 <= self.depth <= N_PLANES:
                raise ValueError(f"ScanMethod 'thumbnail': depth must be an int in [1, {N_PLANES}], got {self.depth!r}")
        elif self.depth is not None:
            raise ValueError(f"ScanMethod {self.kind!r} takes no depth (got {self.depth})")

    # -- constructors ------------------------------------------------------------------------
    @classmethod
    def fathom(cls, budget: int, planner: str = "bisection") -> "ScanMethod":
        return cls("fathom", budget=budget, planner=planner)

    @classmethod
    def fathom_klt(cls, budget: int, planner: str = "bisection") -> "ScanMethod":
        return cls("fathom_klt", budget=budget, planner=planner)

    @classmethod
    def sparq(cls, r: int) -> "ScanMethod":
        return cls("sparq", r=r)

    @classmethod
    def sparq_union(cls, r: int) -> "ScanMethod":
        return cls("sparq_union", r=r)

    @classmethod
    def double_sparsity(cls, c: int) -> "ScanMethod":
        return cls("double_sparsity", r=c)

    @classmethod
    def loki(cls, r: int) -> "ScanMethod":
        return cls("loki", r=r)

    @classmethod
    def thumbnail(cls, depth: int = 2) -> "ScanMethod":
        return cls("thumbnail", depth=depth)

    @classmethod
    def landmark(cls) -> "ScanMethod":
        return cls("landmark")

    @classmethod
    def full4(cls) -> "ScanMethod":
        return cls("full4")

    @classmethod
    def exact(cls) -> "ScanMethod":
        return cls("exact")

    @classmethod
    def dense(cls) -> "ScanMethod":
        return cls("dense")

    # -- description -------------------------------------------------------------------------
    @property
    def label(self) -> str:
        k = self.kind
        suffix = "" if self.planner == "bisection" else f" ({self.planner} plan)"
        if k == "fathom":
            return f"Fathom {self.budget}{suffix}"
        if k == "fathom_klt":
            return f"Fathom KLT {self.budget}{suffix}"
        if k == "sparq":
            return f"SparQ r={self.r}"
        if k == "sparq_union":
            return f"SparQ r={self.r} per-head union"
        if k == "double_sparsity":
            return f"Double Sparsity c={self.r}"
        if k == "loki":
            return f"Loki r={self.r}"
        if k == "thumbnail":
            return f"{self.depth}-bit thumbnail"
        return {"landmark": "block landmark", "full4": "full 4-bit scan", "exact": "exact top-k oracle", "dense": "dense"}[k]

    def validate(self, head_dim: int) -> None:
        """Check the parameters against ``head_dim`` (raises ValueError naming the argument)."""
        if self.kind in _NEEDS_BUDGET and self.budget > N_PLANES * head_dim:
            raise ValueError(
                f"{self.label}: budget must lie in [0, {N_PLANES * head_dim}] (4 x D code bits at D = {head_dim}), "
                f"got {self.budget}"
            )
        if self.kind in _NEEDS_R and self.r > head_dim:
            name = "c" if self.kind == "double_sparsity" else "r"
            raise ValueError(f"{self.label}: {name} must be <= D = {head_dim}, got {self.r}")

    def fixed_bits_per_token(self, head_dim: int) -> float | None:
        """Bits per token of a fixed-shape read (None for Fathom, whose bits depend on the query, and
        for the SparQ union, whose bits depend on the heads' overlap)."""
        per_channel = lambda t, c: float(t * c + c * SCALE_BITS / BLOCK_TOKENS)
        k = self.kind
        if k in ("sparq", "double_sparsity", "loki"):
            return per_channel(N_PLANES, self.r)
        if k == "thumbnail":
            return per_channel(self.depth, head_dim)
        if k == "full4":
            return per_channel(N_PLANES, head_dim)
        if k == "landmark":
            return float(KEY_BITS * head_dim / LANDMARK_TOKENS)
        if k in ("exact", "dense"):
            return float(KEY_BITS * head_dim)
        return None

    @property
    def needs(self) -> frozenset[str]:
        """Which parts of a :class:`KeyIndex` this method reads."""
        return frozenset(
            {
                "fathom": {"raw"},
                "fathom_klt": {"klt"},
                "sparq": {"raw"},
                "sparq_union": {"raw"},
                "double_sparsity": {"raw"},
                "loki": {"loki"},
                "thumbnail": {"raw"},
                "landmark": {"landmarks"},
                "full4": {"raw"},
                "exact": {"keys"},
                "dense": {"keys"},
            }[self.kind]
        )


def fathom_budgets(head_dim: int, budgets: Sequence[int] = (40, 48, 64, 80)) -> tuple[int, ...]:
    """The paper's Fathom budgets (stated at D = 128) scaled to ``head_dim``."""
    return tuple(max(1, round(b * head_dim / 128)) for b in budgets)


def paper_methods(head_dim: int, *, budgets: Sequence[int] = (48, 64), klt: bool = True) -> tuple[ScanMethod, ...]:
    """The paper's method set scaled to ``head_dim``: Fathom (and KLT) at the given D=128 budgets,
    Double Sparsity c = D/4, SparQ r = D/8 and D/4, Loki r = D/4 and D/2, the 2-bit thumbnail, the
    8-token landmark, the full 4-bit scan, the exact top-k oracle and dense attention."""
    if head_dim < 8 or head_dim % 8:
        raise ValueError(f"head_dim must be a positive multiple of 8, got {head_dim}")
    scaled = fathom_budgets(head_dim, budgets)
    out = [ScanMethod.fathom(b) for b in scaled]
    if klt:
        out += [ScanMethod.fathom_klt(b) for b in scaled]
    out += [
        ScanMethod.double_sparsity(head_dim // 4),
        ScanMethod.sparq(head_dim // 8),
        ScanMethod.sparq(head_dim // 4),
        ScanMethod.loki(head_dim // 4),
        ScanMethod.loki(head_dim // 2),
        ScanMethod.thumbnail(2),
        ScanMethod.landmark(),
        ScanMethod.full4(),
        ScanMethod.exact(),
        ScanMethod.dense(),
    ]
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# The per-sequence index


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyIndex:
    """What the scans read for one batch of sequences ``[*B]``; parts not needed are None.

    raw: planes of the keys; klt: planes of ``(k - mu) V``; loki: planes of ``(k - mu) V_loki``;
    landmarks: fp16 block means ``[*B, capacity / 8, D]``; keys: the keys as given ``[*B, capacity, D]``
    (for the exact oracle and dense attention); length: valid tokens ``[*B]``.
    landmark_tail: the raw keys (f32) of the partially filled last 8-token block, zeros elsewhere
    (present with ``landmarks``): what :func:`append_index` recomputes that block's mean from, as the
    plane store's ``tail`` does for its 64-token block.
    """

    length: Int[Array, "*B"]
    raw: PlaneStore | None = None
    klt: PlaneStore | None = None
    loki: PlaneStore | None = None
    landmarks: Float[Array, "*B NL D"] | None = None
    keys: Float[Array, "*B n D"] | None = None
    landmark_tail: Float[Array, "*B 8 D"] | None = None

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self.length.shape

    @property
    def capacity(self) -> int:
        for part in (self.raw, self.klt, self.loki):
            if part is not None:
                return part.capacity
        if self.keys is not None:
            return self.keys.shape[-2]
        return self.landmarks.shape[-2] * LANDMARK_TOKENS

    @property
    def head_dim(self) -> int:
        for part in (self.raw, self.klt, self.loki):
            if part is not None:
                return part.head_dim
        return (self.keys if self.keys is not None else self.landmarks).shape[-1]


def _block_mean(blocks: jax.Array, count: jax.Array) -> jax.Array:
    """fp16 mean of ``[..., 8, D]`` blocks (invalid rows zero) over ``count`` valid rows.

    The sum is an explicit left fold so that building at once and appending (one block at a time)
    add in the same order and round the same way.
    """
    total = blocks[..., 0, :]
    for i in range(1, LANDMARK_TOKENS):
        total = total + blocks[..., i, :]
    return (total / jnp.maximum(count, 1.0)[..., None]).astype(jnp.float16)


def _landmarks(keys: jax.Array, length: jax.Array) -> jax.Array:
    """fp16 mean of each 8-token block over its valid tokens, ``[*B, n / 8, D]``."""
    *batch, n, d = keys.shape
    nl = n // LANDMARK_TOKENS
    valid = jnp.arange(n) < length[..., None]
    blocks = jnp.where(valid[..., None], keys, 0.0).reshape(*batch, nl, LANDMARK_TOKENS, d)
    count = jnp.sum(valid.reshape(*batch, nl, LANDMARK_TOKENS), axis=-1).astype(jnp.float32)
    return _block_mean(blocks, count)


def build_index(
    keys: Float[Array, "*B n D"],
    calib: Calibration | None,
    methods: Iterable[ScanMethod],
    *,
    capacity: int | None = None,
    length: Int[Array, "*B"] | int | None = None,
) -> KeyIndex:
    """Build the parts of a :class:`KeyIndex` that ``methods`` read (post-RoPE keys ``[*B, n, D]``).

    ``calib`` (batch shape ``*B``) is needed only for the rotated stores (Fathom KLT, Loki).
    ``capacity`` rounds up to whole 64-token blocks as in :func:`fathom_jax.store.build_store`.
    """
    keys = jnp.asarray(keys)
    if keys.ndim < 2:
        raise ValueError(f"build_index: keys must be [..., n, D], got shape {keys.shape}")
    if not jnp.issubdtype(keys.dtype, jnp.floating):
        raise TypeError(f"build_index: keys must be floating point, got {keys.dtype}")
    methods = tuple(methods)
    for m in methods:
        if not isinstance(m, ScanMethod):
            raise TypeError(f"build_index: methods must be ScanMethod instances, got {m!r}")
        m.validate(keys.shape[-1])
    needs = frozenset().union(*(m.needs for m in methods)) if methods else frozenset()
    *batch, n, d = keys.shape
    if needs & {"klt", "loki"}:
        if calib is None:
            raise ValueError("build_index: calib is required for Fathom KLT and Loki (rotated stores)")
        if calib.head_dim != d:
            raise ValueError(f"build_index: calib head_dim {calib.head_dim} does not match keys head_dim {d}")
        if calib.batch_shape != tuple(batch):
            raise ValueError(f"build_index: calib leading axes {calib.batch_shape} do not match keys' {tuple(batch)}")
    capacity = store_lib.round_capacity(n if capacity is None else capacity)
    if capacity < n:
        raise ValueError(f"build_index: capacity={capacity} is smaller than the {n} keys given")
    if length is None:
        length_arr = jnp.full(batch, n, jnp.int32)
    else:
        length_arr = jnp.broadcast_to(jnp.asarray(length, jnp.int32), batch)

    def store(rotation):
        return store_lib.build_store(keys, capacity=capacity, length=length, rotation=rotation)

    raw = store(None) if "raw" in needs else None
    klt = store(key_rotation(calib)) if "klt" in needs else None
    loki = None
    if "loki" in needs:
        loki = klt if (klt is not None and calib.loki_basis is calib.basis) else store(loki_rotation(calib))
    padded = None
    if needs & {"keys", "landmarks"}:
        padded = jnp.zeros((*batch, capacity, d), keys.dtype).at[..., :n, :].set(keys)
    landmarks = tail = None
    if "landmarks" in needs:
        landmarks = _landmarks(padded.astype(jnp.float32), length_arr)
        tail = store_lib.block_tail(padded.astype(jnp.float32), length_arr, LANDMARK_TOKENS)
    exact_keys = padded if "keys" in needs else None
    return KeyIndex(
        length=length_arr, raw=raw, klt=klt, loki=loki, landmarks=landmarks, keys=exact_keys, landmark_tail=tail
    )


def _append_landmark(landmarks, tail, length, key):
    """Append one key ``[D]`` to one sequence's landmarks ``[NL, D]`` (recompute its 8-token block)."""
    offset = length % LANDMARK_TOKENS
    tail = jnp.where(offset == 0, 0.0, tail).at[offset].set(key)
    mean = _block_mean(tail, (offset + 1).astype(jnp.float32))
    landmarks = jax.lax.dynamic_update_slice(landmarks, mean[None], (length // LANDMARK_TOKENS, 0))
    return landmarks, tail


def append_index(index: KeyIndex, keys: Float[Array, "*B m D"], *, check: bool = True) -> KeyIndex:
    """Append ``m`` keys to every sequence of ``index``, to every part it holds.

    Plane stores (raw, KLT, Loki) requantize their last 64-token block (``store.append``), landmarks
    recompute their last 8-token block mean from ``landmark_tail``, exact keys are written at rows
    ``length ..``. The result equals :func:`build_index` over all the keys, bit for bit. Appending
    past capacity raises (eagerly when lengths are concrete, through a host callback under jit) unless
    ``check=False``, for loops whose bounds were checked before entering them.
    """
    if not isinstance(index, KeyIndex):
        raise TypeError(f"append_index: index must be a KeyIndex (from build_index), got {type(index).__name__}")
    keys = jnp.asarray(keys)
    batch, d = index.batch_shape, index.head_dim
    if keys.ndim != len(batch) + 2 or keys.shape[:-2] != batch or keys.shape[-1] != d:
        raise ValueError(f"append_index: keys must have shape [*batch, m, D] with *batch = {batch}, D = {d}; "
                         f"got {keys.shape}")
    if not jnp.issubdtype(keys.dtype, jnp.floating):
        raise TypeError(f"append_index: keys must be floating point, got {keys.dtype}")
    m, capacity = keys.shape[-2], index.capacity
    if index.keys is not None:
        capacity = min(capacity, index.keys.shape[-2])
    if check:
        store_lib.check_capacity(index.length, m, capacity)

    def store(part):
        return None if part is None else store_lib.append(part, keys, check=False)

    raw, klt = store(index.raw), store(index.klt)
    loki = klt if (index.loki is not None and index.loki is index.klt) else store(index.loki)

    flat = lambda x: x.reshape(-1, *x.shape[len(batch):])  # noqa: E731
    unflat = lambda x: x.reshape(*batch, *x.shape[1:])  # noqa: E731
    length = flat(index.length)
    new_keys = flat(keys.astype(jnp.float32))
    landmarks, tail = index.landmarks, index.landmark_tail
    if landmarks is not None:
        if tail is None:
            raise ValueError("append_index: the index has landmarks but no landmark_tail (build it with build_index)")
        step = jax.vmap(_append_landmark)
        lm, tl = flat(landmarks), flat(tail)
        lm, tl = jax.lax.fori_loop(0, m, lambda i, c: step(c[0], c[1], length + i, new_keys[:, i]), (lm, tl))
        landmarks, tail = unflat(lm), unflat(tl)
    exact = index.keys
    if exact is not None:
        write = jax.vmap(lambda rows, new, at: jax.lax.dynamic_update_slice(rows, new, (at, 0)))
        exact = unflat(write(flat(exact), flat(keys.astype(exact.dtype)), length))
    return KeyIndex(
        length=index.length + m, raw=raw, klt=klt, loki=loki, landmarks=landmarks, keys=exact, landmark_tail=tail
    )


# ----------------------------------------------------------------------------------------------
# Scanning


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScanResult:
    """Approximate scores ``[*B, G, n]`` (f32, ``-inf`` past length) and bits per token ``[*B]``.

    ``depths [*B, D]`` are the planes read per channel (in the scanned store's basis) for the
    plane-store methods (the union for ``sparq_union``); None for landmark, exact and dense.
    """

    scores: Float[Array, "*B G n"]
    bits_per_token: Float[Array, "*B"]
    depths: Int[Array, "*B D"] | None = None


def _dot(q: jax.Array, k: jax.Array) -> jax.Array:
    return jnp.einsum("...gd,...nd->...gn", q, k, precision=jax.lax.Precision.HIGHEST)


def _top_r_mask(score: jax.Array, r: int) -> jax.Array:
    """Boolean mask of the r largest entries along the last axis (ties: lower index first)."""
    _, idx = jax.lax.top_k(score, r)
    return jnp.any(jax.nn.one_hot(idx, score.shape[-1], dtype=jnp.bool_), axis=-2)


def _check_inputs(method: ScanMethod, q, index: KeyIndex, calib: Calibration | None) -> jax.Array:
    if not isinstance(method, ScanMethod):
        raise TypeError(f"scan_scores: method must be a ScanMethod, got {method!r}")
    if not isinstance(index, KeyIndex):
        raise TypeError(f"scan_scores: index must be a KeyIndex (from build_index), got {type(index).__name__}")
    q = jnp.asarray(q)
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"scan_scores: q must be floating point, got dtype {q.dtype}")
    batch = index.batch_shape
    d = index.head_dim
    if q.ndim != len(batch) + 2:
        raise ValueError(
            f"scan_scores: q must be [*B, G, D] with *B = {batch} (rank {len(batch) + 2}), got shape {q.shape}"
        )
    if q.shape[:-2] != batch:
        raise ValueError(f"scan_scores: q leading axes {q.shape[:-2]} do not match the index's {batch}")
    if q.shape[-1] != d:
        raise ValueError(f"scan_scores: q head_dim {q.shape[-1]} does not match the keys' head_dim {d}")
    method.validate(d)
    missing = [part for part in method.needs if getattr(index, part) is None]
    if missing:
        raise ValueError(f"scan_scores: {method.label} needs index parts {missing}; pass it to build_index")
    if method.kind in ("fathom", "fathom_klt", "double_sparsity", "loki"):
        if calib is None:
            raise ValueError(f"scan_scores: {method.label} needs calib")
        if calib.head_dim != d:
            raise ValueError(f"scan_scores: calib head_dim {calib.head_dim} does not match q head_dim {d}")
        if calib.batch_shape != batch:
            raise ValueError(f"scan_scores: calib leading axes {calib.batch_shape} do not match q's {batch}")
    return q.astype(jnp.float32)


def scan_scores(
    method: ScanMethod,
    q: Float[Array, "*B G D"],
    index: KeyIndex,
    calib: Calibration | None = None,
    *,
    implementation: str = "xla",
) -> ScanResult:
    """Approximate scores of every key for the G query heads of each KV group, and the bits read.

    jit with ``method`` (and ``implementation``) static (``jax.jit(scan_scores, static_argnums=0,
    static_argnames="implementation")``); vmap over leading axes of ``q``, ``index`` and ``calib``
    together (e.g. layers). ``implementation="pallas"`` reads the plane stores with the Pallas plane
    scan (``pallas_kernels.plane_scan``: only the planes of the active channels, never a dequantized
    copy); ``"xla"`` dequantizes and multiplies (the reference). Landmark and exact scans are XLA both ways.
    """
    if implementation not in ("xla", "pallas"):
        raise ValueError(f"scan_scores: implementation must be 'xla' or 'pallas', got {implementation!r}")
    q = _check_inputs(method, q, index, calib)

    def read(qs, store, depths):
        """``qs . k_hat(depths)`` for every stored token: the plane-store read of every method."""
        if implementation == "xla":
            return _dot(qs, store_lib.dequantize(store, depths))
        from pallas_kernels.plane_scan import plane_scan_store

        return plane_scan_store(qs, store, depths)

    batch, d = index.batch_shape, index.head_dim
    kind = method.kind
    depths = None

    def const_bits(value: float) -> jax.Array:
        return jnp.full(batch, value, jnp.float32)

    def uniform(depth: int) -> jax.Array:
        return jnp.full((*batch, d), depth, jnp.int32)

    if kind in ("fathom", "fathom_klt"):
        if kind == "fathom":
            qs, store, var, shift = q, index.raw, calib.variance, None
        else:
            qs = store_lib.rotate_queries(q, key_rotation(calib))
            store, var = index.klt, calib.eigenvalues
            shift = jnp.einsum("...gd,...d->...g", q, calib.mean)
        plan = planner_lib.plan(planner_lib.importance(qs, var), method.budget, method=method.planner)
        depths = plan.depths
        scores = read(qs, store, depths)
        if shift is not None:
            scores = scores + shift[..., None]
        bits = plan.bits_per_token
    elif kind in ("sparq", "double_sparsity", "thumbnail", "full4"):
        if kind == "sparq":
            mask = _top_r_mask(jnp.sum(jnp.abs(q), axis=-2), method.r)
            depths = jnp.where(mask, N_PLANES, 0).astype(jnp.int32)
        elif kind == "double_sparsity":
            mask = jnp.any(jax.nn.one_hot(calib.ds_order[..., : method.r], d, dtype=jnp.bool_), axis=-2)
            depths = jnp.where(mask, N_PLANES, 0).astype(jnp.int32)
        else:
            depths = uniform(method.depth if kind == "thumbnail" else N_PLANES)
        scores = read(q, index.raw, depths)
        bits = store_lib.bits_per_token(depths)
    elif kind == "sparq_union":
        head_mask = _top_r_mask(jnp.abs(q), method.r)  # [*B, G, D]
        depths = jnp.where(jnp.any(head_mask, axis=-2), N_PLANES, 0).astype(jnp.int32)
        scores = read(jnp.where(head_mask, q, 0.0), index.raw, depths)
        bits = store_lib.bits_per_token(depths)
    elif kind == "loki":
        qs = store_lib.rotate_queries(q, loki_rotation(calib))
        depths = jnp.broadcast_to(jnp.where(jnp.arange(d) < method.r, N_PLANES, 0).astype(jnp.int32), (*batch, d))
        scores = read(qs, index.loki, depths)
        scores = scores + jnp.einsum("...gd,...d->...g", q, calib.mean)[..., None]
        bits = store_lib.bits_per_token(depths)
    elif kind == "landmark":
        block_scores = _dot(q, index.landmarks.astype(jnp.float32))
        scores = jnp.repeat(block_scores, LANDMARK_TOKENS, axis=-1)
        bits = const_bits(method.fixed_bits_per_token(d))
    else:  # exact, dense
        scores = _dot(q, index.keys.astype(jnp.float32))
        bits = const_bits(method.fixed_bits_per_token(d))

    valid = jnp.arange(scores.shape[-1]) < index.length[..., None, None]
    scores = jnp.where(valid, scores, -jnp.inf)
    return ScanResult(scores=scores, bits_per_token=bits.astype(jnp.float32), depths=depths)


def scan_all(
    methods: Iterable[ScanMethod], q: Float[Array, "*B G D"], index: KeyIndex, calib: Calibration | None = None
) -> dict[ScanMethod, ScanResult]:
    """``scan_scores`` for several methods (eager convenience; jit ``scan_scores`` for speed)."""
    return {m: scan_scores(m, q, index, calib) for m in methods}
