"""The parts a key index is made of, each a small static type that knows its own data.

    RAW, KLT, LOKI   bit-plane stores (:class:`~fathom_jax.store.PlaneStore`) of the keys, or of a calibration
                     rotation of them (Fathom KLT, Loki)
    LANDMARKS        fp16 means of every 8-token block (:class:`Landmarks`)
    QUEST16, QUEST8  fp16 per-channel min and max key of every 16- or 8-token page (:class:`PageBounds`: any page
                     dividing the 64-token block; Quest)
    KEYS             the keys as given (the exact oracle; dense attention)

A method names the parts it reads (:attr:`fathom_jax.methods.ScanMethod.parts`); :func:`fathom_jax.index.build_index`
builds the parts it is given. Every part knows how its data is built, appended to and cut to a prefix (the same
bits whichever way), which of its leaves grow with the context (:meth:`IndexPart.bulk`: what a placement may put
in host memory), its bytes, and how a stacked decode cache ``[L, R, ...]`` holds it (:meth:`IndexPart.empty`,
:meth:`IndexPart.add_token`, :meth:`IndexPart.write_token`, ...). A new kind of index data is one class here and
the method that reads it.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float16, Int, UInt32

from fathom_jax import format as fmt
from fathom_jax import landmarks as landmarks_lib
from fathom_jax import page_bounds as bounds_lib
from fathom_jax import store as store_lib
from fathom_jax.calibrate import Calibration, key_rotation, loki_rotation
from fathom_jax.format import BLOCK_TOKENS, LANDMARK_TOKENS, N_PLANES, QUEST_PAGE_TOKENS, WORDS_PER_BLOCK
from fathom_jax.store import KeyRotation, PlaneStore

# alloc(shape, dtype, bulk) -> a zero array placed where it belongs (fathom_jax.placement.Placement.zeros)
Alloc = Callable[..., Any]
# write(dst, src, start, axis, layer) -> dst with src written at start along axis (in place or functionally)
Write = Callable[..., Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Landmarks:
    """fp16 means of every 8-token block ``[*B, capacity / 8, D]`` and the raw keys (f32) of the partially filled
    last block ``tail [*B, 8, D]`` (zeros elsewhere), from which an append recomputes that block's mean."""

    means: Float16[Array, "*B NL D"]
    tail: Float[Array, "*B 8 D"]

    @property
    def rows(self) -> Float16[Array, "*B NL D"]:
        """One row per block, what a :class:`~fathom_jax.methods.base.BlockRead` scores."""
        return self.means


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
    """fp16 ``[min | max]`` of every channel per ``P``-token page ``bounds [*B, capacity / P, 2 D]`` (Quest) and the
    raw keys (f32) of the partially filled last page ``tail [*B, P, D]`` (zeros elsewhere), from which an append
    recomputes that page's bounds."""

    bounds: Float16[Array, "*B NP 2D"]
    tail: Float[Array, "*B P D"]

    @property
    def rows(self) -> Float16[Array, "*B NP 2D"]:
        """One row per page, what a :class:`~fathom_jax.methods.base.BlockRead` scores."""
        return self.bounds


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlaneBlock:
    """A plane store's newest 64-token block after a decode step adds its token: plane ``words [R, D, 4, 2]``, fp16
    ``scale [R, D]`` and the block's raw keys ``tail [R, 64, D]`` (in the store's basis)."""

    words: UInt32[Array, "R D 4 2"]
    scale: Float16[Array, "R D"]
    tail: Float[Array, "R 64 D"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LandmarkBlock:
    """The landmarks' newest 8-token block after a decode step adds its token: its fp16 ``mean [R, D]`` and raw
    ``tail [R, 8, D]``."""

    mean: Float16[Array, "R D"]
    tail: Float[Array, "R 8 D"]

    @property
    def row(self) -> Float16[Array, "R D"]:
        return self.mean


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageBlock:
    """Quest's newest page after a decode step adds its token: its fp16 ``bounds [R, 2 D]`` and raw
    ``tail [R, P, D]``."""

    bounds: Float16[Array, "R 2D"]
    tail: Float[Array, "R P D"]

    @property
    def row(self) -> Float16[Array, "R 2D"]:
        return self.bounds


def _small_like(tree, value: bool):
    return jax.tree.map(lambda _: value, tree)


class IndexPart(abc.ABC):
    """One kind of index data. Subclasses are frozen dataclasses (hashable: static ``jit`` arguments)."""

    name: str
    needs_calibration: ClassVar[bool] = False
    writes_per_token: ClassVar[int] = 0  # bulk arrays a decode step writes per layer (in-place write kernels)

    # -- the index of a batch of sequences ``[*B, ...]`` --------------------------------------------------
    @abc.abstractmethod
    def build(self, keys: Float[Array, "*B n D"], calib: Calibration | None, *, capacity: int,
              length: Int[Array, "*B"] | None) -> Any:
        """This part's data for the first ``length`` (None: all ``n``) of ``keys`` in room for ``capacity``."""

    @abc.abstractmethod
    def append(self, data, keys: Float[Array, "*B m D"], length: Int[Array, "*B"]) -> Any:
        """``data`` of sequences of ``length`` tokens with ``keys`` appended (equal to a build of all keys)."""

    @abc.abstractmethod
    def prefix(self, data, keys: Float[Array, "*B n D"], length: Int[Array, "*B"]) -> Any:
        """The data of the first ``length`` tokens, from the data of all the ``keys`` (equal to its build)."""

    @abc.abstractmethod
    def bulk(self, data) -> Any:
        """A tree like ``data`` of bools: which leaves grow with the context."""

    @abc.abstractmethod
    def nbytes(self, *, capacity: int, head_dim: int) -> int:
        """Bytes of the bulk leaves per sequence and KV head."""

    @property
    def kind(self) -> str:
        """What the part's bytes are reported as (plane stores together)."""
        return self.name

    def bulk_bytes(self, *, layers: int, capacity: int, head_dim: int) -> dict[str, int]:
        """Bytes of the bulk leaves of a stacked cache per sequence and KV head, by kind (``*_hbm``: those kept in
        device memory whatever the placement)."""
        return {self.kind: layers * self.nbytes(capacity=capacity, head_dim=head_dim)}

    def unpack(self, data) -> Any:
        """The data as read by readers that scan one window many times (see :func:`fathom_jax.index.unpack_index`)."""
        return data

    def capacity_of(self, data) -> int:
        """The tokens ``data`` has room for (a plane store's own ``capacity`` by default)."""
        return data.capacity

    def head_dim_of(self, data) -> int:
        """The keys' head_dim (a plane store's own ``head_dim`` by default)."""
        return data.head_dim

    # -- a stacked decode cache ``[L, R, ...]`` -------------------------------------------------------------
    def empty(self, alloc: Alloc, length, *, layers: int, groups: int, capacity: int, head_dim: int) -> Any:
        """Zeros for ``layers x groups`` sequences; ``length [L, R]`` is the index's own (shared) length array."""
        raise NotImplementedError(f"index part {self.name!r} has no place in a decode cache")

    def write_layer(self, write: Write, stacked, built, layer, length) -> Any:
        """``stacked`` with layer ``layer`` set to ``built`` (a prefill's data for that layer's groups); ``length
        [L, R]`` is the index's length after it."""
        raise NotImplementedError

    def add_token(self, stacked, layer, position: Int[Array, "R"], key: Float[Array, "R D"]):
        """A decode step's new token at ``layer``: ``(view, block)``, the layer's data with the token in (its bulk
        leaves still the stacked arrays, stale in the newest block until written) and the newest block."""
        raise NotImplementedError

    def write_token(self, write: Write, stacked, block, position, layer, due) -> Any:
        """``stacked`` with the newest blocks (``block`` stacked on layers ``layer ..``) written where ``due``."""
        raise NotImplementedError

    def commit(self, stacked, block, length) -> Any:
        """``stacked`` with every layer's small leaves after a step (``block`` stacked on ``[L]``, ``length [L, R]``)."""
        raise NotImplementedError

    def flush(self, write: Write, stacked, length: Int[Array, "R"]) -> Any:
        """``stacked`` with anything a step keeps back in device memory written out (nothing by default)."""
        return stacked


@dataclasses.dataclass(frozen=True)
class Planes(IndexPart):
    """4-bit codes stored as bit planes: of the keys (``rotation=None``) or of ``(k - mean) @ basis`` for the
    rotation a calibration gives (``rotation(calib)``: Fathom KLT's, Loki's)."""

    name: str
    rotation: Callable[[Calibration], KeyRotation] | None = None

    writes_per_token: ClassVar[int] = 2  # plane words and scales

    @property
    def kind(self) -> str:
        return "planes"

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.rotation is not None

    def build(self, keys, calib, *, capacity, length):
        rotation = None if self.rotation is None else self.rotation(calib)
        return store_lib.build_store(keys, capacity=capacity, length=length, rotation=rotation)

    def append(self, data, keys, length):
        return store_lib.append(data, keys, check=False)

    def prefix(self, data, keys, length):
        return store_lib.truncate(data, keys, length)

    def unpack(self, data):
        return store_lib.unpack_store(data)

    def bulk(self, data):
        mask = _small_like(data, False)
        return dataclasses.replace(mask, planes=True, scales=True)

    def nbytes(self, *, capacity, head_dim):
        return head_dim * (N_PLANES * fmt.plane_words(capacity) * 4 + capacity // BLOCK_TOKENS * 2)

    def empty(self, alloc, length, *, layers, groups, capacity, head_dim):
        small = lambda shape, dtype: alloc(shape, dtype, bulk=False)  # noqa: E731
        d = head_dim
        rotation = None
        if self.rotation is not None:
            rotation = KeyRotation(mean=small((layers, groups, d), jnp.float32),
                                   basis=small((layers, groups, d, d), jnp.float32))
        return PlaneStore(planes=alloc((layers, groups, d, N_PLANES, fmt.plane_words(capacity)), jnp.uint32),
                          scales=alloc((layers, groups, d, capacity // BLOCK_TOKENS), jnp.float16),
                          tail=small((layers, groups, BLOCK_TOKENS, d), jnp.float32), length=length, rotation=rotation)

    def write_layer(self, write, stacked, built, layer, length):
        zero = jnp.zeros(built.length.shape, jnp.int32)
        put = lambda dst, src, axis: write(dst, src[None], zero, axis, layer)  # noqa: E731
        set_small = lambda dst, src: dst.at[layer].set(src.astype(dst.dtype))  # noqa: E731
        rotation = None if stacked.rotation is None else jax.tree.map(set_small, stacked.rotation, built.rotation)
        return PlaneStore(planes=put(stacked.planes, built.planes, 4), scales=put(stacked.scales, built.scales, 3),
                          tail=set_small(stacked.tail, built.tail), length=length, rotation=rotation)

    def add_token(self, stacked, layer, position, key):
        rotation = None if stacked.rotation is None else jax.tree.map(lambda a: a[layer], stacked.rotation)
        rotated = store_lib.rotate_keys(key[:, None, :], rotation)[:, 0]
        words, scale, tail = jax.vmap(store_lib.append_block)(stacked.tail[layer], position, rotated)
        view = PlaneStore(planes=stacked.planes, scales=stacked.scales, tail=tail, length=position + 1,
                          rotation=rotation)
        return view, PlaneBlock(words=words, scale=scale, tail=tail)

    def write_token(self, write, stacked, block, position, layer, due):
        planes, scales = _write_plane_block(write, stacked, block.words, block.scale, position // BLOCK_TOKENS, due,
                                            layer)
        return dataclasses.replace(stacked, planes=planes, scales=scales)

    def commit(self, stacked, block, length):
        return dataclasses.replace(stacked, tail=block.tail, length=length)

    def flush(self, write, stacked, length):
        """Every layer's partial newest block packed from its raw tail and written."""
        count = length % BLOCK_TOKENS
        pack = jax.vmap(jax.vmap(store_lib.pack_block), in_axes=(0, None))  # over layers, then groups
        words, scale = pack(stacked.tail, count)
        planes, scales = _write_plane_block(write, stacked, words, scale, length // BLOCK_TOKENS, count > 0, 0)
        return dataclasses.replace(stacked, planes=planes, scales=scales)


def _write_plane_block(write, store: PlaneStore, words, scale, block, due, layer):
    """``store``'s planes and scales with each group's 64-token block number ``block [R]`` written where ``due``
    (words ``[Ls, R, D, 4, 2]``, scales ``[Ls, R, D]`` for layers ``layer ..``); elsewhere the block index is
    past the end and the writes drop out."""
    block = jnp.where(due, block, store.scales.shape[-1])
    return (write(store.planes, words, block * WORDS_PER_BLOCK, 4, layer),
            write(store.scales, scale[..., None], block, 3, layer))


class BlockRows(IndexPart):
    """An index of one fp16 row per block of ``tokens`` tokens (what a :class:`~fathom_jax.methods.base.BlockRead`
    scores) and the raw keys of the partially filled last block, from which an append recomputes that block's row.
    Subclasses say what a row is: the hooks below, each one call into the module that builds the rows."""

    writes_per_token: ClassVar[int] = 1

    @property
    @abc.abstractmethod
    def tokens(self) -> int:
        """Tokens per block (per row)."""

    @abc.abstractmethod
    def width(self, head_dim: int) -> int:
        """fp16 values per row."""

    @abc.abstractmethod
    def _build_rows(self, padded, length): ...

    @abc.abstractmethod
    def _truncate(self, rows, tail, length): ...

    @abc.abstractmethod
    def _append_one(self, rows, tail, length, key): ...

    @abc.abstractmethod
    def _append_block(self, tail, length, key): ...

    @abc.abstractmethod
    def _data(self, rows, tail): ...

    @abc.abstractmethod
    def _block(self, row, tail): ...

    def build(self, keys, calib, *, capacity, length):
        padded = _padded(keys, capacity).astype(jnp.float32)
        if length is None:
            length = jnp.full(keys.shape[:-2], keys.shape[-2], jnp.int32)
        return self._data(self._build_rows(padded, length), store_lib.block_tail(padded, length, self.tokens))

    def append(self, data, keys, length):
        batch = length.shape
        flat = lambda x: x.reshape(-1, *x.shape[len(batch):])  # noqa: E731
        step = jax.vmap(self._append_one)
        start, new = flat(length), flat(keys.astype(jnp.float32))
        rows, tail = jax.lax.fori_loop(0, keys.shape[-2], lambda i, c: step(c[0], c[1], start + i, new[:, i]),
                                       (flat(data.rows), flat(data.tail)))
        return self._data(rows.reshape(data.rows.shape), tail.reshape(data.tail.shape))

    def prefix(self, data, keys, length):
        tail = store_lib.block_tail(keys.astype(jnp.float32), length, self.tokens)
        return self._data(self._truncate(data.rows, tail, length), tail)

    def bulk(self, data):
        return self._data(True, False)

    def capacity_of(self, data):
        return data.rows.shape[-2] * self.tokens

    def head_dim_of(self, data):
        return data.tail.shape[-1]

    def nbytes(self, *, capacity, head_dim):
        return capacity // self.tokens * self.width(head_dim) * 2

    def empty(self, alloc, length, *, layers, groups, capacity, head_dim):
        return self._data(alloc((layers, groups, capacity // self.tokens, self.width(head_dim)), jnp.float16),
                          alloc((layers, groups, self.tokens, head_dim), jnp.float32, bulk=False))

    def write_layer(self, write, stacked, built, layer, length):
        zero = jnp.zeros(built.rows.shape[:1], jnp.int32)
        rows = write(stacked.rows, built.rows[None], zero, 2, layer)
        return self._data(rows, stacked.tail.at[layer].set(built.tail))

    def add_token(self, stacked, layer, position, key):
        row, tail = jax.vmap(self._append_block)(stacked.tail[layer], position, key)
        return self._data(stacked.rows, tail), self._block(row, tail)

    def write_token(self, write, stacked, block, position, layer, due):
        rows = write(stacked.rows, block.row[:, :, None, :], position // self.tokens, 2, layer)
        return self._data(rows, stacked.tail)

    def commit(self, stacked, block, length):
        return self._data(stacked.rows, block.tail)


@dataclasses.dataclass(frozen=True)
class LandmarkMeans(BlockRows):
    """The fp16 mean key of every 8-token block (:class:`Landmarks`)."""

    name: str = "landmarks"
    tokens: ClassVar[int] = LANDMARK_TOKENS

    def width(self, head_dim):
        return head_dim

    def _build_rows(self, padded, length):
        return landmarks_lib.build(padded, length)

    def _truncate(self, rows, tail, length):
        return landmarks_lib.truncate(rows, tail, length)

    def _append_one(self, rows, tail, length, key):
        return landmarks_lib.append_one(rows, tail, length, key)

    def _append_block(self, tail, length, key):
        return landmarks_lib.append_block(tail, length, key)

    def _data(self, rows, tail):
        return Landmarks(means=rows, tail=tail)

    def _block(self, row, tail):
        return LandmarkBlock(mean=row, tail=tail)


@dataclasses.dataclass(frozen=True)
class PageBounds(BlockRows):
    """Quest's fp16 per-channel min and max key of every ``page``-token page (:class:`Pages`), named
    ``quest<page>``: parts of different page sizes are different parts."""

    page: int = QUEST_PAGE_TOKENS

    def __post_init__(self):
        bounds_lib.check_page(self.page, "PageBounds")

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"quest{self.page}"

    @property
    def tokens(self) -> int:
        return self.page

    def width(self, head_dim):
        return 2 * head_dim

    def _build_rows(self, padded, length):
        return bounds_lib.build(padded, length, self.page)

    def _truncate(self, rows, tail, length):
        return bounds_lib.truncate(rows, tail, length)

    def _append_one(self, rows, tail, length, key):
        return bounds_lib.append_one(rows, tail, length, key)

    def _append_block(self, tail, length, key):
        return bounds_lib.append_page(tail, length, key)

    def _data(self, rows, tail):
        return Pages(bounds=rows, tail=tail)

    def _block(self, row, tail):
        return PageBlock(bounds=row, tail=tail)


@dataclasses.dataclass(frozen=True)
class StoredKeys(IndexPart):
    """The keys as given, padded to the capacity (the exact oracle reads them; a decode cache reads its K/V rows)."""

    name: str = "keys"

    def build(self, keys, calib, *, capacity, length):
        return _padded(keys, capacity)

    def append(self, data, keys, length):
        batch = length.shape
        flat = lambda x: x.reshape(-1, *x.shape[len(batch):])  # noqa: E731
        put = jax.vmap(lambda rows, new, at: jax.lax.dynamic_update_slice(rows, new, (at, 0)))
        return put(flat(data), flat(keys.astype(data.dtype)), flat(length)).reshape(data.shape)

    def prefix(self, data, keys, length):
        return data

    def bulk(self, data):
        return True

    def capacity_of(self, data):
        return data.shape[-2]

    def head_dim_of(self, data):
        return data.shape[-1]

    def nbytes(self, *, capacity, head_dim):
        return capacity * head_dim * 2


def _padded(keys, capacity: int):
    *batch, n, d = keys.shape
    return jnp.zeros((*batch, capacity, d), keys.dtype).at[..., :n, :].set(keys)


RAW = Planes("raw")
KLT = Planes("klt", key_rotation)
LOKI = Planes("loki", loki_rotation)
LANDMARKS = LandmarkMeans()
QUEST16 = PageBounds(16)
QUEST8 = PageBounds(8)
KEYS = StoredKeys()
PARTS: tuple[IndexPart, ...] = (RAW, KLT, LOKI, LANDMARKS, QUEST16, QUEST8, KEYS)


def shares_store(a: IndexPart, b: IndexPart, calib: Calibration | None) -> bool:
    """Whether two plane parts store the same codes for ``calib`` (their rotations are one basis object), so that
    one store serves both (Loki reads the KLT store when the calibration gives it the KLT basis)."""
    if not (isinstance(a, Planes) and isinstance(b, Planes)) or calib is None:
        return False
    if a.rotation is None or b.rotation is None:
        return a.rotation is b.rotation
    ra, rb = a.rotation(calib), b.rotation(calib)
    return ra.mean is rb.mean and ra.basis is rb.basis
