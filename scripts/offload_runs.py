"""One run of the offload benchmark (``scripts/bench_offload.py``) as a frozen record, :class:`OffloadRun`: the model's
shape, the methods, contexts and batches, the step configurations (:class:`fathom_jax.decode.StepConfig`, one row
each), where the index lives (:class:`fathom_jax.placement.Placement`'s resident and warm planes), the K/V row formats,
the synthetic inputs, the sections and the time budget; every field checked by the library's own parsers when the
record is made. Its options (:data:`OPTIONS`) are set by name from text: ``--set key=value`` and the older flags
(``--pipeline 8,2``) go through the same parser. The presets, :data:`PRESETS`, are functions returning the run behind a
committed table; each names the results file of its ``results/README.md`` row (``tests/test_bench_presets.py``)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Callable, Literal

import jax.numpy as jnp

from fathom_jax.decode import Placement, RowLayout, StepConfig, from_spec, row_format
from fathom_jax.models import LlamaConfig
from scripts.offload_inputs import INPUTS, InputSet, parse_inputs
from pallas_kernels.topk import TopkConfig
from scripts.offload_setup import DEFAULT_METHODS, METHODS, SCAN_CONFIGS, SINGLE_TOPK, parse_ctx, scan_config, topk_config

QWEN3_8B = LlamaConfig(vocab=151936, hidden=4096, intermediate=12288, n_layers=36, n_heads=32, n_kv_heads=8,
                       head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, qk_norm=True, max_position_embeddings=1 << 20,
                       family="qwen3")
SMOKE = LlamaConfig(vocab=512, hidden=64, intermediate=128, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=64,
                    rope_theta=1e6, qk_norm=True, family="qwen3")
K, M = 1024, 1 << 20
SECTIONS = ("link", "attn", "full", "profile", "batch", "control", "dense", "prefill", "attnprofile", "attnbatch")


@dataclasses.dataclass(frozen=True)
class Rows:
    """A K/V row format measured over a cache of its own: ``format`` None for the model dtype (bf16), else a format
    with per-token scales (``k8v8``, :func:`fathom_jax.rows.layout.row_format`); ``share_kv_from`` the context from
    which every layer reads one row buffer (None: every layer its own; ``"run"``: the run's ``share_kv_from``)."""

    format: object = None
    share_kv_from: int | None | Literal["run"] = "run"

    @property
    def name(self) -> str:
        return "model" if self.format is None else self.format.spec


@dataclasses.dataclass(frozen=True)
class OffloadRun:
    """What one run of the benchmark measures (see the module docstring); checked when made."""

    tag: str | None = None  # the files: offload_<machine>_<tag> (scripts.harness.machine_name)
    sections: tuple[str, ...] = ("link", "attn", "full", "profile", "batch", "control", "dense", "prefill")
    contexts: tuple[int, ...] = (32 * K, 128 * K, 512 * K, M)
    attn_contexts: tuple[int, ...] | None = None  # None: contexts
    full_contexts: tuple[int, ...] | None = None  # None: the largest context and 128k
    methods: tuple[str, ...] = DEFAULT_METHODS  # labels of offload_setup.METHODS
    k: int = 512
    batches: tuple[int, ...] = (4, 8)  # of the batch and attnbatch sections
    mesh: int = 1  # GPUs (the group axis split over them)
    share_kv_from: int | None = 512 * K  # contexts from this size share one K/V row buffer
    configs: tuple[StepConfig, ...] = (StepConfig(),)  # one row each
    resident_planes: tuple[int, ...] = (0,)  # Placement.resident_planes: one set of rows each
    warm_planes: tuple[int, ...] = (0,)  # Placement.warm_planes: one set of attention rows each
    rows: tuple[Rows, ...] = (Rows(),)
    inputs: tuple[InputSet, ...] = (INPUTS["today"],)
    query_drift: float | None = None  # AR(1) drift of the attention rows' queries (None: one query set repeated)
    steps: int = 5  # timed steps per repeat
    repeats: int = 3
    link_bytes: int = 2 << 30
    time_budget: float = 540.0  # seconds; sections past it are skipped
    implementation: Literal["triton", "xla"] = "triton"
    dump_hlo: bool = False
    model: LlamaConfig = QWEN3_8B

    def __post_init__(self):
        unknown = [s for s in self.sections if s not in SECTIONS]
        if unknown:
            raise ValueError(f"sections: unknown {unknown}; choose from {list(SECTIONS)}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"methods: unknown {unknown}; choose from {list(METHODS)}")
        for label in self.methods:
            from_spec(METHODS[label], k=self.k)  # the spec parses
        if not self.configs or not all(isinstance(c, StepConfig) for c in self.configs):
            raise TypeError(f"configs must be StepConfigs, got {self.configs!r}")
        for field in ("resident_planes", "warm_planes"):  # each a valid Placement field
            for count in getattr(self, field):
                Placement("pinned_host", **{field: count})
        names = [r.name for r in self.rows]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"rows: a row format is given twice or none is: {names}")
        for entry in self.rows:  # the format against the model's head_dim
            RowLayout.of(entry.format, self.model.head_dim, jnp.bfloat16)
        if not self.inputs or len(set(self.inputs)) != len(self.inputs):
            raise ValueError(f"inputs: distinct names from {list(INPUTS)}, got {self.inputs!r}")
        if self.query_drift is not None and not 0 <= self.query_drift < 1:
            raise ValueError(f"query_drift must be in [0, 1), got {self.query_drift}")
        if self.implementation not in ("triton", "xla"):
            raise ValueError(f"implementation must be triton or xla, got {self.implementation!r}")

    @property
    def attention_contexts(self) -> tuple[int, ...]:
        return self.attn_contexts or self.contexts

    @property
    def full_step_contexts(self) -> tuple[int, ...]:
        largest = {max(self.contexts)} | ({128 * K} & set(self.contexts))
        return self.full_contexts or tuple(sorted(largest, reverse=True))

    @property
    def row_sets(self) -> tuple[Rows, ...]:
        """The row formats with the run's ``share_kv_from`` where they give none."""
        return tuple(r if r.share_kv_from != "run" else dataclasses.replace(r, share_kv_from=self.share_kv_from)
                     for r in self.rows)

    @property
    def read(self) -> str:
        """The index read of the first step configuration (the report's default for rows that record none)."""
        return self.configs[0].read

    def record(self) -> dict:
        """The run as its results JSON's ``config`` (plain values)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {
            "read": self.read, "model": dataclasses.asdict(self.model), "configs": [repr(c) for c in self.configs],
            "rows": [{"name": r.name, "share_kv_from": r.share_kv_from} for r in self.row_sets],
            "inputs": [i.name for i in self.inputs]}

    def set(self, key: str, text: str) -> "OffloadRun":
        """This run with option ``key`` (a field or a step option of :data:`OPTIONS`, ``-`` or ``_``) set from
        ``text`` as typed on the command line (ValueError naming the option on a bad value)."""
        key = key.replace("-", "_")
        if key not in OPTIONS:
            raise ValueError(f"--set: unknown key {key!r}; keys: {', '.join(OPTIONS)}")
        parse, _ = OPTIONS[key]
        try:
            value = parse(text)
            if key == "config":
                return dataclasses.replace(self, configs=tuple(dict.fromkeys(value)))
            if key in STEP_OPTIONS:  # every configuration with each value: one row each
                configs = (dataclasses.replace(c, **v) for c in self.configs for v in value)
                return dataclasses.replace(self, configs=tuple(dict.fromkeys(configs)))
            return dataclasses.replace(self, **{key: value})
        except (ValueError, TypeError) as e:
            raise ValueError(f"--{key.replace('_', '-')}: {e}") from None


# -- options from text (the command line's flags and --set) --------------------------------------------------------

def _items(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _each(convert: Callable[[str], object]) -> Callable[[str], tuple]:
    """A parser of a comma-separated list, each entry by ``convert``."""
    return lambda text: tuple(convert(x) for x in _items(text))


def _context_or_none(text: str) -> int | None:
    return None if text.strip().lower() in ("", "none") else parse_ctx(text.strip())


def _int_or(word: str) -> Callable[[str], int | str]:
    """A parser of an int, or of ``word`` itself."""
    return lambda text: text if text == word else int(text)


def parse_rows(text: str) -> tuple[Rows, ...]:
    """``FORMAT`` or ``FORMAT@SHARE`` entries: ``model`` or a row format with per-token scales; SHARE a context or
    ``none`` (without it: the run's ``share_kv_from``)."""
    out = []
    for entry in _items(text):
        spec, at, share = entry.partition("@")
        out.append(Rows(row_format(spec), _context_or_none(share) if at else "run"))  # ValueError on a bad format
    if not out:
        raise ValueError("no row format given")
    return tuple(out)


def _pipelines(text: str) -> list[dict]:
    out = []
    for item in _items(text):  # auto, N or N/P: N chunks, P persistent gather programs ("auto" where not given)
        n, _, programs = item.partition("/")
        out.append({"pipeline": _int_or("auto")(n), "gather_programs": _int_or("auto")(programs or "auto")})
    return out


def _xla_options(text: str) -> list[dict]:
    out = []
    for item in text.split(";"):  # "none" or name=value,name=value (a value may hold commas: a list of enums)
        pairs = {} if item in ("", "none") else dict(kv.split("=", 1) for kv in re.split(r",(?=xla_)", item))
        out.append({"xla_options": tuple((k, {"true": True, "false": False}.get(v.lower(), v))
                                         for k, v in pairs.items())})
    return out


def _checked(field: str, convert=lambda x: x, least: int | None = None) -> Callable[[str], list[dict]]:
    def parse(text: str) -> list[dict]:
        values = [convert(x) for x in _items(text)]
        if least is not None and any(isinstance(v, int) and v < least for v in values):
            raise ValueError(f"entries are ints >= {least}, got {text!r}")
        for v in values:  # a bad entry fails here, before anything runs
            StepConfig(**{field: v})
        return [{field: v} for v in values]
    return parse


# A step option's parser gives one dict of StepConfig fields per entry (one row each).
STEP_OPTIONS: dict[str, tuple[Callable[[str], list[dict]], str]] = {
    "read": (_checked("read"), "direct or staged: how an index in host memory is read"),
    "index_writes": (_checked("index_writes"), "every_step and/or full_blocks: when steps write the newest plane block"),
    "pipeline": (_pipelines, "chunks per layer with chained plane transfers: auto, N or N/P with P persistent gather "
                             "programs (1/0 = one chunk, one program per copied chunk of a run)"),
    "fetch_programs": (_checked("fetch_programs", _int_or("auto")),
                       "persistent programs of the row fetch: auto or N, 0 = one program per 32 rows"),
    "topk": (_checked("topk", topk_config), "auto (the kernels' defaults), single (one program per row per selection, "
                                            "the top-k before 2026-12-01) and/or bBtT (B programs per row of the bucket "
                                            "selection, T of the token selection)"),
    "xla_options": (_xla_options, "extra XLA options of the step programs: none or name=value,... (a ';'-separated "
                                  "list)"),
    "layer_unroll": (_checked("layer_unroll", int, 1), "layers per iteration of the step's layer scan"),
    "row_cache": (_checked("row_cache", _int_or("last"), 0), "device-memory row-cache slots per layer and group "
                                                        "(StepConfig.row_cache; 0: none)"),
    "scan": (_checked("scan", scan_config), f"plane scan configurations (StepConfig.scan): {', '.join(SCAN_CONFIGS)}"),
    "attention": (_checked("attention"), "how a step attends (StepConfig.attention): kernel and/or xla"),
}
OPTIONS: dict[str, tuple[Callable[[str], object], str]] = {
    "tag": (str, "the run's name: its files are offload_<machine>_<tag> (<machine> the device it ran on)"),
    "sections": (_each(str), f"sections, in the order they run: {', '.join(SECTIONS)}"),
    "contexts": (_each(parse_ctx), "contexts (32k, 1m, ...)"),
    "attn_contexts": (_each(parse_ctx), "contexts of the attention-only section (default: contexts)"),
    "full_contexts": (_each(parse_ctx), "contexts of the full-step section (default: the largest and 128k)"),
    "methods": (_each(str), f"method labels: {', '.join(METHODS)}"),
    "k": (int, "rows selected per head"),
    "batches": (_each(int), "batch sizes of the batch and attnbatch sections"),
    "mesh": (int, "GPUs in the mesh (the group axis split over them; across processes, of every process)"),
    "share_kv_from": (_context_or_none, "contexts from this size share one K/V row buffer (none: never)"),
    **STEP_OPTIONS,
    "config": (lambda text: [StepConfig.parse(t) for t in text.split(";")],
               "the step configurations as StepConfig.parse reads them ('pipeline=8,read=direct'), a ';'-separated "
               "list: one row each, in place of the run's"),
    "resident_planes": (_each(int), "planes of every channel kept in HBM (Placement.resident_planes): one set of rows "
                                    "each (0: the whole index in host memory; 4: all of it in HBM)"),
    "warm_planes": (_each(int), "channel planes per layer and KV group kept in HBM beside the resident ones "
                                "(Placement.warm_planes): one set of attention rows each with resident planes 0-3"),
    "rows": (parse_rows, "K/V row formats, FORMAT or FORMAT@SHARE: model (bf16) or a format with per-token scales "
                         "(k8v8, ...); SHARE overrides share_kv_from for it: one set of rows each"),
    "inputs": (lambda t: tuple(parse_inputs(t)), "synthetic input sets: today and/or honest (scripts/offload_inputs.py)"),
    "query_drift": (float, "attention rows' queries drift from the last step's by AR(1) with this coefficient (0.95: "
                           "~37%% new rows per step); default: one query set repeated"),
    "steps": (int, "timed steps per repeat"),
    "repeats": (int, "timed repeats"),
    "link_bytes": (int, "bytes of the link measurement"),
    "time_budget": (float, "seconds; sections past it are skipped"),
    "implementation": (str, "triton (what the benchmark measures) or xla (a quick CPU check; device memory only)"),
}


def configs(**options) -> tuple[StepConfig, ...]:
    """Step configurations of every combination of ``options`` (StepConfig fields; a list gives one row each;
    ``pipeline`` entries ``(chunks, gather programs)`` pairs or chunk counts)."""
    names, values = list(options), [v if isinstance(v, list) else [v] for v in options.values()]
    out = []
    for combo in itertools.product(*values):
        fields = dict(zip(names, combo))
        if isinstance(fields.get("pipeline"), tuple):
            fields["pipeline"], fields["gather_programs"] = fields["pipeline"]
        out.append(StepConfig(**fields))
    return tuple(dict.fromkeys(out))


# -- presets: the run behind each committed table ------------------------------------------------------------------

PRESETS: dict[str, Callable[[], OffloadRun]] = {}
PRESET_RESULTS: dict[str, str | None] = {}  # preset -> the results file its results/README.md row names

F48 = ("Fathom 48",)
F48_32 = ("Fathom 48", "32-channel (SparQ r=32)")
F3 = ("Fathom 48", "SparQ r=16", "32-channel (SparQ r=32)")
F4 = ("Fathom 48", "Fathom 64", "SparQ r=16", "32-channel (SparQ r=32)")
WRITES = configs(index_writes=["every_step", "full_blocks"])
WHILE = (("xla_gpu_enable_command_buffer", "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE"),)
ALL = DEFAULT_METHODS
LINK_ATTN = ("link", "attn")
K8V8 = (Rows(row_format("k8v8")),)  # 8-bit K and V rows, shared as the run says


def preset(name: str, results: str | None, tag: str, sections, contexts, methods=F48, **fields) -> None:
    """Registers preset ``name``: a function returning its run, ``tag`` (its files: offload_<machine>_<tag>) with
    ``sections``, ``contexts``, ``methods`` and the other :class:`OffloadRun` ``fields`` (checked when it is called);
    ``results``: the results file (as results/README.md names it) the run's row is in, None for one written and not
    run yet."""
    PRESETS[name] = lambda: OffloadRun(tag=tag, sections=tuple(sections), contexts=tuple(contexts), methods=methods,
                                       **fields)
    PRESET_RESULTS[name] = results


preset("attn", "offload_h200", "attn", LINK_ATTN, (M, 128 * K), F4, share_kv_from=M, time_budget=280)
preset("attn-index-writes-1m", "offload_h200", "writes_1m", LINK_ATTN, (M,), F3, configs=WRITES, share_kv_from=M,
       time_budget=140)
preset("attn-index-writes-128k", "offload_h200", "writes_128k", ("attn", "full"), (128 * K,), F3, configs=WRITES,
       full_contexts=(128 * K,), time_budget=90)
preset("direct-reads", "offload_h200", "direct", LINK_ATTN, (M, 128 * K), ALL, configs=configs(read="direct"),
       time_budget=280)
preset("contexts-32k-512k", "offload_h200", "32k_512k", ("attn", "dense"), (512 * K, 128 * K, 32 * K), F4,
       attn_contexts=(512 * K, 32 * K), share_kv_from=512 * K, time_budget=550)
preset("full-1m", "offload_h200", "full_1m", ("full", "profile"), (M,), full_contexts=(M,), share_kv_from=M,
       time_budget=120)
preset("full-3methods", "offload_h200", "full_3", ("attn", "full", "profile", "batch", "prefill", "control", "dense"),
       (M, 128 * K), F3, attn_contexts=(M, 128 * K), full_contexts=(M,), share_kv_from=M, time_budget=290)
preset("full-batches", "offload_h200", "batches", ("link", "attn", "attnprofile", "full", "profile", "batch"),
       (M, 128 * K), attn_contexts=(128 * K,), full_contexts=(M, 128 * K), batches=(8, 4), share_kv_from=512 * K,
       time_budget=400)
preset("full-batches-128k", "offload_h200", "batches_128k", ("link", "full", "batch"), (128 * K,), batches=(4, 8),
       time_budget=320)
preset("full-batch8", "offload_h200", "batch8", ("link", "full", "batch", "profile"), (128 * K,),
       configs=configs(fetch_programs=["auto", 132]), full_contexts=(128 * K,), batches=(8,), share_kv_from=512 * K,
       time_budget=190)
preset("prefill", "offload_h200", "prefill", ("prefill", "batch"), (128 * K,), batches=(8,), share_kv_from=512 * K,
       time_budget=155)
preset("hbm-control", "offload_h200", "control", ("batch", "control"), (128 * K,), batches=(8, 1), time_budget=270)
preset("pipeline-1m", "offload_h200", "pipeline_1m", ("link", "attn", "attnprofile"), (M,), F3,
       configs=configs(index_writes=["every_step", "full_blocks"], pipeline=["auto", (1, 0)]), share_kv_from=M,
       time_budget=270)
preset("pipeline-128k", "offload_h200", "pipeline_128k", LINK_ATTN, (128 * K,), F3,
       configs=configs(index_writes=["every_step", "full_blocks"], pipeline=["auto", (1, 0)]), time_budget=220)
preset("pipeline-chunks", "pipeline_h200", "chunks", ("link", "attn", "attnprofile"), (M, 128 * K),
       configs=configs(index_writes="full_blocks",
                       pipeline=[1, (1, 132), (2, 132), (4, 132), (8, 0), (8, 132), (8, 264)]),
       share_kv_from=M, time_budget=390)
preset("pipeline-programs", "pipeline_h200", "programs", ("link", "attn", "attnprofile"), (M, 128 * K),
       configs=configs(index_writes="full_blocks", pipeline=[1, (8, 132), (8, 66), (8, 33), (4, 66), (2, 66)]),
       share_kv_from=M, time_budget=290)
preset("topk-fetch-programs", "offload_h200", "topk_fetch", LINK_ATTN, (M,),
       configs=configs(fetch_programs=["auto", 0], topk=[None, SINGLE_TOPK]), share_kv_from=M, time_budget=190)
preset("weight-gemms", "offload_h200", "weights", ("link", "full", "batch"), (128 * K,),
       # the Triton control, then the default
       configs=configs(xla_options=[(("xla_gpu_enable_triton_gemm", True),
                                     ("xla_gpu_enable_dynamic_slice_fusion", False)), ()]),
       full_contexts=(128 * K,), batches=(8,), share_kv_from=512 * K, time_budget=160)

preset("layer-unroll", "step_options_h200", "unroll", ("attn",), (M, 128 * K),
       configs=configs(layer_unroll=[1, 2, 4, 6]), share_kv_from=M, time_budget=280)
preset("layer-unroll-profile", "step_options_h200", "unroll_profile", ("attn", "attnprofile"), (M, 128 * K),
       configs=configs(layer_unroll=[2, 4]), share_kv_from=M, time_budget=220)
preset("layer-unroll-full", "step_options_h200", "unroll_full", ("full",), (128 * K,),
       configs=configs(layer_unroll=[1, 4]), full_contexts=(128 * K,), time_budget=220)
preset("command-buffer-loop", "step_options_h200", "while", ("attn",), (M, 128 * K),
       configs=configs(xla_options=[WHILE, WHILE + (("xla_gpu_command_buffer_unroll_loops", True),)]), share_kv_from=M,
       time_budget=220)
preset("chunks-fetch-programs", "step_options_h200", "chunks_fetch", ("attn",), (M, 128 * K),
       configs=configs(layer_unroll=2, pipeline=["auto", 4, 8], fetch_programs=[66, 132]), share_kv_from=M,
       time_budget=400)
preset("topk-programs", "step_options_h200", "topk", ("attn",), (M, 128 * K),
       configs=configs(topk=[None, *(TopkConfig(bucket_splits=b, token_splits=t)
                                     for b, t in ((8, 4), (16, 4), (8, 8), ("auto", 8)))]),
       share_kv_from=M, time_budget=160)

preset("row-cache-1m", "row_cache_h200", "row_cache_1m", LINK_ATTN, (M, 128 * K), configs=configs(row_cache=[0, 16384]),
       share_kv_from=M, query_drift=0.95, time_budget=190)
preset("row-cache-batch8", "row_cache_h200", "row_cache_b8", ("link", "attnbatch", "attn", "batch", "attnprofile"),
       (128 * K,), configs=configs(row_cache=[0, 16384]), attn_contexts=(128 * K,), batches=(8,), share_kv_from=512 * K,
       query_drift=0.95, time_budget=390)
preset("honest-1m", "offload_h200_honest_1m", "honest_1m", ("link", "attn", "control"), (M,), resident_planes=(1, 4),
       inputs=(INPUTS["today"], INPUTS["honest"]), share_kv_from=M, time_budget=290)

# warm planes (plane_reuse.md: on these keys a set of 27 / 58 channel planes per group, chosen by the planner's gains,
# misses ~6% / ~11% of Fathom 48's host planes at p = 1 / 0)
preset("warm-1m", "offload_h100_warm_1m", "warm_1m", LINK_ATTN, (M,), resident_planes=(0, 1), warm_planes=(0, 48),
       inputs=(INPUTS["honest"],), share_kv_from=M, time_budget=480)
preset("warm-128k-b8", None, "warm_128k_b8", ("link", "attnbatch"), (128 * K,), batches=(8,), rows=K8V8,
       resident_planes=(0, 1), warm_planes=(0, 48), share_kv_from=None, time_budget=400)

# a selection shared across layers (issue 57) beside per-layer Fathom 48: at 128k eight sessions of their own with k8v8
# rows (the pinned host cap must hold them: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=110); at 1M with k8v8 rows and warm
# planes, the two ways left to cut what the shared step moves; the 1M step's kernels by the profiler; and at 1M every
# cut at once (k8v8 rows, plane 0 in HBM, a budget of 1024 beside 2048, index blocks written when full)
SHARED = ("Fathom 48", "Fathom 48 shared")
preset("shared-128k-b8", "offload_h100_shared_128k", "shared_128k", ("link", "attnbatch"), (128 * K,), SHARED,
       batches=(8,), rows=K8V8, inputs=(INPUTS["honest"],), share_kv_from=None, time_budget=185)
preset("shared-1m-rows", "offload_h100_shared_1m_rows", "shared_1m_rows", LINK_ATTN, (M,), SHARED, rows=K8V8,
       resident_planes=(0, 1), warm_planes=(0, 48), inputs=(INPUTS["honest"],), share_kv_from=M, time_budget=420)
preset("shared-1m-profile", "offload_h100_shared_1m_profile", "shared_1m_profile", ("attn", "attnprofile"), (M,),
       (*SHARED, "Fathom 48 shared top-k"), resident_planes=(1,), inputs=(INPUTS["honest"],), share_kv_from=M,
       time_budget=200)
preset("shared-1m-cuts", None, "shared_1m_cuts", LINK_ATTN, (M,),
       ("Fathom 48", "Fathom 48 shared top-k", "Fathom 48 shared 1024 top-k"), configs=WRITES, rows=K8V8,
       resident_planes=(1,), inputs=(INPUTS["honest"],), share_kv_from=M, time_budget=330)

preset("fathom48", "fetch_order_h200", "f48", LINK_ATTN, (M, 128 * K), share_kv_from=M, time_budget=160)
preset("attn-profile-1m", "fetch_order_h200", "profile_1m", ("attn", "attnprofile"), (M,), share_kv_from=M,
       time_budget=140)

preset("tiers-1m", "offload_h200", "tiers_1m", LINK_ATTN, (M,), F4, resident_planes=(0, 1), share_kv_from=M,
       time_budget=350)
preset("tiers-128k", "offload_h200", "tiers_128k", LINK_ATTN, (128 * K,), F4, resident_planes=(0, 1), share_kv_from=M,
       time_budget=190)
preset("tiers-p24", "offload_h200", "tiers_p24", ("attn",), (M, 128 * K), ("Fathom 48", "Fathom 64"),
       resident_planes=(2, 4), share_kv_from=M, time_budget=210)
preset("tiers-profile", "offload_h200", "tiers_profile", ("attn", "attnprofile"), (M,), resident_planes=(1,),
       share_kv_from=M, time_budget=140)
preset("tiers-chunks", "offload_h200_tiers_chunks", "tiers_chunks", LINK_ATTN, (M,),
       configs=configs(pipeline=[8, 2, 1]), resident_planes=(1, 2, 4), share_kv_from=M, time_budget=420)

# K/V row formats (issue 32): every layer's (every session's) own rows in 8-bit K and V, beside bf16 rows; the pinned
# host cap must hold them (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, results/README.md). bf16 rows of every layer at 1M
# (167 GB) do not fit the 128 GiB host: their row, shared by every layer, is the committed baseline (offload_h200). At
# 128k batch 8, bf16 own rows (175 GB) do not fit either: bf16 is measured shared as the control, after k8v8 (the
# larger cache first: the allocator's regions, once pinned, are kept).
preset("rows-1m", "offload_h200_rows_1m", "rows_1m", ("link", "attn", "full"), (M,), attn_contexts=(M,),
       full_contexts=(M,), rows=K8V8, share_kv_from=None, time_budget=200)
preset("rows-1m-tiers", "offload_h200_rows_1m_tiers", "rows_1m_tiers", ("link", "attn", "full"), (M,),
       attn_contexts=(M,), full_contexts=(M,), rows=K8V8, resident_planes=(1,), share_kv_from=None, time_budget=200)
preset("rows-128k-batch", "offload_h200_rows_128k_b8", "rows_128k_b8", ("link", "attnbatch", "batch"), (128 * K,),
       batches=(8,), rows=(Rows(row_format("k8v8"), None), Rows(None, 512 * K)), share_kv_from=None, time_budget=280)
preset("tiers-batch8", "offload_h200_tiers_b8", "tiers_b8", ("link", "attnbatch", "batch"), (128 * K,),
       configs=configs(pipeline=[2, 1]), batches=(8,), rows=K8V8, resident_planes=(1,), share_kv_from=None,
       time_budget=300)
preset("rows-128k-batches", "offload_h200_rows_128k_batches", "rows_128k_batches", ("link", "batch"), (128 * K,),
       batches=(8, 4, 2, 1), rows=K8V8, resident_planes=(0, 1), share_kv_from=None, time_budget=540)

# the two-GPU machine (every layer's own K/V: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, results/README.md)
preset("x2-1m-1gpu", "offload_h200x2", "1m_1gpu", LINK_ATTN, (M,), F48_32, configs=WRITES, mesh=1, share_kv_from=None,
       time_budget=230)
preset("x2-1m-2gpu", "offload_h200x2", "1m_2gpu", LINK_ATTN, (M,), F48_32, configs=WRITES, mesh=2, share_kv_from=None,
       time_budget=310)
preset("x2-512k-1gpu", "offload_h200x2", "512k_1gpu", ("attn",), (512 * K,), mesh=1, share_kv_from=None,
       time_budget=210)
preset("x2-512k-2gpu", "offload_h200x2", "512k_2gpu", LINK_ATTN, (512 * K,), mesh=2, share_kv_from=None,
       time_budget=270)
preset("x2-shared-1gpu", "offload_h200x2", "shared_1gpu", LINK_ATTN, (M, 128 * K), F48_32, mesh=1, share_kv_from=M,
       time_budget=140)
preset("x2-shared-2gpu", "offload_h200x2", "shared_2gpu", LINK_ATTN, (M, 128 * K), F48_32, mesh=2, share_kv_from=M,
       time_budget=160)
