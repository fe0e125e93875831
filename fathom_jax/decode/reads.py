"""How a decode step reads the key index of a stacked cache: one strategy object per way, chosen once.

* :class:`DeviceRead`: the index is in device memory (HBM); the ``"xla"`` reference dequantizes the layer's planes,
  ``"triton"`` runs the plane scan on the stacked store in place.
* :class:`StagedRead`: the index is in host memory; the run gather copies the planned runs (the first ``t_j`` planes
  of every active channel) to HBM at the link rate, then the plane scan reads HBM. A staged transfer can be chained
  after another (``after``): the pipelined step orders each chunk's transfer after the previous chunk's.
* :class:`DirectRead`: the plane scan reads the planes in place as it computes: in host memory, or in HBM where
  every plane is resident (other bulk arrays are staged from host memory).
* :class:`TieredRead`: the top planes of every channel are resident in HBM and the rest in host memory
  (:mod:`fathom_jax.store.tiered`); the tiered gather stages only the deeper planned planes, over the link, and the
  plane scan reads the resident ones in place beside them (the same codes, bit for bit, as the staged read of the
  store in one tier).

Each reads a :class:`~fathom_jax.methods.base.PlaneRead` of a stacked store ``[L, R, ...]`` at ``layer`` for groups
``group_start ..``, and stages other bulk arrays (landmark means, Quest's page bounds, the oracle's keys) to device
memory (:meth:`IndexRead.stage`); :class:`StepSource` is what a method's read scores in a step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fathom_jax import scan as scan_lib
from fathom_jax import store as store_lib
from fathom_jax.index.plane_stacking import OneTier, TwoTiers
from fathom_jax.methods.base import BlockRead, KeyRead, PlaneRead
from pallas_kernels import backend
from pallas_kernels.operands import ResidentPlanes, RunList, StorePlanes
from pallas_kernels.plane_scan import PlaneScanConfig, plane_scan
from pallas_kernels.row_fetch import StoredRows, row_fetch
from pallas_kernels.run_gather import RunGatherConfig, run_gather
from pallas_kernels.tier_gather import tier_gather


def index_read(stack: OneTier | TwoTiers, *, offloaded: bool, implementation: backend.Implementation,
               mode: str = "staged", programs: int = 0, scan: PlaneScanConfig | None = None) -> "IndexRead":
    """The read of a cache whose planes are stacked as ``stack`` (:mod:`fathom_jax.index.plane_stacking`): the one
    place a stacking picks its read. ``mode`` (``"staged"`` or ``"direct"``) says how planes that only host memory
    holds are read; ``programs`` is the gathers' persistent programs (0: one per copied chunk of a run)."""
    if implementation == "xla" or not offloaded:  # XLA reads device memory only
        return DeviceRead(implementation, scan=scan)
    if isinstance(stack, TwoTiers):  # the read mode is about host-only planes: resident ones are read in place
        return TieredRead(implementation, programs, scan=scan)
    if stack.in_hbm:
        return DirectRead(implementation, scan=scan, planes_in_hbm=True)
    if mode == "staged":
        return StagedRead(implementation, programs, scan=scan)
    return DirectRead(implementation, scan=scan)


@dataclasses.dataclass(frozen=True)
class IndexRead:
    """The base of the read strategies: ``implementation`` runs the kernels (``"triton"``) or the reference; ``scan``
    configures the plane scan (None: its default)."""

    implementation: backend.Implementation = "xla"
    scan: PlaneScanConfig | None = dataclasses.field(default=None, kw_only=True)

    @property
    def stages(self) -> bool:
        """Whether a step's reads copy bytes from host memory to HBM that pipelined chunks can overlap."""
        return False

    def source(self, view, *, group_start: int = 0, after=None) -> "StepSource":
        """The source a read of ``view``'s groups (from ``group_start`` of the stacked cache) scores; ``after``:
        arrays a staged transfer waits for and never reads."""
        return StepSource(self, view, group_start, after)

    def stage(self, x, layer, *, groups: tuple[int, int], columns: tuple[int, int] | None = None):
        """``x[layer]`` for groups ``(start, size)`` (``[Rc, N, F]`` of a stacked ``[L, R, N, F]`` bulk array) in
        device memory; with ``columns=(start, width)`` only those features (the keys of the K/V rows). Without a
        layer ``x`` is one layer's ``[R, N, F]`` in device memory already."""
        if layer is None:
            return _columns(x, columns)
        return self._stage(x, layer, groups, columns)

    def _stage(self, x, layer, groups, columns):
        raise NotImplementedError

    def _plane_operands(self, read, store, length, layer, group_start, after) -> tuple["ScanOperands", object]:
        """What the plane scan of ``read`` reads (:class:`ScanOperands`), and the staged planes a chained transfer
        waits for (None where nothing was staged)."""
        raise NotImplementedError

    def _plane_scores(self, read, store, length, layer, group_start, after):
        operands, staged = self._plane_operands(read, store, length, layer, group_start, after)
        return operands.scores(self), staged


@dataclasses.dataclass(frozen=True)
class DeviceRead(IndexRead):
    """The index and K/V rows in device memory: XLA slices stage, the plane scan reads the stacked store in place.
    The ``"xla"`` reference reads every placement this way (on a CPU every placement is device memory)."""

    def _stage(self, x, layer, groups, columns):
        start, size = groups
        return _columns(x[layer, start:start + size], columns)

    def _plane_scores(self, read, store, length, layer, group_start, after):
        if self.implementation == "xla":
            # The layer's planes channel-major, contracted over channels there: transposing every token's codes per
            # layer and step cost more than the whole read on CPU; the scores equal the token-major read's up to
            # the dot's summation order.
            store = store.layer_store(layer, slice(group_start, group_start + length.shape[0]), length)
            return jnp.einsum("...gd,...dn->...gn", read.queries, store_lib.dequantize_channels(store, read.depths),
                              precision=jax.lax.Precision.HIGHEST), None
        return super()._plane_scores(read, store, length, layer, group_start, after)

    def _plane_operands(self, read, store, length, layer, group_start, after):
        return _in_place(read, store, length, layer, group_start), None


