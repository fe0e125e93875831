"""The base of every scan method, and what a method asks to read.

A scan method is a small frozen dataclass (hashable: a static ``jit`` argument) under
:class:`ScanMethod`. It says which parts of the key index it reads (:attr:`ScanMethod.parts`), whether it
needs calibration statistics, its label and spec string, its exact bits per token, and - given the
queries of one KV group - *what to read* (:meth:`ScanMethod.read`): a :class:`PlaneRead` (planes of one
store to per-channel depths), a :class:`BlockRead` (one row per block of tokens: the landmark, Quest) or a
:class:`KeyRead`. Executing a read (with the jnp reference or the Pallas kernels, from HBM or from host memory)
is :mod:`fathom_jax.scan`'s job, so a method never touches the index arrays themselves: a new method is one
class in one file.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, ClassVar, Protocol

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.operands import RunList
from pallas_kernels.plane_scan import active_channels

if TYPE_CHECKING:  # pragma: no cover
    from fathom_jax.calibrate import Calibration
    from fathom_jax.index import KeyIndex
    from fathom_jax.index.parts import IndexPart
    from pallas_kernels.backend import Implementation



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlaneRead:
    """Read the planes of ``index.<part>`` to ``depths`` and score them against ``queries``.

    ``scores = queries . k_hat(depths) + shift``; ``max_active`` (static) bounds the channels read
    (the size of a fixed run list), ``bits`` is the exact bits per token of the read.
    """

    queries: Float[Array, "*B G D"]  # in the store's basis
    depths: Int[Array, "*B D"]
    bits: Float[Array, "*B"]
    shift: Float[Array, "*B G"] | None = None
    part: str = dataclasses.field(default="raw", metadata=dict(static=True))
    max_active: int = dataclasses.field(default=0, metadata=dict(static=True))  # 0: D

    def scores(self, source: "ReadSource") -> Float[Array, "*B G n"]:
        scores = source.plane_scores(self)
        return scores if self.shift is None else scores + self.shift[..., None]

    def runs(self) -> RunList:
        """The read as the plane kernels take it: the active channels by decreasing depth, ``max_active`` slots."""
        return active_channels(self.depths, self.max_active or None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockRead:
    """Score every ``block``-token block by ``queries . row``, its one row of ``index.<part>`` (the part's data
    ``rows [*B, n / block, F]``); every token of the block gets its block's score.

    The block landmark reads its fp16 means (``F = D``, the queries as given); Quest reads its pages' fp16
    ``[min | max]`` (``F = 2 D``) with the queries split by sign, ``[min(q, 0) | max(q, 0)]``, which gives
    ``sum_j max(q_j min_j, q_j max_j)``, the page's upper bound on ``q . k``.
    """

    queries: Float[Array, "*B G F"]
    bits: Float[Array, "*B"]
    part: str = dataclasses.field(default="landmarks", metadata=dict(static=True))
    block: int = dataclasses.field(default=8, metadata=dict(static=True))
    depths: ClassVar[None] = None  # no planes read

    def scores(self, source: "ReadSource") -> Float[Array, "*B G n"]:
        return source.block_scores(self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyRead:
    """Exact scores ``queries . k`` from the keys as stored (the oracle); ``dense`` also attends to all."""

    queries: Float[Array, "*B G D"]
    bits: Float[Array, "*B"]
    dense: bool = dataclasses.field(default=False, metadata=dict(static=True))
    depths: ClassVar[None] = None  # no planes read

    def scores(self, source: "ReadSource") -> Float[Array, "*B G n"]:
        return source.key_scores(self)


Read = PlaneRead | BlockRead | KeyRead


class ReadSource(Protocol):
    """Where the data a read scores comes from: an index in device memory (:mod:`fathom_jax.scan`), a decode step's
    stacked cache (:mod:`fathom_jax.decode.reads`), the newest block of a decode step, every prefix of an index
    (:mod:`fathom_jax.eval.prefix_scan`). ``read.scores(source)`` calls the one method for its kind of read, so a
    new kind of read is one method here, implemented by each source."""

    def plane_scores(self, read: PlaneRead) -> Float[Array, "*B G n"]:
        """``read.queries . k_hat(read.depths)`` of every position of the plane store ``read.part`` (no shift)."""

    def block_scores(self, read: BlockRead) -> Float[Array, "*B G n"]:
        """``read.queries . row`` of every block's row of ``read.part``, spread over the block's tokens."""

    def key_scores(self, read: KeyRead) -> Float[Array, "*B G n"]:
        """``read.queries . k`` of every stored key."""


@dataclasses.dataclass(frozen=True)
class ScanMethod(abc.ABC):
    """A key scan: what it reads, what it costs, how it plans its read from the queries.

    Subclasses are frozen dataclasses whose fields are the method's static parameters, and set:

    * ``name``: the spec keyword (``parse("name:param")``) and the ``kind`` recorded in results;
    * ``parts``: the index parts read (:mod:`fathom_jax.index.parts`: ``RAW``, ``KLT``, ``LOKI``, ``LANDMARKS``,
      ``QUEST16``, ``KEYS``; a property where the parameters decide it);
    * ``needs_calibration``: whether :meth:`read` uses a :class:`~fathom_jax.calibrate.Calibration`;
    * ``spec_syntax``: how the spec reads in help texts, e.g. ``"fathom:BUDGET[:exact]"``;
    * ``data_fields``: integer fields that may hold a traced value inside ``jit`` (checked at run time),
      so that one compiled program serves every value (the sweep's Fathom budgets);
    * ``selects_all``: attention over every cached token, no selection (dense).
    """

    name: ClassVar[str]
    parts: ClassVar[frozenset[IndexPart]]
    needs_calibration: ClassVar[bool] = False
    spec_syntax: ClassVar[str]
    summary: ClassVar[str] = ""
    data_fields: ClassVar[tuple[str, ...]] = ()
    selects_all: ClassVar[bool] = False

    # -- description ----------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def label(self) -> str:
        """Human-readable name, e.g. ``"Fathom 48"``, ``"SparQ r=16"``."""

    @property
    def spec(self) -> str:
        """The spec string that :func:`fathom_jax.methods.parse` turns back into this method."""
        return self.name

    @property
    def kind(self) -> str:
        return self.name

    @classmethod
    def from_spec_args(cls, args: list[str], spec: str) -> "ScanMethod":
        """Build from the ``:``-separated arguments of a spec (none by default)."""
        if args:
            raise ValueError(f"bad method spec {spec!r}: {cls.name} takes no parameters (expected {cls.spec_syntax})")
        return cls()

    def validate(self, head_dim: int) -> None:
        """Check the parameters against ``head_dim`` (raises ValueError naming the argument)."""

    def fixed_bits_per_token(self, head_dim: int) -> float | None:
        """Bits per token of a fixed-shape read; None where they depend on the query (Fathom, SparQ union)."""
        return None

    def max_active(self, head_dim: int) -> int:
        """A static bound on the channels one read touches (the run list's length)."""
        return head_dim

    # -- the read -------------------------------------------------------------------------
    @abc.abstractmethod
    def read(
        self,
        q: Float[Array, "*B G D"],
        index: "KeyIndex",
        calib: "Calibration | None",
        *,
        implementation: "Implementation | None" = None,
    ) -> Read:
        """What to read for the queries ``q`` of each KV group (post-RoPE, f32).

        ``implementation`` picks the planning kernels where a method has any (Fathom's water line)."""


def int_param(value, name: str, label: str, *, minimum: int) -> None:
    """Static integer parameters: ints (not bools) no smaller than ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{label}: {name} must be an int >= {minimum}, got {value!r}")


def parse_int(text: str, name: str, spec: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"bad method spec {spec!r}: {name} must be an integer, got {text!r}") from None


def uniform_depths(shape: tuple[int, ...], depth: int) -> Int[Array, "..."]:
    return jnp.full(shape, depth, jnp.int32)


def top_r_mask(score: jax.Array, r: int) -> jax.Array:
    """Boolean mask of the r largest entries along the last axis (ties: lower index first)."""
    _, idx = jax.lax.top_k(score, r)
    return jnp.any(jax.nn.one_hot(idx, score.shape[-1], dtype=jnp.bool_), axis=-2)
