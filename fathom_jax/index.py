"""The key index: what the scans read for a batch of sequences, built at once or appended to.

    index = build_index(keys, calib, [method, ...])     # once per sequence (pytree)
    index = append_index(index, new_keys)               # decode: the same index, bit for bit

Every plane method reads the *same* 4-bit codes with the *same* fp16 64-token block scales (a
:class:`~fathom_jax.store.PlaneStore`); the rotated methods (Fathom KLT, Loki) read the same kind of
store built over rotated keys, and the store remembers its rotation. Which parts an index holds is the
union of the ``parts`` of the methods it serves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from fathom_jax import landmarks as landmarks_lib
from fathom_jax import store as store_lib
from fathom_jax.calibrate import Calibration, key_rotation, loki_rotation
from fathom_jax.format import LANDMARK_TOKENS, round_capacity
from fathom_jax.methods.base import ScanMethod
from fathom_jax.store import PlaneStore, UnpackedStore


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyIndex:
    """What the scans read for one batch of sequences ``[*B]``; parts not needed are None.

    raw: planes of the keys (or their :class:`~fathom_jax.store.UnpackedStore`, see :func:`unpack_index`); klt: planes of ``(k - mu) V``; loki: planes of ``(k - mu) V_loki``;
    landmarks: fp16 block means ``[*B, capacity / 8, D]``; keys: the keys as given ``[*B, capacity, D]``
    (for the exact oracle and dense attention); length: valid tokens ``[*B]``.
    landmark_tail: the raw keys (f32) of the partially filled last 8-token block, zeros elsewhere
    (present with ``landmarks``), from which an append recomputes that block's mean.
    """

    length: Int[Array, "*B"]
    raw: PlaneStore | UnpackedStore | None = None
    klt: PlaneStore | UnpackedStore | None = None
    loki: PlaneStore | UnpackedStore | None = None
    landmarks: Float[Array, "*B NL D"] | None = None
    keys: Float[Array, "*B n D"] | None = None
    landmark_tail: Float[Array, "*B 8 D"] | None = None

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self.length.shape

    @property
    def stores(self) -> tuple[PlaneStore, ...]:
        return tuple(p for p in (self.raw, self.klt, self.loki) if p is not None)

    @property
    def capacity(self) -> int:
        if self.stores:
            return self.stores[0].capacity
        if self.keys is not None:
            return self.keys.shape[-2]
        return self.landmarks.shape[-2] * LANDMARK_TOKENS

    @property
    def head_dim(self) -> int:
        if self.stores:
            return self.stores[0].head_dim
        return (self.keys if self.keys is not None else self.landmarks).shape[-1]


def parts_of(methods: Iterable[ScanMethod]) -> frozenset[str]:
    """The index parts the methods read together."""
    return frozenset().union(*(m.parts for m in methods))


def check_methods(methods, head_dim: int, where: str) -> tuple[ScanMethod, ...]:
    methods = tuple(methods)
    for m in methods:
        if not isinstance(m, ScanMethod):
            raise TypeError(f"{where}: methods must be ScanMethod instances (fathom_jax.methods), got {m!r}")
        m.validate(head_dim)
    return methods


def check_calibration(calib: Calibration | None, batch: tuple[int, ...], d: int, where: str) -> None:
    if calib is None:
        raise ValueError(f"{where}: calib is required for Fathom KLT and Loki (rotated stores)")
    if calib.head_dim != d:
        raise ValueError(f"{where}: calib head_dim {calib.head_dim} does not match keys head_dim {d}")
    if calib.batch_shape != tuple(batch):
        raise ValueError(f"{where}: calib leading axes {calib.batch_shape} do not match keys' {tuple(batch)}")


def build_index(
    keys: Float[Array, "*B n D"],
    calib: Calibration | None,
    methods: Iterable[ScanMethod],
    *,
    capacity: int | None = None,
    length: Int[Array, "*B"] | int | None = None,
    parts: frozenset[str] | None = None,
) -> KeyIndex:
    """Build the parts of a :class:`KeyIndex` that ``methods`` read (post-RoPE keys ``[*B, n, D]``).

    ``calib`` (batch shape ``*B``) is needed only for the rotated stores (Fathom KLT, Loki).
    ``capacity`` rounds up to whole 64-token blocks as in :func:`fathom_jax.store.build_store`.
    ``parts`` overrides the parts to build (e.g. without ``"keys"`` when the K/V cache serves them).
    """
    keys = jnp.asarray(keys)
    if keys.ndim < 2:
        raise ValueError(f"build_index: keys must be [..., n, D], got shape {keys.shape}")
    if not jnp.issubdtype(keys.dtype, jnp.floating):
        raise TypeError(f"build_index: keys must be floating point, got {keys.dtype}")
    methods = check_methods(methods, keys.shape[-1], "build_index")
    needs = parts_of(methods) if parts is None else parts
    *batch, n, d = keys.shape
    if needs & {"klt", "loki"}:
        check_calibration(calib, tuple(batch), d, "build_index")
    capacity = round_capacity(n if capacity is None else capacity)
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
        landmarks = landmarks_lib.build(padded.astype(jnp.float32), length_arr)
        tail = store_lib.block_tail(padded.astype(jnp.float32), length_arr, LANDMARK_TOKENS)
    exact_keys = padded if "keys" in needs else None
    return KeyIndex(
        length=length_arr, raw=raw, klt=klt, loki=loki, landmarks=landmarks, keys=exact_keys, landmark_tail=tail
    )


def unpack_index(index: KeyIndex) -> KeyIndex:
    """The index with its plane stores unpacked (:class:`~fathom_jax.store.UnpackedStore`): for readers
    that scan the same window many times with the ``"xla"`` scan; reads are unchanged, bit for bit."""
    unpack = lambda part: None if part is None else store_lib.unpack_store(part)  # noqa: E731
    klt = unpack(index.klt)
    loki = klt if (index.loki is not None and index.loki is index.klt) else unpack(index.loki)
    return dataclasses.replace(index, raw=unpack(index.raw), klt=klt, loki=loki)


def prefix_index(index: KeyIndex, keys: Float[Array, "*B n D"], length: Int[Array, "*B"] | int) -> KeyIndex:
    """The index of the first ``length`` tokens of each sequence, from the index of all the ``keys``.

    ``index`` is ``build_index(keys, ...)`` (any length at least ``length``); the result equals
    ``build_index(keys, ..., length=length)`` with the same capacity, bit for bit, at the cost of one
    block per part: the complete blocks are shared, the block holding token ``length - 1`` is
    requantized (plane stores) or re-averaged (landmarks), later blocks are emptied. The fidelity protocol
    scores every decode position against the index a decode loop holds there; this gives it without
    rebuilding the window.
    """
    if not isinstance(index, KeyIndex):
        raise TypeError(f"prefix_index: index must be a KeyIndex (from build_index), got {type(index).__name__}")
    keys = jnp.asarray(keys)
    length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), index.batch_shape)
    cut = lambda part: None if part is None else store_lib.truncate(part, keys, length)  # noqa: E731
    raw, klt = cut(index.raw), cut(index.klt)
    loki = klt if (index.loki is not None and index.loki is index.klt) else cut(index.loki)
    landmarks = tail = None
    if index.landmarks is not None:
        tail = store_lib.block_tail(keys.astype(jnp.float32), length, LANDMARK_TOKENS)
        landmarks = landmarks_lib.truncate(index.landmarks, tail, length)
    return KeyIndex(length=length, raw=raw, klt=klt, loki=loki, landmarks=landmarks, keys=index.keys,
                    landmark_tail=tail)


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
        step = jax.vmap(landmarks_lib.append_one)
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