@dataclasses.dataclass(frozen=True)
class _HostRead(IndexRead):
    """Bulk arrays in host memory (or the offloaded layout in device memory where there is none): kernels stage."""

    def _stage(self, x, layer, groups, columns):
        start, size = groups
        n = x.shape[-2]
        index = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (size, n))
        rows, _, _ = row_fetch(StoredRows(x, layer=layer, group_start=start, columns=columns), index,
                               implementation=self.implementation)
        return rows


@dataclasses.dataclass(frozen=True)
class StagedRead(_HostRead):
    """The run gather copies the planned runs to HBM (``programs`` persistent programs; 0: one per copied chunk of
    a run), then the plane scan reads them there."""

    programs: int = 0
    stages = True

    def _plane_operands(self, read, store, length, layer, group_start, after):
        runs = read.runs()
        staged = run_gather(store.planes_at(layer, group_start), runs, after=after,
                            config=RunGatherConfig(programs=self.programs), implementation=self.implementation)
        return _staged(read, staged, runs, length), staged.planes


@dataclasses.dataclass(frozen=True)
class DirectRead(_HostRead):
    """The plane scan reads the planes in place as it computes: in host memory, or (``planes_in_hbm``) in HBM with
    every plane resident, where only other bulk arrays and the rows are staged."""

    planes_in_hbm: bool = False

    @property
    def stages(self) -> bool:
        return self.planes_in_hbm

    def _plane_operands(self, read, store, length, layer, group_start, after):
        return _in_place(read, store, length, layer, group_start), None


@dataclasses.dataclass(frozen=True)
class TieredRead(_HostRead):
    """Resident planes read in place in HBM, the deeper planned runs gathered over the link (``programs`` persistent
    programs of the tiered gather; 0: one per copied chunk of a run)."""

    programs: int = 0
    stages = True

    def _plane_operands(self, read, store, length, layer, group_start, after):
        runs = read.runs()
        tiers = store.tiers(jnp.asarray(layer, jnp.int32), group_start)
        staged = tier_gather(tiers, runs, after=after, config=RunGatherConfig(programs=self.programs),
                             implementation=self.implementation)
        return _staged(read, staged, runs, length, ResidentPlanes(tiers, runs.channels)), staged.planes


class StepSource:
    """The :class:`~fathom_jax.methods.base.ReadSource` of a decode step's view (``index``, ``length``, ``layer``, the
    K/V rows ``kv`` at ``kv_layer`` as ``rows`` lays them out): raw scores of every stored position of its groups
    (positions past ``length`` not masked). ``staged`` is what a chained transfer waits for (None where nothing was
    staged). A view without a layer (an unstacked index in device memory) reads like :func:`fathom_jax.scan.execute`.
    """

    def __init__(self, reader: IndexRead, view, group_start: int, after):
        self.reader, self.view, self.group_start, self.after = reader, view, group_start, after
        self.staged = None

    @property
    def _groups(self) -> tuple[int, int]:
        return self.group_start, self.view.length.shape[0]

    def plane_scores(self, read: PlaneRead):
        view = self.view
        if view.layer is None:
            return scan_lib.IndexSource(view.index, view.length, self.reader.implementation,
                                        self.reader.scan).plane_scores(read)
        scores, self.staged = self.reader._plane_scores(read, view.index[read.part], view.length, view.layer,
                                                        self.group_start, self.after)
        return scores

    def block_scores(self, read: BlockRead):
        rows = self.reader.stage(self.view.index[read.part].rows, self.view.layer, groups=self._groups)
        return scan_lib.block_scores(read, rows)

    def key_scores(self, read: KeyRead):
        # The oracle scores the cache's keys, staged from its K/V rows (only their key features where they can be).
        view = self.view
        keys = self.reader.stage(view.kv, view.kv_layer, groups=self._groups, columns=view.rows.key_columns())
        if view.rows.key_columns() is None:
            keys = view.rows.split(keys)[0]
        return scan_lib.dot(read.queries, keys.astype(jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScanOperands:
    """What one plane scan of a step reads: ``queries [Rc, G, C]`` (by run-list slot), the planes (a stacked store
    at its layer, or a staged buffer), the run list, the groups' ``length`` and a staged buffer's resident planes.
    The plane scan writes every score from them (:meth:`scores`)."""

    queries: jax.Array
    store: StorePlanes
    runs: RunList
    length: jax.Array
    resident: ResidentPlanes | None = None

    def scores(self, reader: IndexRead) -> jax.Array:
        return plane_scan(self.queries, self.store, self.length, self.runs, resident=self.resident,
                          implementation=reader.implementation, config=reader.scan)


def _staged(read, staged: StorePlanes, runs, length, resident=None) -> ScanOperands:
    """A staged buffer's scan: slot ``c`` holds channel ``runs.channels[c]``, scored by that query feature."""
    queries = jnp.take_along_axis(read.queries, runs.channels[..., None, :], axis=-1)
    return ScanOperands(queries, staged, runs.slots(), length, resident)


def _in_place(read, store, length, layer, group_start) -> ScanOperands:
    return ScanOperands(read.queries, store.planes_at(layer, group_start), read.runs(), length)


def _columns(x, columns):
    return x if columns is None else x[..., columns[0]:columns[0] + columns[1]]
