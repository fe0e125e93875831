"""Fathom with budgets in bits as read: the scale of every channel opened is paid inside the plan.

``fathom_bits:B`` plans depths within ``B`` bits per token as read (code bits + 1/4 bit per channel read,
the one convention of :mod:`fathom_jax.format`), so it compares with flat ``fathom:B'`` at equal bits
directly; ``fathom_tuned`` reads each (layer, KV head)'s own budget from a tuned calibration. Both plan
with :mod:`fathom_jax.allocation` (the water line, or ``:exact`` the integer optimum), on Eq. 3's error
model or (``:observed``) the errors the store's quantizer leaves on the calibration keys.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from fathom_jax import allocation
from fathom_jax.checks import is_traced
from fathom_jax.index.parts import RAW, IndexPart
from fathom_jax.methods.base import PlaneRead, ScanMethod, int_param, parse_int

IMPORTANCES = ("variance", "observed")


def _options(cls, args: list[str], spec: str) -> dict[str, str]:
    """``[:exact|bisection][:observed|variance]`` in any order, each at most once."""
    out: dict[str, str] = {}
    for arg in args:
        key = "planner" if arg in allocation.PLANNERS else "importance" if arg in IMPORTANCES else None
        if key is None or key in out:
            raise ValueError(f"bad method spec {spec!r}: expected {cls.spec_syntax} (planner one of "
                             f"{allocation.PLANNERS}, error model one of {IMPORTANCES}), got {arg!r}")
        out[key] = arg
    return out


@dataclasses.dataclass(frozen=True)
class FathomBits(ScanMethod):
    """Depths within ``budget`` bits per token as read (code + scale), by the water line with the scale's
    cost in it (``planner="bisection"``) or the exact integer optimum (``"exact"``); error model Eq. 3's
    ``Var(k) 4^-t`` (``importance="variance"``) or the calibration keys' own quantization errors
    (``"observed"``: needs a :class:`~fathom_jax.calibrate.TunedCalibration` with ``plane_error``)."""

    budget: int
    planner: str = "bisection"
    importance: str = "variance"

    name: ClassVar[str] = "fathom_bits"
    parts: ClassVar[frozenset[IndexPart]] = frozenset({RAW})
    needs_calibration: ClassVar[bool] = True
    spec_syntax: ClassVar[str] = "fathom_bits:BITS[:exact][:observed]"
    summary: ClassVar[str] = "Fathom within BITS bits per token as read (code + scale), the scale priced in the plan"

    @property
    def data_fields(self) -> tuple[str, ...]:
        # The exact plan's table is as wide as the budget: a static budget keeps it small (one program each).
        return ("budget",) if self.planner == "bisection" else ()

    def __post_init__(self):
        if not is_traced(self.budget):
            int_param(self.budget, "budget", f"{type(self).__name__} {self.budget!r}", minimum=0)
        if self.planner not in allocation.PLANNERS:
            raise ValueError(f"{type(self).__name__}: planner must be one of {allocation.PLANNERS}, got {self.planner!r}")
        if self.importance not in IMPORTANCES:
            raise ValueError(f"{type(self).__name__}: importance must be one of {IMPORTANCES}, got {self.importance!r}")

    def _suffix(self) -> str:
        opts = [o for o, default in ((self.planner, "bisection"), (self.importance, "variance")) if o != default]
        return f" ({', '.join(opts)})" if opts else ""

    @property
    def label(self) -> str:
        return f"Fathom {self.budget} bits as read{self._suffix()}"

    def _spec_options(self) -> str:
        return "".join(f":{o}" for o, default in ((self.planner, "bisection"), (self.importance, "variance"))
                       if o != default)

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.budget}{self._spec_options()}"

    @classmethod
    def from_spec_args(cls, args, spec):
        if not 1 <= len(args) <= 3:
            raise ValueError(f"bad method spec {spec!r}: expected {cls.spec_syntax}")
        return cls(parse_int(args[0], "budget", spec), **_options(cls, args[1:], spec))

    def validate(self, head_dim: int) -> None:
        if is_traced(self.budget):
            return  # the planner checks it at run time
        top = allocation.max_bits(head_dim)
        if self.budget > top:
            raise ValueError(f"{self.label}: budget must lie in [0, {top:g}] bits per token as read (4.25 x D at "
                             f"D = {head_dim}), got {self.budget}")

    def max_active(self, head_dim: int) -> int:
        if is_traced(self.budget):
            return head_dim
        return max(1, min(head_dim, math.floor(self.budget / allocation.PLANE_COST[0])))

    def errors(self, calib):
        """The per-channel error model ``e_j(t)`` [.., D, 5] this method plans with."""
        if self.importance == "variance":
            return allocation.variance_errors(calib.variance)
        plane_error = getattr(calib, "plane_error", None)
        if plane_error is None:
            raise ValueError(f"{self.label}: the observed error model needs calibration with plane errors "
                             "(fathom_jax.calibrate.tuned(calib, plane_error=allocation.plane_errors(keys)))")
        return plane_error

    def group_budget(self, calib):
        return self.budget

    def read(self, q, index, calib, *, implementation=None):
        table = allocation.error_table(q, self.errors(calib))
        plan = allocation.plan_bits(table, self.group_budget(calib), method=self.planner,
                                    implementation=implementation)
        return PlaneRead(q, plan.depths, plan.bits_per_token, part="raw", max_active=self.max_active(q.shape[-1]))


@dataclasses.dataclass(frozen=True)
class FathomTuned(FathomBits):
    """:class:`FathomBits` at each (layer, KV head)'s own budget in bits as read, from a
    :class:`~fathom_jax.calibrate.TunedCalibration` whose ``budget`` was tuned on a calibration capture
    (:func:`fathom_jax.eval.tuning.tune_budgets`)."""

    budget: int = dataclasses.field(default=0, init=False)
    planner: str = "bisection"
    importance: str = "variance"

    name: ClassVar[str] = "fathom_tuned"
    spec_syntax: ClassVar[str] = "fathom_tuned[:exact][:observed]"
    summary: ClassVar[str] = "fathom_bits at per-(layer, KV head) budgets tuned on the calibration capture"

    @property
    def data_fields(self) -> tuple[str, ...]:
        return ()

    @property
    def label(self) -> str:
        return f"Fathom tuned budgets{self._suffix()}"

    @property
    def spec(self) -> str:
        return f"{self.name}{self._spec_options()}"

    @classmethod
    def from_spec_args(cls, args, spec):
        if len(args) > 2:
            raise ValueError(f"bad method spec {spec!r}: expected {cls.spec_syntax}")
        return cls(**_options(cls, args, spec))

    def validate(self, head_dim: int) -> None:
        pass  # budgets are data of the calibration, checked by the planner

    def max_active(self, head_dim: int) -> int:
        return head_dim

    def group_budget(self, calib):
        budget = getattr(calib, "budget", None)
        if budget is None:
            raise ValueError(f"{self.label}: needs calibration with tuned budgets "
                             "(fathom_jax.eval.tuning.tune_budgets, or fathom_jax.calibrate.tuned(calib, budget=...))")
        return budget


def needs_tuned_calibration(method) -> str | None:
    """What ``method`` reads that only a tuned calibration (:class:`~fathom_jax.calibrate.TunedCalibration`) holds,
    and plain statistics lack: tuned budgets (``fathom_tuned``), the calibration keys' plane errors (``:observed``);
    None for a method that runs on any calibration."""
    if isinstance(method, FathomTuned):
        return "per-(layer, KV head) budgets from a tuned calibration"
    if isinstance(method, FathomBits) and method.importance == "observed":
        return "the calibration keys' plane errors (the observed error model)"
    return None
