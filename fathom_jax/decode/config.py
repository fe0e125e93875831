"""How a decode step runs: a frozen step configuration, resolved once (before tracing) into what the step reads.

    StepConfig()                                  # the defaults: measured fastest on the H200
    StepConfig(pipeline=1, index_writes="full_blocks", row_cache=16384)
    StepConfig.parse("read=direct,pipeline=8")    # the CLI's --step-config

Where the cache lives is :class:`~fathom_jax.placement.Placement`; this is how a step over it runs. ``resolve``
turns both, with the step's groups (per device) and the cache's capacity, into a :class:`ResolvedStep`: the read
strategy (:mod:`fathom_jax.decode.reads`), the fetch strategy (:mod:`fathom_jax.decode.fetches`), the number of
pipelined chunks, the program counts and the XLA options, all concrete. Every step selects the same way
(:mod:`fathom_jax.decode.selection`).

Fields:

* ``read``: how an index in host memory is read: ``"staged"`` (the run gather copies the planned runs to HBM at the
  link rate, then the scan reads HBM) or ``"direct"`` (the scan reads host memory as it computes; under half the
  link rate on the H200, NOTES.md).
* ``pipeline``: chunks of each layer's groups whose plane transfers are chained, so that chunk ``i + 1``'s transfer
  runs beside chunk ``i``'s scan, selection and row fetch; ``"auto"``: with staged reads from real host memory, the
  largest divisor of the groups up to ``groups x capacity / 2^19``, at least 2 and at most 8 (``results/
  pipeline_h200.md``, ``results/chunks_h200.md``), or 2 where every plane is resident (only rows cross the link),
  else 1.
* ``gather_programs`` / ``fetch_programs``: persistent programs of the run gather / row fetch (0: one program per
  work item); ``"auto"``: half the GPU's SMs from real host memory (programs that wait on the link leave the other
  half to the kernels beside them), else 0.
* ``index_writes``: ``"every_step"`` (the stores always hold every key) or ``"full_blocks"`` (a 64-token plane
  block is written only when it fills; the partial block lives in device memory as the stores' raw tail, from
  which every step scores it anyway; :meth:`fathom_jax.decode.SparseAttention.flush` writes it on demand).
* ``layer_unroll``: layers per iteration of the decode step's layer scan.
* ``xla_options``: more XLA compiler options for the programs that run a step (``{name: value}``).
* ``row_cache``: device-memory slots per layer and group for recently fetched K/V rows (0: none), or ``"last"``: the
  previous step's selected rows, kept in its order (:mod:`fathom_jax.decode.row_cache`).
* ``attention``: ``"kernel"`` (the attention kernel reads the selected rows by index, :mod:`pallas_kernels.sparse_attend`)
  or ``"xla"`` (the rows fetched into one array, then attended by XLA).
* ``topk``: the top-k kernels' configuration (None: their defaults).
* ``scan``: the plane scan's configuration, e.g. ``PlaneScanConfig(tile=1024, num_warps=2)``
  (None: its default).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

import jax

from fathom_jax.decode.fetches import CachedRowFetch, RowFetch
from fathom_jax.decode.reads import IndexRead, index_read
from fathom_jax.index.plane_stacking import stacking
from fathom_jax.placement import Placement
from pallas_kernels.plane_scan import PlaneScanConfig
from pallas_kernels.topk import TopkConfig

ReadMode = Literal["direct", "staged"]
AttentionMode = Literal["kernel", "xla"]
IndexWrites = Literal["every_step", "full_blocks"]
Auto = Literal["auto"]
# XLA's CUDA graphs of a program follow its sequential schedule by default; a pipelined step needs each chunk's
# transfer to run beside the previous chunk's kernels, which "CONCURRENT" (data dependencies only) allows.
CONCURRENT_KERNELS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """How a decode step runs (see the module docstring); every field is checked here."""

    read: ReadMode = "staged"
    pipeline: int | Auto = "auto"
    gather_programs: int | Auto = "auto"
    fetch_programs: int | Auto = "auto"
    index_writes: IndexWrites = "every_step"
    layer_unroll: int = 1
    xla_options: tuple = ()
    row_cache: int | Literal["last"] = 0
    attention: AttentionMode = "kernel"
    topk: TopkConfig | None = None
    scan: PlaneScanConfig | None = None

    def __post_init__(self):
        if self.read not in get_args(ReadMode):
            raise ValueError(f"step read must be one of {get_args(ReadMode)}, got {self.read!r}")
        if self.attention not in get_args(AttentionMode):
            raise ValueError(f"step attention must be one of {get_args(AttentionMode)}, got {self.attention!r}")
        if self.index_writes not in get_args(IndexWrites):
            raise ValueError(f"step index_writes must be one of {get_args(IndexWrites)}, got {self.index_writes!r}")
        for name, least, auto in (("pipeline", 1, True), ("gather_programs", 0, True), ("fetch_programs", 0, True),
                                  ("layer_unroll", 1, False), ("row_cache", 0, False)):
            value = getattr(self, name)
            if (auto and value == "auto") or (name == "row_cache" and value == "last"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                allowed = f"an int >= {least}" + (" or 'auto'" if auto else "") + (
                    " or 'last'" if name == "row_cache" else "")
                raise ValueError(f"step {name} must be {allowed}, got {value!r}")
        try:
            options = dict(self.xla_options)  # a dict or (name, value) pairs
        except (TypeError, ValueError):
            options = {None: None}
        if not all(isinstance(name, str) and name.startswith("xla_") for name in options):
            raise ValueError(f"step xla_options must map XLA option names (xla_...) to values, got {self.xla_options!r}")
        object.__setattr__(self, "xla_options", tuple(sorted(options.items())))
        if self.topk is not None and not isinstance(self.topk, TopkConfig):
            raise TypeError(f"step topk must be a pallas_kernels.topk.TopkConfig or None, got {self.topk!r}")
        if self.scan is not None and not isinstance(self.scan, PlaneScanConfig):
            raise TypeError(f"step scan must be a pallas_kernels.plane_scan.PlaneScanConfig or None, got {self.scan!r}")

    @classmethod
    def parse(cls, text: str) -> "StepConfig":
        """``"key=value,..."`` (the CLI's ``--step-config``): ints, ``auto``, ``xla_*`` options, topk and plane scan
        fields as ``topk.NAME=value`` / ``scan.NAME=value``; unknown keys and bad values raise ValueError naming
        them."""
        kernels = {"topk": TopkConfig, "scan": PlaneScanConfig}
        fields = {f.name for f in dataclasses.fields(cls)} - {"xla_options", *kernels}
        kwargs: dict = {}
        options: dict = {}
        nested: dict = {name: {} for name in kernels}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            kernel, dot, name = key.partition(".")
            if not sep or not value:
                raise ValueError(f"step config {item!r}: expected key=value")
            if key.startswith("xla_"):
                options[key] = _literal(value)
            elif dot and kernel in kernels:
                nested[kernel][name] = _literal(value)
            elif key in fields:
                kwargs[key] = _literal(value)
            else:
                raise ValueError(f"step config: unknown key {key!r}; expected one of {sorted(fields)}, xla_*, "
                                 "topk.* or scan.*")
        for name, config in kernels.items():
            if nested[name]:
                try:
                    kwargs[name] = config(**nested[name])
                except (TypeError, ValueError) as err:
                    raise ValueError(f"step config {name}: {err}") from None
        return cls(xla_options=options, **kwargs)

    def resolve(self, placement: Placement, *, groups: int, capacity: int, implementation: str, layers: int = 1
                ) -> "ResolvedStep":
        """The step as it runs for ``groups`` groups (of the whole mesh) in a cache of ``layers`` layers of
        ``capacity`` tokens."""
        if self.pipeline != "auto" and (groups // placement.num_shards) % self.pipeline:
            raise ValueError(f"step pipeline={self.pipeline} must divide the {groups // placement.num_shards} groups "
                             "(batch x KV heads) of each device; use a divisor of it")
        host = placement.in_host_memory
        stack = stacking(placement.resident(layers), placement.warm_planes)
        reader = index_read(stack, offloaded=placement.offloaded, implementation=implementation, mode=self.read,
                            programs=_programs(self.gather_programs, host), scan=self.scan)
        fetch_programs = _programs(self.fetch_programs, host)
        # the offloaded layout's rows are fetched first (on a CPU, device memory stands in for the host: the same path)
        fetcher = (CachedRowFetch if self.row_cache else RowFetch)(implementation, fetch_programs,
                                                                   in_host=placement.offloaded,
                                                                   kernel=self.attention == "kernel")
        options = (CONCURRENT_KERNELS if reader.stages and self.pipeline != 1 else {}) | dict(self.xla_options)
        chunks = self._chunks(groups // placement.num_shards, capacity, host and reader.stages, stack.crosses_link)
        return ResolvedStep(reader=reader, fetcher=fetcher, chunks=chunks,
                            implementation=implementation, index_writes=self.index_writes, in_place=host,
                            layer_unroll=self.layer_unroll, compiler_options=tuple(sorted(options.items())),
                            topk=self.topk, row_cache=self.row_cache)

    def _chunks(self, groups: int, capacity: int, staged_from_host: bool, planes_cross: bool) -> int:
        if self.pipeline != "auto":
            return self.pipeline
        if not staged_from_host:  # elsewhere chunks run one after the other: the same results, more launches
            return 1
        # Each chunk adds its own launches, top-k and glue: more chunks pay while each still holds about 2^19
        # positions of the layer's groups, from 2 up to 8 (results/chunks_h200.md: 2 at 32k and 128k, 4 at 256k, 8 at
        # 1M and at 128k with batch 4 or 8; 16 at batch 8 was slower). With every plane resident only the row fetches
        # cross the link: 2 (1M, results/offload_h200_tiers_chunks.md: 26.97 ms with 2, 28.87 with 1, 31.40 with 8).
        most = min(8 if planes_cross else 2, max(2, groups * capacity >> 19))
        return max(d for d in range(1, min(most, groups) + 1) if groups % d == 0)


@dataclasses.dataclass(frozen=True)
class ResolvedStep:
    """A step configuration as a step over a given cache runs it: strategies and concrete counts (static)."""

    reader: IndexRead
    fetcher: RowFetch
    chunks: int
    implementation: str
    index_writes: str
    in_place: bool  # bulk arrays in real host memory: written in place by the kernels, inside the layer scan
    layer_unroll: int
    compiler_options: tuple
    topk: TopkConfig | None
    row_cache: int

    @property
    def options(self) -> dict:
        return dict(self.compiler_options)


def _programs(value, host: bool) -> int:
    if value != "auto":
        return value
    if not host or jax.default_backend() != "gpu":
        return 0
    return max(1, getattr(jax.devices()[0], "core_count", 132) // 2)


def _literal(text: str):
    """An int, a bool, ``auto``, or the text itself."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return text
