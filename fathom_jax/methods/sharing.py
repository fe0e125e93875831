"""Selection shared across layers (issue 57): a few layers scan and select, the others attend what they chose.

A method spec takes the option as a suffix, options joined by ``@`` (shell-safe: no quoting needed)::

    fathom:48@share=0,2,mid@budget=256               # layers 0, 2 and the middle scanning layer select
    sparq:8@share=every4@budget=512@rank=rank        # every 4th scanning layer, the union ranked by head rank
    fathom:48@share=0,2,mid@budget=1024@attend=topk  # each sharing head attends its own top k of the set

    method, sharing = sharing.parse_spec("fathom:48@share=0,mid@budget=256")
    plan = sharing.plan(model_config)                # or sharing.plan_layers(n_layers, scanning_layers)
    plan.selects, plan.source                        # static per-layer tuples a layer scan can close over

At a *selection layer* every query head scores every token with the method's scan and attends its own sink + local
+ top-(k - 36), as without the option; the selection layer also ranks the union of all its heads' (every KV head's)
choices and cuts it to ``budget`` positions, sink and local window included. Every following non-selection layer,
all its heads, attends exactly those positions and scans nothing: it moves no plane, runs no selection, and fetches
``budget`` rows per KV head. How the union is ranked (``rank=``): ``mass`` (the default: a token's estimated
attention weights summed over the heads, each head's a softmax of the scan's scores), ``weight`` (their largest) or
``rank`` (its best rank in any head's order: every head's first choice, then every head's second, ...). How a
sharing layer's heads attend the set (``attend=``): ``all`` (the default: every head the whole set) or ``topk`` (each
head its own top k of the set by exact score, sink and local window forced as a selection's: the rows it fetches
are the same, it attends what an exact top-k head would where the set holds it). Measured in
``results/share_fidelity_*.md`` (``scripts/share_fidelity.py``).

``share=`` names *model* layer indices and rule words, resolved against the layers that scan (every layer of a
Llama-family model; Gemma 3's global layers only: its sliding-window layers keep their window and neither select nor
share): ``first`` and ``mid`` (the first and the middle scanning layer), ``everyN`` (every N-th scanning layer from the
first), ``all`` (every scanning layer: each attends its own selection, the same bits as without the option). The first
scanning layer must select (nothing earlier could hand it a set). This module reads no arrays: the selection itself is
:mod:`fathom_jax.eval.shared_selection`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import ClassVar, Literal

from fathom_jax.methods.base import ScanMethod

Ranking = Literal["weight", "mass", "rank"]
RANKINGS: tuple[str, ...] = ("weight", "mass", "rank")
Attending = Literal["all", "topk"]
ATTENDING: tuple[str, ...] = ("all", "topk")
# The forced tokens every selection keeps (pallas_kernels.topk's SINK_TOKENS + LOCAL_TOKENS); a shared set holds them
# too, so a budget must leave room past them. Not imported: this module stays free of jax and the kernels.
FORCED_TOKENS = 4 + 32
_EVERY = re.compile(r"every([1-9][0-9]*)$")


@dataclasses.dataclass(frozen=True)
class SharedSelection:
    """Which layers select (``layers``: model layer indices and rule words ``first``, ``mid``, ``everyN``, ``all``),
    how many positions the layers after each attend (``budget``, sink and local window included: the rows fetched per
    KV head at a sharing layer), how the selection layer's union is ranked (``ranking``) and what a sharing layer's
    heads attend of it (``attending``: ``all`` of it, or each head its ``topk`` by exact score). Frozen and hashable:
    a static argument of a compiled step."""

    layers: tuple[int | str, ...]
    budget: int
    # mass errs least in every study (results/share_fidelity_*.md: geometric means 1-4% below weight's, 1-7% below
    # rank's)
    ranking: Ranking = "mass"
    attending: Attending = "all"

    spec_syntax: ClassVar[str] = "METHOD@share=LAYERS@budget=POSITIONS[@rank=mass|weight|rank][@attend=all|topk]"

    def __post_init__(self):
        if isinstance(self.layers, (str, int)) or not isinstance(self.layers, tuple) or not self.layers:
            raise ValueError(f"SharedSelection: layers must be a non-empty tuple of layer indices and rule words "
                             f"(first, mid, everyN, all), got {self.layers!r}")
        for term in self.layers:
            if isinstance(term, bool) or not isinstance(term, (int, str)):
                raise ValueError(f"SharedSelection: layers holds {term!r}; expected layer indices and rule words")
            if isinstance(term, int) and term < 0:
                raise ValueError(f"SharedSelection: layer indices must be >= 0, got {term}")
            if isinstance(term, str) and term not in ("first", "mid", "all") and not _EVERY.match(term):
                raise ValueError(f"SharedSelection: unknown layer rule {term!r}; expected a layer index, 'first', "
                                 "'mid', 'everyN' (N >= 1) or 'all'")
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget <= FORCED_TOKENS:
            raise ValueError(f"SharedSelection: budget must be an int > {FORCED_TOKENS} (positions a sharing layer "
                             f"attends, the {FORCED_TOKENS} sink and local tokens included), got {self.budget!r}")
        if self.ranking not in RANKINGS:
            raise ValueError(f"SharedSelection: ranking must be one of {RANKINGS}, got {self.ranking!r}")
        if self.attending not in ATTENDING:
            raise ValueError(f"SharedSelection: attending must be one of {ATTENDING}, got {self.attending!r}")

    @property
    def spec(self) -> str:
        """The suffix :func:`parse_spec` reads back (after a method spec)."""
        rank = "" if self.ranking == "mass" else f"@rank={self.ranking}"
        attend = "" if self.attending == "all" else f"@attend={self.attending}"
        return f"@share={','.join(map(str, self.layers))}@budget={self.budget}{rank}{attend}"

    @property
    def label(self) -> str:
        notes = ([self.ranking] if self.ranking != "mass" else []) + (["top-k"] if self.attending == "topk" else [])
        return f"shared {','.join(map(str, self.layers))} / {self.budget}" + (f" ({', '.join(notes)})" if notes else "")

    def resolve(self, n_layers: int, scanning_layers: Sequence[int] | None = None) -> tuple[int, ...]:
        """The model layers that select, in increasing order. ``scanning_layers``: the layers that hold the whole
        context (default: all ``n_layers``; Gemma 3: its global layers)."""
        scanning = _scanning(n_layers, scanning_layers)
        chosen: set[int] = set()
        for term in self.layers:
            if term == "all":
                chosen.update(scanning)
            elif term == "first":
                chosen.add(scanning[0])
            elif term == "mid":
                chosen.add(scanning[len(scanning) // 2])
            elif isinstance(term, str):
                chosen.update(scanning[:: int(_EVERY.match(term).group(1))])
            elif term >= n_layers:
                raise ValueError(f"share: layer {term} is out of range: the model has {n_layers} layers "
                                 f"(0-{n_layers - 1})")
            elif term not in scanning:
                raise ValueError(f"share: layer {term} does not scan (a sliding-window layer keeps its window); "
                                 f"selection layers must be among the scanning layers {list(scanning)}")
            else:
                chosen.add(term)
        if scanning[0] not in chosen:
            first = min(chosen)
            before = [s for s in scanning if s < first]
            raise ValueError(f"share: scanning layers {before} come before the first selection layer {first} and "
                             f"have no shared set to attend; name layer {scanning[0]} too (e.g. "
                             f"share={scanning[0]},{','.join(map(str, self.layers))})")
        return tuple(sorted(chosen))

    def plan_layers(self, n_layers: int, scanning_layers: Sequence[int] | None = None) -> "SharingPlan":
        """The static per-layer plan over the scanning layers, indexed as the attention hook indexes its layers
        (a position among ``scanning_layers``)."""
        scanning = _scanning(n_layers, scanning_layers)
        selecting = set(self.resolve(n_layers, scanning))
        selects = tuple(layer in selecting for layer in scanning)
        source, last = [], 0
        for i, sel in enumerate(selects):
            last = i if sel else last
            source.append(last)
        return SharingPlan(tuple(scanning), selects, tuple(source))

    def plan(self, model_config) -> "SharingPlan":
        """:meth:`plan_layers` for a model (its ``n_layers``; Gemma 3's ``global_layers`` scan)."""
        return self.plan_layers(model_config.n_layers, getattr(model_config, "global_layers", None))

    def validate(self, k: int, context: int | None = None) -> None:
        """Check the budget against the selection size ``k`` (a sharing layer attends at least what one selecting
        head does) and the context (raises ValueError naming the argument)."""
        if self.budget < k:
            raise ValueError(f"share: budget={self.budget} must be >= k={k} (every head of a sharing layer attends "
                             "the budget's positions; a budget below k attends less than a selecting head)")
        if context is not None and self.budget > context:
            raise ValueError(f"share: budget={self.budget} exceeds the context of {context} positions")


@dataclasses.dataclass(frozen=True)
class SharedMethod:
    """A scan method whose selection is shared across layers: what a spec with the ``@share=`` suffix names (the
    command line's ``--method``; :func:`fathom_jax.decode.from_spec` takes it as it takes a method)."""

    method: ScanMethod
    sharing: SharedSelection

    @property
    def spec(self) -> str:
        return self.method.spec + self.sharing.spec

    @property
    def label(self) -> str:
        return f"{self.method.label}, {self.sharing.label}"

    def __getattr__(self, name: str):
        # Everything else is the scan method's (its parts, read, checks): the studies treat it as one.
        if name.startswith("__") or name in ("method", "sharing"):
            raise AttributeError(name)
        return getattr(self.method, name)


@dataclasses.dataclass(frozen=True)
class SharingPlan:
    """Per scanning layer (the hook's index ``i``, model layer ``layers[i]``): whether it selects, and the scanning
    layer whose shared set it attends (itself where it selects)."""

    layers: tuple[int, ...]
    selects: tuple[bool, ...]
    source: tuple[int, ...]

    @property
    def selecting(self) -> tuple[int, ...]:
        """Model layer indices of the selection layers."""
        return tuple(layer for layer, sel in zip(self.layers, self.selects) if sel)

    @property
    def every_layer_selects(self) -> bool:
        return all(self.selects)


def _scanning(n_layers: int, scanning_layers: Sequence[int] | None) -> tuple[int, ...]:
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
    scanning = tuple(range(n_layers)) if scanning_layers is None else tuple(int(s) for s in scanning_layers)
    if not scanning or list(scanning) != sorted(set(scanning)) or scanning[0] < 0 or scanning[-1] >= n_layers:
        raise ValueError(f"scanning_layers must be increasing layer indices in [0, {n_layers}), got {scanning_layers}")
    return scanning


def parse_option(text: str, spec: str | None = None) -> SharedSelection:
    """A :class:`SharedSelection` from the options after a method spec:
    ``share=0,2,mid@budget=256[@rank=mass][@attend=topk]``."""
    spec = spec or text
    options: dict[str, str] = {}
    for item in text.split("@"):
        key, eq, value = item.strip().partition("=")
        if not eq or not value.strip():
            raise ValueError(f"bad sharing option {item!r} in {spec!r}: expected key=value "
                             f"({SharedSelection.spec_syntax})")
        if key not in ("share", "budget", "rank", "attend"):
            raise ValueError(f"unknown sharing option {key!r} in {spec!r}; expected share=, budget=, rank= and "
                             "attend=")
        if key in options:
            raise ValueError(f"sharing option {key}= given twice in {spec!r}")
        options[key] = value.strip()
    for need in ("share", "budget"):
        if need not in options:
            raise ValueError(f"{spec!r}: {need}= is missing ({SharedSelection.spec_syntax})")
    terms = []
    for term in options["share"].split(","):
        term = term.strip()
        if not term:
            raise ValueError(f"{spec!r}: share= holds an empty layer between commas")
        terms.append(int(term) if term.isdigit() else term)
    try:
        budget = int(options["budget"])
    except ValueError:
        raise ValueError(f"{spec!r}: budget must be an integer count of positions, got {options['budget']!r}") from None
    return SharedSelection(tuple(terms), budget, options.get("rank", "mass"), options.get("attend", "all"))


def parse_method(spec: str) -> "ScanMethod | SharedMethod":
    """A method spec as the command lines take it: with the sharing suffix a :class:`SharedMethod`, else the scan
    method."""
    method, sharing = parse_spec(spec)
    return method if sharing is None else SharedMethod(method, sharing)


def parse_spec(spec: str) -> tuple[ScanMethod, SharedSelection | None]:
    """A method spec with or without the sharing suffix: ``("fathom:48@share=0,mid@budget=256")`` ->
    ``(Fathom(48), SharedSelection((0, "mid"), 256))``; no ``@``: ``(method, None)``."""
    from fathom_jax.methods import (
        parse,  # here, so that the package may re-export this module without a cycle
    )

    if not isinstance(spec, str):
        raise ValueError(f"method spec must be a string, got {spec!r}")
    method_spec, at, options = spec.strip().partition("@")
    method = parse(method_spec)
    if not at:
        return method, None
    if method.selects_all:
        raise ValueError(f"{spec!r}: {method.label} attends every token; there is no selection to share")
    return method, parse_option(options, spec)
