"""The key index: what the scans read for a batch of sequences, built at once or appended to.

    index = build_index(keys, calib, method.parts)      # once per sequence (pytree)
    index = append_index(index, new_keys)               # decode: the same index, bit for bit
    index["raw"], index.get("landmarks")                # a part's data (None where absent)

An index is a set of typed parts (:mod:`fathom_jax.index.parts`): every plane method reads the *same* 4-bit codes
with the *same* fp16 64-token block scales (a :class:`~fathom_jax.store.PlaneStore`); the rotated methods (Fathom
KLT, Loki) read the same kind of store built over rotated keys, and the store remembers its rotation. Which parts
an index holds is the union of the ``parts`` of the methods it serves (:func:`fathom_jax.methods.parts_of`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from fathom_jax import store as store_lib
from fathom_jax.calibrate import Calibration
from fathom_jax.format import round_capacity
from fathom_jax.index.parts import PARTS, IndexPart, Planes, shares_store


@dataclasses.dataclass(frozen=True)
class KeyIndex:
    """The parts (static: :class:`~fathom_jax.index.parts.IndexPart`) and their data for a batch of sequences
    ``[*B]``, and the valid tokens per sequence ``length [*B]``.

    ``index[name]`` is a part's data (:class:`~fathom_jax.store.PlaneStore`, or its
    :class:`~fathom_jax.store.UnpackedStore` after :func:`unpack_index`; :class:`~fathom_jax.index.parts.Landmarks`;
    :class:`~fathom_jax.index.parts.Pages`; the keys ``[*B, capacity, D]``); ``index.get(name)`` is None where the
    index lacks it.
    """

    length: Int[Array, "*B"]
    parts: tuple[IndexPart, ...] = ()
    data: tuple = ()

    def __post_init__(self):
        if len(self.parts) != len(self.data):
            raise ValueError(f"KeyIndex: {len(self.parts)} parts but {len(self.data)} data entries")

    def __getitem__(self, name: str) -> Any:
        for part, data in zip(self.parts, self.data):
            if part.name == name:
                return data
        raise KeyError(f"the index has no part {name!r} (it holds {[p.name for p in self.parts]})")

    def get(self, name: str) -> Any:
        return self[name] if self.has(name) else None

    def has(self, name: str) -> bool:
        return any(p.name == name for p in self.parts)

    def replace(self, **data) -> "KeyIndex":
        """The index with the named parts' data replaced (``length=`` too)."""
        length = data.pop("length", self.length)
        unknown = set(data) - {p.name for p in self.parts}
        if unknown:
            raise KeyError(f"the index has no parts {sorted(unknown)}")
        return KeyIndex(length, self.parts, tuple(data.get(p.name, d) for p, d in zip(self.parts, self.data)))

    def bulk(self) -> "KeyIndex":
        """A tree like this index of bools: which leaves grow with the context (each part says)."""
        return KeyIndex(False, self.parts, tuple(p.bulk(d) for p, d in zip(self.parts, self.data)))

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return jnp.shape(self.length)

    @property
    def stores(self) -> tuple:
        """The plane stores' data (of the :class:`~fathom_jax.index.parts.Planes` parts)."""
        return tuple(d for p, d in zip(self.parts, self.data) if isinstance(p, Planes))

    @property
    def capacity(self) -> int:
        """The tokens the index has room for (every part has room for as many)."""
        return self.parts[0].capacity_of(self.data[0])

    @property
    def head_dim(self) -> int:
        return self.parts[0].head_dim_of(self.data[0])


jax.tree_util.register_dataclass(KeyIndex, data_fields=["length", "data"], meta_fields=["parts"])


def check_parts(parts: Iterable[IndexPart], where: str) -> tuple[IndexPart, ...]:
    parts = tuple(parts)
    for p in parts:
        if not isinstance(p, IndexPart):
            raise TypeError(f"{where}: parts must be IndexPart instances (fathom_jax.index.parts, or a method's "
                            f".parts), got {p!r}")
    return tuple(sorted(set(parts), key=lambda p: (PARTS.index(p) if p in PARTS else len(PARTS), p.name)))


