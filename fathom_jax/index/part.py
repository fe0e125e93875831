"""The base of every index part: what a kind of index data knows of itself (see :mod:`fathom_jax.index.parts`)."""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar

import jax
from jaxtyping import Array, Float, Int

from fathom_jax.calibrate import Calibration

# alloc(shape, dtype, bulk) -> a zero array placed where it belongs (fathom_jax.placement.Placement.zeros)
Alloc = Callable[..., Any]
# write(dst, src, start, axis, layer) -> (dst with src written at start along axis, tokens): written in place (dst
# itself, and the kernel's completion token in a tuple) or functionally (the new array, no token); the parts' writes
# return their data and the tokens of every write they made, in order (fathom_jax.decode.writes.Writer)
Write = Callable[..., Any]


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
    def placed(self, resident: tuple[int, ...], warm: int = 0) -> "IndexPart":
        """This part in a decode cache whose placement keeps ``resident[l]`` top planes of layer ``l`` and ``warm``
        channel planes per layer and group in device memory (only plane stores have planes to keep)."""
        return self

    def empty(self, alloc: Alloc, length, *, layers: int, groups: int, capacity: int, head_dim: int) -> Any:
        """Zeros for ``layers x groups`` sequences; ``length [L, R]`` is the index's own (shared) length array."""
        raise NotImplementedError(f"index part {self.name!r} has no place in a decode cache")

    def write_layer(self, write: Write, stacked, built, layer, length, *, importance=None) -> tuple[Any, tuple]:
        """``(stacked, tokens)`` with layer ``layer`` set to ``built`` (a prefill's data for that layer's groups);
        ``length [L, R]`` is the index's length after it; ``importance [R, D]``: the prompt's (a plane store's warm
        planes)."""
        raise NotImplementedError

    def add_token(self, stacked, layer, position: Int[Array, "R"], key: Float[Array, "R D"]):
        """A decode step's new token at ``layer``: ``(view, block)``, the layer's data with the token in (its bulk
        leaves still the stacked arrays, stale in the newest block until written) and the newest block."""
        raise NotImplementedError

    def write_token(self, write: Write, stacked, block, position, layer, due) -> tuple[Any, tuple]:
        """``(stacked, tokens)`` with the newest blocks (``block`` stacked on layers ``layer ..``) written where
        ``due``."""
        raise NotImplementedError

    def commit(self, stacked, block, length) -> Any:
        """``stacked`` with every layer's small leaves after a step (``block`` stacked on ``[L]``, ``length [L, R]``)."""
        raise NotImplementedError

    def flush(self, write: Write, stacked, length: Int[Array, "R"]) -> tuple[Any, tuple]:
        """``(stacked, tokens)`` with anything a step keeps back in device memory written out (nothing by
        default)."""
        return stacked, ()
