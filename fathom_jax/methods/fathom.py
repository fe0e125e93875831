"""Fathom: per-query read depths by reverse water-filling, on raw planes or on the KLT store."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import jax.numpy as jnp

from fathom_jax import planner as planner_lib
from fathom_jax import store as store_lib
from fathom_jax.checks import is_traced
from fathom_jax.format import N_PLANES
from fathom_jax.index.parts import KLT, RAW
from fathom_jax.methods.base import PlaneRead, ScanMethod, int_param, parse_int

Planner = Literal["bisection", "exact"]
PLANNERS: tuple[str, ...] = ("bisection", "exact")


@dataclasses.dataclass(frozen=True)
class Fathom(ScanMethod):
    """``g = sum_h q^2 Var(k)`` (raw-basis calibration variance), depths by the planner, scores ``q . k_hat``.

    ``budget``: code bits per token (``sum_j t_j <= budget``) at the model's own head_dim; inside ``jit`` it
    may be traced (the planner then checks it at run time); ``planner``: ``"bisection"`` (the paper's 30 steps
    on log theta) or ``"exact"`` (integer greedy).
    """

    budget: int
    planner: Planner = "bisection"

    name: ClassVar[str] = "fathom"
    parts: ClassVar[frozenset[str]] = frozenset({RAW})
    needs_calibration: ClassVar[bool] = True
    spec_syntax: ClassVar[str] = "fathom:BUDGET[:exact]"
    summary: ClassVar[str] = "per-query read depths on raw bit planes, BUDGET code bits per token"
    _label: ClassVar[str] = "Fathom"
    data_fields: ClassVar[tuple[str, ...]] = ("budget",)

    def __post_init__(self):
        if not is_traced(self.budget):
            int_param(self.budget, "budget", f"{self._label} {self.budget!r}", minimum=0)
        if self.planner not in PLANNERS:
            raise ValueError(f"{self._label} {self.budget}: planner must be one of {PLANNERS}, got {self.planner!r}")

    @property
    def label(self) -> str:
        suffix = "" if self.planner == "bisection" else f" ({self.planner} plan)"
        return f"{self._label} {self.budget}{suffix}"

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.budget}" + ("" if self.planner == "bisection" else f":{self.planner}")

    @classmethod
    def from_spec_args(cls, args, spec):
        if not 1 <= len(args) <= 2:
            raise ValueError(f"bad method spec {spec!r}: expected {cls.spec_syntax}")
        planner = args[1] if len(args) == 2 else "bisection"
        if planner not in PLANNERS:
            raise ValueError(f"bad method spec {spec!r}: planner must be one of {PLANNERS}, got {planner!r}")
        return cls(parse_int(args[0], "budget", spec), planner)

    def validate(self, head_dim: int) -> None:
        if is_traced(self.budget):
            return  # the planner checks it at run time
        if self.budget > N_PLANES * head_dim:
            raise ValueError(
                f"{self.label}: budget must lie in [0, {N_PLANES * head_dim}] (4 x D code bits at D = {head_dim}), "
                f"got {self.budget}"
            )

    def max_active(self, head_dim: int) -> int:
        if is_traced(self.budget):
            return head_dim
        return max(1, min(head_dim, self.budget))  # every active channel reads at least one plane

    def _plan(self, queries, importance_weights, implementation):
        return planner_lib.plan(planner_lib.importance(queries, importance_weights), self.budget, method=self.planner,
                                implementation=implementation)

    def read(self, q, index, calib, *, implementation=None):
        plan = self._plan(q, calib.variance, implementation)
        return PlaneRead(q, plan.depths, plan.bits_per_token, part="raw", max_active=self.max_active(q.shape[-1]))


@dataclasses.dataclass(frozen=True)
class FathomKLT(Fathom):
    """Fathom on the KLT store: ``qV``, ``g = sum_h (qV)^2 lambda``, planes of ``(k - mu) V``.

    Scores ``qV . k_hat + q . mu``: the constant ``q . mu`` keeps scores on the scale of ``q . k`` (it
    changes no ranking). The rotation is the one the store was built with (``index["klt"].rotation``).
    """

    name: ClassVar[str] = "fathom_klt"
    parts: ClassVar[frozenset[str]] = frozenset({KLT})
    spec_syntax: ClassVar[str] = "fathom_klt:BUDGET[:exact]"
    summary: ClassVar[str] = "Fathom on the calibration KLT basis"
    _label: ClassVar[str] = "Fathom KLT"

    def read(self, q, index, calib, *, implementation=None):
        rotation = index["klt"].rotation
        qs = store_lib.rotate_queries(q, rotation)
        plan = self._plan(qs, calib.eigenvalues, implementation)
        shift = jnp.einsum("...gd,...d->...g", q, rotation.mean)
        return PlaneRead(qs, plan.depths, plan.bits_per_token, shift, part="klt", max_active=self.max_active(q.shape[-1]))