def check_calibration(calib: Calibration | None, batch: tuple[int, ...], d: int, where: str) -> None:
    if calib is None:
        raise ValueError(f"{where}: calib is required for Fathom KLT and Loki (rotated stores)")
    if calib.head_dim != d:
        raise ValueError(f"{where}: calib head_dim {calib.head_dim} does not match keys head_dim {d}")
    if calib.batch_shape != tuple(batch):
        raise ValueError(f"{where}: calib leading axes {calib.batch_shape} do not match keys' {tuple(batch)}")


def _map_parts(index: KeyIndex, fn) -> tuple:
    """``fn(part, data)`` for every part, once per distinct data object (a store two parts share stays shared)."""
    done: dict[int, Any] = {}
    return tuple(done.setdefault(id(d), fn(p, d)) for p, d in zip(index.parts, index.data))


def build_index(
    keys: Float[Array, "*B n D"],
    calib: Calibration | None,
    parts: Iterable[IndexPart],
    *,
    capacity: int | None = None,
    length: Int[Array, "*B"] | int | None = None,
) -> KeyIndex:
    """Build the given parts of a :class:`KeyIndex` over post-RoPE keys ``[*B, n, D]`` (a method's
    ``method.parts``, or :func:`fathom_jax.methods.parts_of` several methods).

    ``calib`` (batch shape ``*B``) is needed only for the rotated stores (Fathom KLT, Loki).
    ``capacity`` rounds up to whole 64-token blocks as in :func:`fathom_jax.store.build_store`.
    """
    keys = jnp.asarray(keys)
    if keys.ndim < 2:
        raise ValueError(f"build_index: keys must be [..., n, D], got shape {keys.shape}")
    if not jnp.issubdtype(keys.dtype, jnp.floating):
        raise TypeError(f"build_index: keys must be floating point, got {keys.dtype}")
    parts = check_parts(parts, "build_index")
    *batch, n, d = keys.shape
    if any(p.needs_calibration for p in parts):
        check_calibration(calib, tuple(batch), d, "build_index")
    capacity = round_capacity(n if capacity is None else capacity)
    if capacity < n:
        raise ValueError(f"build_index: capacity={capacity} is smaller than the {n} keys given")
    length_arr = jnp.full(batch, n, jnp.int32) if length is None else jnp.broadcast_to(
        jnp.asarray(length, jnp.int32), batch)
    built: list = []
    for i, part in enumerate(parts):
        twin = next((j for j in range(i) if shares_store(parts[j], part, calib)), None)
        given = None if length is None else length_arr  # (a store checks a length it is given)
        built.append(built[twin] if twin is not None else part.build(keys, calib, capacity=capacity, length=given))
    return KeyIndex(length_arr, parts, tuple(built))


def unpack_index(index: KeyIndex) -> KeyIndex:
    """The index with its plane stores unpacked (:class:`~fathom_jax.store.UnpackedStore`): for readers
    that scan the same window many times with the ``"xla"`` scan; reads are unchanged, bit for bit."""
    return KeyIndex(index.length, index.parts, _map_parts(index, lambda p, d: p.unpack(d)))


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
    return KeyIndex(length, index.parts, _map_parts(index, lambda p, d: p.prefix(d, keys, length)))


def append_index(index: KeyIndex, keys: Float[Array, "*B m D"], *, check: bool = True) -> KeyIndex:
    """Append ``m`` keys to every sequence of ``index``, to every part it holds.

    Plane stores (raw, KLT, Loki) requantize their last 64-token block (``store.append``), landmarks
    recompute their last 8-token block mean from their tail, exact keys are written at rows
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
    if check:
        store_lib.check_capacity(index.length, keys.shape[-2], index.capacity)
    data = _map_parts(index, lambda p, d: p.append(d, keys, index.length))
    return KeyIndex(index.length + keys.shape[-2], index.parts, data)
