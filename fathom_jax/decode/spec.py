"""What a sparse attention is before any array: its static fields, their checks, and the spec strings that name one.

:class:`AttentionSpec` holds every field of :class:`~fathom_jax.decode.SparseAttention` that is static under
``jit`` (declared so in the field metadata, as the scan methods' reads do: :mod:`fathom_jax.methods.base`), checks
them when built and describes what they imply (the label, the index parts a cache holds, the protocol's static
attributes). :class:`~fathom_jax.decode.SparseAttention` adds the traced corpus statistics and the step resolved for
a cache's shape. :func:`parse_spec` turns a method spec (``"fathom_klt:48"``) and options into its fields.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from fathom_jax import methods as methods_lib
from fathom_jax.calibrate import SKIP_TOKENS, Calibration
from fathom_jax.decode.config import StepConfig
from fathom_jax.index.parts import KEYS
from fathom_jax.methods.base import ScanMethod
from fathom_jax.methods.sharing import SharedMethod, SharedSelection, parse_method
from fathom_jax.models.attention import CacheShape
from fathom_jax.placement import Placement
from fathom_jax.rows.formats import RowFormat
from fathom_jax.rows.layout import RowLayout, row_format
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS
from pallas_kernels import backend

CalibrationSource = Literal["corpus", "session"]
SOURCES = ("corpus", "session")


def static(default=dataclasses.MISSING, **kw):
    """A field jax keeps in the treedef (hashed into the compiled program), never traced."""
    return dataclasses.field(default=default, metadata=dict(static=True), **kw)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static fields of a sparse attention, checked.

    ``method``, ``k`` (tokens per query head, sinks and local window included), ``calibration_source``, ``sink``,
    ``local``, ``skip_tokens``, ``implementation`` (None: triton on a GPU, xla elsewhere), ``placement`` (where the
    cache lives), ``step`` (how a step runs) and ``rows`` (how the cache stores K/V rows: None for the model dtype, or
    a row format with per-token scales such as ``"k8v8"``, :mod:`fathom_jax.rows.layout`). The fields after ``k``
    are keyword-only, so that a subclass's own fields (the corpus ``calibration``) may follow ``k`` positionally.
    """

    method: ScanMethod = static()
    k: int = static()
    calibration_source: CalibrationSource = static("corpus", kw_only=True)
    sink: int = static(SINK_TOKENS, kw_only=True)
    local: int = static(LOCAL_TOKENS, kw_only=True)
    skip_tokens: int = static(SKIP_TOKENS, kw_only=True)
    implementation: backend.Implementation | None = static(None, kw_only=True)
    placement: Placement = static(Placement(), kw_only=True)
    step: StepConfig = static(StepConfig(), kw_only=True)
    rows: RowFormat | None = static(None, kw_only=True)
    sharing: SharedSelection | None = static(None, kw_only=True)

    def __post_init__(self):
        # Static fields only: jax rebuilds the subclass from traced (or placeholder) leaves, so arrays are checked
        # against a cache's shape (SparseAttention.check), never here.
        if not isinstance(self.method, ScanMethod):
            raise TypeError(f"SparseAttention: method must be a ScanMethod (fathom_jax.methods), got {self.method!r}")
        for name in ("sink", "local", "skip_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"SparseAttention: {name} must be an int >= 0, got {value!r}")
        floor = max(1, self.sink + self.local)
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < floor:
            raise ValueError(f"SparseAttention: k must be an int >= sink + local = {self.sink} + {self.local} "
                             f"(and >= 1), got {self.k!r}")
        backend.resolve_implementation(self.implementation)
        if not isinstance(self.placement, Placement):
            object.__setattr__(self, "placement", Placement.parse(self.placement))
        object.__setattr__(self, "rows", row_format(self.rows))  # per-token scales; head_dim is checked when bound
        if not isinstance(self.step, StepConfig):
            raise TypeError(f"SparseAttention: step must be a fathom_jax.decode.StepConfig, got {self.step!r}")
        if self.step.row_cache and self.method.selects_all:
            raise ValueError(f"SparseAttention: step row_cache={self.step.row_cache} caches selected rows, "
                             f"and {self.method.label} selects every row (use row_cache=0)")
        if self.sharing is not None:
            self._check_sharing()
        if self.calibration_source not in SOURCES:
            raise ValueError(
                f"SparseAttention: calibration_source must be one of {SOURCES}, got {self.calibration_source!r}")

    def _check_sharing(self) -> None:
        if not isinstance(self.sharing, SharedSelection):
            raise TypeError(f"SparseAttention: sharing must be a fathom_jax.methods.sharing.SharedSelection, got "
                            f"{self.sharing!r}")
        if self.method.selects_all:
            raise ValueError(f"SparseAttention: {self.method.label} attends every token; there is no selection "
                             "to share")
        self.sharing.validate(self.k)
        if self.step.row_cache:
            raise ValueError(f"SparseAttention: a shared selection with step row_cache={self.step.row_cache}: not "
                             "supported (a sharing layer fetches its budget's rows); use row_cache=0")
        if self.placement.mesh is not None:
            raise ValueError("SparseAttention: a shared selection ranks every KV head of a sequence together, and a "
                             "mesh splits them over devices: not supported yet (use one device)")

    # -- description ---------------------------------------------------------------------------
    @property
    def uses_calibration(self) -> bool:
        return self.method.needs_calibration

    @property
    def session(self) -> bool:
        """The statistics are the session's own, computed by the prefill into the cache."""
        return self.uses_calibration and self.calibration_source == "session"

    @property
    def label(self) -> str:
        src = f", {self.calibration_source} calibration" if self.uses_calibration else ""
        where = f", {self.placement.memory}" if self.placement.offloaded else ""
        rows = f", rows {self.rows.spec}" if self.rows is not None else ""
        shared = f", {self.sharing.label}" if self.sharing is not None else ""
        return f"{self.method.label}, k={self.k}{src}{where}{rows}{shared}"

    @property
    def resolved_implementation(self) -> backend.Implementation:
        return self.placement.check(self.implementation)

    @property
    def index_parts(self) -> frozenset:
        return self.method.parts - {KEYS}  # the oracle and dense attention read the cache's K/V rows

    def cache_parts(self, layers: int) -> frozenset:
        """The index parts of a cache of ``layers`` layers, placed: plane stores keep the placement's resident
        planes in device memory (:mod:`fathom_jax.index.plane_stacking`)."""
        resident = self.placement.resident(layers)
        if not any(resident) and not self.placement.warm_planes:
            return self.index_parts
        return frozenset(p.placed(resident, self.placement.warm_planes) for p in self.index_parts)

    def row_layout(self, shape: CacheShape) -> RowLayout:
        """How a cache of ``shape`` stores its K/V rows (checks the format against the head_dim)."""
        return RowLayout.of(self.rows, shape.head_dim, shape.dtype)

    # -- the static attributes of the CacheAttention protocol ------------------------------------
    @property
    def fused(self) -> bool:
        """Whether a whole generation can be one program (the cache in device memory on one device)."""
        return not self.placement.offloaded and self.placement.mesh is None

    @property
    def offloaded(self) -> bool:
        return self.placement.offloaded

    @property
    def min_capacity(self) -> int:
        return self.k

    @property
    def layer_unroll(self) -> int:
        return self.step.layer_unroll

    def check(self, shape: CacheShape) -> None:
        """The static fields against the model and cache (raises ValueError naming the argument)."""
        self.method.validate(shape.head_dim)
        self.row_layout(shape)
        self.placement.check(self.implementation)
        self.placement.check_groups(shape.groups)
        if self.k > shape.capacity:
            raise ValueError(
                f"SparseAttention: k={self.k} is larger than the KV cache capacity {shape.capacity}; "
                f"pass capacity >= {self.k} (generate's default sizes the cache to at least k) or a smaller k")
        if self.sharing is not None:
            self.sharing.validate(self.k, shape.capacity)
            self.sharing.resolve(shape.model_layers or shape.layers, shape.layer_ids or None)


def check_calibration(spec: AttentionSpec, calibration: Calibration | None) -> None:
    """Whether the method's statistics have a source (before any shape is known)."""
    if spec.uses_calibration and spec.calibration_source == "corpus" and calibration is None:
        raise ValueError(
            f"SparseAttention: {spec.method.label} needs calibration statistics: pass calibration= "
            "(a Calibration [n_layers, Hkv] from fathom_jax.calibrate.calibrate) or "
            "calibration_source='session'")


def check_calibration_shape(calibration: Calibration | None, shape: CacheShape) -> None:
    """Corpus statistics against the model: ``[n_layers, Hkv]`` of its head_dim."""
    if calibration is None:
        return
    if not isinstance(calibration, Calibration):
        raise TypeError(f"SparseAttention: calibration must be a Calibration, got {type(calibration).__name__}")
    if calibration.batch_shape != (shape.layers, shape.kv_heads) or calibration.head_dim != shape.head_dim:
        raise ValueError(
            f"SparseAttention: calibration has leading axes {calibration.batch_shape} and head_dim "
            f"{calibration.head_dim}; the model needs [n_layers, Hkv] = {(shape.layers, shape.kv_heads)} and "
            f"head_dim {shape.head_dim}")


def parse_spec(spec: str | ScanMethod, *, k: int, calibration: Calibration | str | None = "session",
               placement: Placement | str | None = None, **fields) -> dict:
    """The fields of the decode attention for a method spec (:func:`fathom_jax.decode.from_spec` documents the
    arguments), as keyword arguments of :class:`~fathom_jax.decode.SparseAttention`."""
    method = parse_method(spec) if isinstance(spec, str) else spec
    if isinstance(method, SharedMethod):
        method, fields["sharing"] = method.method, method.sharing
    method = methods_lib.parse(method)  # a scan method as given; anything else refused, naming the accepted forms
    if fields.get("step", ...) is None:  # None: the default StepConfig
        del fields["step"]
    common = dict(method=method, k=k, placement=Placement.parse(placement), **fields)
    if not method.needs_calibration:
        return common
    if isinstance(calibration, str):
        if calibration != "session":
            raise ValueError(f"calibration must be 'session', a Calibration or None, got {calibration!r}")
        return dict(common, calibration_source="session")
    return dict(common, calibration=calibration)
