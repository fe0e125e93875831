"""Scan methods: Fathom and every baseline of the paper, one frozen class each, under one registry.

    from fathom_jax import methods
    m = methods.parse("fathom:48")           # == methods.Fathom(48)
    methods.parse("sparq:16"), methods.Loki(32), methods.Landmark(), methods.parse("quest:16")
    methods.paper_methods(head_dim=64)       # the paper's method set at a model's head_dim
    print(methods.spec_help())               # what parse() accepts (the CLI's --method help)

A method is hashable (pass it as a static ``jit`` argument), knows which index parts it reads, whether
it needs calibration, its label, spec and exact bits per token, and how to plan its read from the
queries (:class:`~fathom_jax.methods.base.ScanMethod`). Adding a method is one class in one file plus
its line in :data:`REGISTRY`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fathom_jax.index.parts import IndexPart

from fathom_jax.methods.base import BlockRead, KeyRead, PlaneRead, Read, ScanMethod
from fathom_jax.methods.double_sparsity import DoubleSparsity
from fathom_jax.methods.exact import Dense, Exact
from fathom_jax.methods.fathom import Fathom, FathomKLT
from fathom_jax.methods.fathom_bits import FathomBits, FathomTuned, needs_tuned_calibration
from fathom_jax.methods.landmark import Landmark
from fathom_jax.methods.loki import Loki
from fathom_jax.methods.quest import Quest
from fathom_jax.methods.sparq import SparQ, SparQUnion
from fathom_jax.methods.uniform import Full4, Thumbnail

REGISTRY: dict[str, type[ScanMethod]] = {
    cls.name: cls
    for cls in (Fathom, FathomKLT, FathomBits, FathomTuned, SparQ, SparQUnion, DoubleSparsity, Loki, Thumbnail,
                Landmark, Quest, Full4, Exact, Dense)
}


def parts_of(methods: Iterable[ScanMethod]) -> frozenset[IndexPart]:
    """The index parts the methods read together (what :func:`fathom_jax.index.build_index` builds for them)."""
    methods = tuple(methods)
    for m in methods:
        if not isinstance(m, ScanMethod):
            raise TypeError(f"methods must be ScanMethod instances (fathom_jax.methods), got {m!r}")
    return frozenset().union(*(m.parts for m in methods))


def spec_help(separator: str = " | ") -> str:
    """Every spec form :func:`parse` accepts."""
    return separator.join(cls.spec_syntax for cls in REGISTRY.values())


def describe() -> list[tuple[str, str]]:
    """(spec syntax, one-line summary) per registered method, for help texts."""
    return [(cls.spec_syntax, cls.summary) for cls in REGISTRY.values()]


def parse(spec: str) -> ScanMethod:
    """A method from ``name[:param][:planner]``: ``fathom:48``, ``fathom:48:exact``, ``fathom_bits:55``,
    ``fathom_bits:55:exact:observed``, ``fathom_tuned``, ``sparq:8``,
    ``loki:16``, ``thumbnail:2``, ``landmark``, ``quest:16`` (``quest``: the Quest paper's 16-token pages),
    ``exact``, ``dense``. Fathom budgets are code bits per
    token at the model's own head_dim (not rescaled from D = 128)."""
    if isinstance(spec, ScanMethod):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"method spec must be a non-empty string ({spec_help()}), got {spec!r}")
    name, *args = spec.strip().lower().split(":")
    if name not in REGISTRY:
        raise ValueError(f"unknown scan method {name!r} in {spec!r}; expected {spec_help()}")
    return REGISTRY[name].from_spec_args(args, spec)


def fathom_budgets(head_dim: int, budgets: Sequence[int] = (40, 48, 64, 80)) -> tuple[int, ...]:
    """The paper's Fathom budgets (stated at D = 128) scaled to ``head_dim``."""
    return tuple(max(1, round(b * head_dim / 128)) for b in budgets)


# The paper's method set besides Fathom, as the paper sizes it (``D/n``: a size relative to the head dim D), and Quest
# (16-token pages as its paper, and 8 as the landmark's blocks), in the order the studies report it; Fathom's budgets
# are code bits at D = 128 (:func:`fathom_budgets`). The one definition: :func:`paper_methods` and the error study's
# rows (``fathom_jax.eval.study``) derive from it.
PAPER_METHODS = ("sparq:D/8", "sparq:D/4", "double_sparsity:D/4", "loki:D/4", "loki:D/2", "thumbnail:2", "landmark",
                 "quest:16", "quest:8", "full4", "exact", "dense")


def at_head_dim(spec: str, head_dim: int) -> str:
    """A :data:`PAPER_METHODS` spec with its ``D/n`` size at ``head_dim`` (``sparq:D/8`` at D = 64: ``sparq:8``)."""
    name, _, size = spec.partition(":D/")
    return f"{name}:{head_dim // int(size)}" if size else spec


def paper_methods(head_dim: int, *, budgets: Sequence[int] = (48, 64), klt: bool = True) -> tuple[ScanMethod, ...]:
    """The paper's method set scaled to ``head_dim``: Fathom (and KLT) at the given D=128 budgets, then
    :data:`PAPER_METHODS`: SparQ r = D/8 and D/4, Double Sparsity c = D/4, Loki r = D/4 and D/2, the 2-bit
    thumbnail, the 8-token landmark, Quest with 16- and 8-token pages, the full 4-bit scan, the exact top-k oracle and
    dense attention."""
    if head_dim < 8 or head_dim % 8:
        raise ValueError(f"head_dim must be a positive multiple of 8, got {head_dim}")
    scaled = fathom_budgets(head_dim, budgets)
    out: list[ScanMethod] = [Fathom(b) for b in scaled]
    if klt:
        out += [FathomKLT(b) for b in scaled]
    return (*out, *(parse(at_head_dim(spec, head_dim)) for spec in PAPER_METHODS))


__all__ = [
    "REGISTRY", "ScanMethod", "PlaneRead", "BlockRead", "KeyRead", "Read",
    "Fathom", "FathomKLT", "FathomBits", "FathomTuned", "SparQ", "SparQUnion", "DoubleSparsity", "Loki", "Thumbnail",
    "Full4", "Landmark", "Quest", "Exact", "Dense", "parse", "parts_of", "spec_help", "describe", "fathom_budgets",
    "paper_methods", "needs_tuned_calibration",
]
