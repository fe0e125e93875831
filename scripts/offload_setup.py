"""What the offload benchmark (``scripts/bench_offload.py``) sets up before it times anything: the methods it
measures (labels to specs, the authors' times beside them), the synthetic calibration and caches (keys with log-normal
channel scales, written layer by layer through the prefill path), the hook of a method spec with a step configuration,
the step inputs (random queries, and queries drifting step to step for the row cache), the random-weight model, the
``topk`` / ``scan`` entries a run names its kernels' configurations by, and each row's option fields, tags and labels
(the defaults of rows measured before an option existed). The run's record and its presets: ``offload_runs.py``."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fathom_jax import decode
from fathom_jax.decode import StepConfig
from fathom_jax.models import CacheShape, LlamaForCausalLM
from pallas_kernels.plane_scan import PlaneScanConfig
from pallas_kernels.topk import TopkConfig
from scripts.offload_inputs import TODAY_KEYS, KeyModel, drifting_queries  # noqa: F401 (drifting_queries: re-exported)

METHODS = {  # label -> spec
    "Fathom 48": "fathom:48", "Fathom 64": "fathom:64", "SparQ r=16": "sparq:16",
    "32-channel (SparQ r=32)": "sparq:32", "full 4-bit": "full4",
    # issue 57: three selection layers (SmolLM2's study: 0, 2 and the middle one), the others attend 2048 positions
    # (top-k: each head its own exact top k of them)
    "Fathom 48 shared": "fathom:48@share=0,2,mid@budget=2048",
    "Fathom 48 shared top-k": "fathom:48@share=0,2,mid@budget=2048@attend=topk",
    "Fathom 48 shared 1024 top-k": "fathom:48@share=0,2,mid@budget=1024@attend=topk",
}
# what a run measures unless it names its methods: the paper's (a shared selection only where asked for)
DEFAULT_METHODS = tuple(label for label, spec in METHODS.items() if "@" not in spec)
AUTHORS_MS = {  # DESIGN.md: the authors' implementation on the same H200 (attention only, 36 layers, batch 1)
    131072: {"Fathom 48": 19.3, "Fathom 64": 21.5, "SparQ r=16": 19.9, "32-channel (SparQ r=32)": 27.3},
    1 << 20: {"Fathom 48": 104.8, "Fathom 64": 120.6, "SparQ r=16": 106.4, "32-channel (SparQ r=32)": 161.1},
}


def parse_ctx(text: str) -> int:
    text = text.lower()
    mult = {"k": 1024, "m": 1 << 20}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "km" else text) * mult)


def synthetic_calibration(cfg, seed=0, keys: KeyModel = TODAY_KEYS):
    """``(calibration, scale [L, Hkv, D])`` of ``keys``' channel scales (the calibration's variance is the drawn
    one); :data:`~scripts.offload_inputs.TODAY_KEYS` draws what every committed run before issue 45 drew."""
    rng = np.random.default_rng(seed)
    shape = (cfg.n_layers, cfg.n_kv_heads)
    scale = keys.draw(rng, shape, cfg.head_dim)
    eye = np.broadcast_to(np.eye(cfg.head_dim, dtype=np.float32), shape + (cfg.head_dim, cfg.head_dim))
    calib = decode.Calibration.from_arrays(variance=scale**2, mean=np.zeros_like(scale), basis=eye,
                                           eigenvalues=scale**2, ds_order=np.argsort(-scale, axis=-1), loki_basis=eye)
    return calib, scale


SINGLE_TOPK = TopkConfig(bucket_splits=1, token_splits=1)  # one program per row per selection (before 2026-12-01)


def topk_config(name: str) -> TopkConfig | None:
    """A ``--topk`` entry's configuration: ``auto`` (None: the kernels' defaults), ``single`` or ``bBtT``
    (``TopkConfig(bucket_splits=B, token_splits=T)``, B = auto or a power of two)."""
    if name == "auto":
        return None
    if name == "single":
        return SINGLE_TOPK
    split = re.fullmatch(r"b(auto|\d+)t(\d+)", name)
    if not split:
        raise ValueError(f"--topk entries are auto, single or bBtT (TopkConfig(bucket_splits=B, token_splits=T), "
                         f"B = auto or a power of two), got {name!r}")
    buckets = split.group(1)
    return TopkConfig(bucket_splits=buckets if buckets == "auto" else int(buckets), token_splits=int(split.group(2)))


# `--scan` entries: the plane scan's configuration (StepConfig.scan); default: the kernel's heuristic.
SCAN_CONFIGS = {"default": None, "f16x2": PlaneScanConfig.heuristic(0, math="f16x2")}


def scan_config(name: str) -> PlaneScanConfig | None:
    if name not in SCAN_CONFIGS:
        raise ValueError(f"--scan entries are {sorted(SCAN_CONFIGS)}, got {name!r}")
    return SCAN_CONFIGS[name]


def scan_name(config: PlaneScanConfig | None) -> str:
    """The ``--scan`` entry of a configuration (:func:`scan_config` inverted; ``custom`` for any other)."""
    return next((name for name, c in SCAN_CONFIGS.items() if c == config), "custom")


def topk_name(config: TopkConfig | None) -> str:
    """The ``--topk`` entry of a configuration (:func:`topk_config` inverted)."""
    if config is None:
        return "auto"
    return "single" if config == SINGLE_TOPK else f"b{config.bucket_splits}t{config.token_splits}"


def hook(spec, calib, k, placement, implementation, step: StepConfig | None = None, *, shape: CacheShape | None = None,
         rows=None):
    """The hook of a method spec, bound to a cache of ``shape`` (:func:`cache_shape`; None: unbound), running ``step``
    (None: the defaults); ``rows``: the K/V row format (None: the model dtype)."""
    attn = decode.from_spec(spec, k=k, calibration=calib, placement=placement, implementation=implementation,
                            step=step or StepConfig(), rows=rows)
    return attn if shape is None else attn.bind(shape)


def cache_shape(cfg, batch: int, context: int) -> CacheShape:
    return CacheShape(layers=cfg.n_layers, batch=batch, kv_heads=cfg.n_kv_heads, capacity=context + 64,
                      head_dim=cfg.head_dim, dtype=jnp.bfloat16, query_heads=cfg.group_size)


def _fill_fn(cfg, context, attn, layer, key, scale, queries, cache):
    """One layer's synthetic keys (``scale`` the channels' scales per group) and values, written as a prefill would;
    ``queries [R, G, D]`` (a placement with warm planes): the prompt's queries, the same at every position."""
    b, hkv, d = cache.batch, cfg.n_kv_heads, cfg.head_dim
    k1, k2 = jax.random.split(key)
    keys = jax.random.normal(k1, (b, hkv, context, d), jnp.float32) * scale.reshape(b, hkv, 1, d)
    values = jax.random.normal(k2, (b, hkv, context, d), jnp.bfloat16)
    if queries is not None:
        queries = jnp.broadcast_to(queries.reshape(b, hkv, -1, 1, d), (b, hkv, queries.shape[1], context, d))
    return None, attn.write_prompt(cache, layer, keys.astype(jnp.bfloat16), values, jnp.full((b,), context, jnp.int32),
                                   queries)


def build_cache(attn, cfg, scale, *, context, batch, shared_kv, seed=0, queries=None):
    """A cache holding ``context`` tokens per sequence, room for 64 more, filled layer by layer (``attn`` bound to
    its shape); ``queries [L, R, G, D]``: what a placement with warm planes chooses them by (the step's)."""
    cache = attn.init_cache(cache_shape(cfg, batch, context), shared_kv=shared_kv)
    r, d = batch * cfg.n_kv_heads, cfg.head_dim
    scale_r = jnp.asarray(np.tile(scale, (1, batch, 1)).reshape(cfg.n_layers, r, d))
    fill = attn.program(_fill_fn, cache, static=(cfg, context))  # donated; in host memory written in place
    key = jax.random.key(seed)
    for layer in range(cfg.n_layers):
        _, cache = fill(jnp.int32(layer), jax.random.fold_in(key, layer), scale_r[layer],
                        None if queries is None else queries[layer], cache=cache)
    cache = attn.start_decode(cache, jnp.full((batch,), context, jnp.int32))
    return jax.block_until_ready(cache)


def random_step_inputs(cfg, batch, seed=1):
    rng = np.random.default_rng(seed)
    r = batch * cfg.n_kv_heads
    q = jnp.asarray(rng.standard_normal((cfg.n_layers, r, cfg.group_size, cfg.head_dim)), jnp.float32)
    key = jnp.asarray(rng.standard_normal((cfg.n_layers, r, cfg.head_dim)), jnp.bfloat16)
    value = jnp.asarray(rng.standard_normal((cfg.n_layers, r, cfg.head_dim)), jnp.bfloat16)
    return q, key, value


def without_row_cache(cache):
    return dataclasses.replace(cache, row_cache=None)


def with_row_cache(cache, attn):
    """``cache`` with an empty row cache of ``attn``'s slots, or none (every row starts from the same shared cache,
    built for the first hook's layout)."""
    slots = attn.step.row_cache
    row_cache = None
    if slots:
        row_cache = decode.empty_row_cache(jnp.zeros, n_layers=cache.n_layers,
                                           groups=cache.groups, slots=slots, width=cache.layout.width,
                                           dtype=cache.layout.storage_dtype)
    return dataclasses.replace(cache, row_cache=row_cache)

def rows_tag(rows) -> str:
    """A section name's suffix naming a row format (an :class:`~scripts.offload_runs.Rows`; none for the model
    dtype)."""
    return "" if rows.name == "model" else f" rows {rows.name}"


def split_fields(attn) -> dict:
    """The options a row varies (the columns of the report), as the bound hook's resolved step runs them."""
    run = attn.run
    return {"streams": 1, "index_writes": run.index_writes, "pipeline": run.chunks,
            "gather_programs": getattr(run.reader, "programs", 0), "fetch_programs": run.fetcher.programs,
            "layer_unroll": run.layer_unroll, "row_cache": run.row_cache, "scan_writes": run.in_place,
            "topk": topk_name(run.topk), "scan": scan_name(attn.step.scan),
            "xla_options": ",".join(f"{k}={v}" for k, v in dict(attn.step.xla_options).items()),
            "attention": attn.step.attention, "read": attn.step.read,
            "rows": "model" if attn.rows is None else attn.rows.spec}


def variant_tag(split: dict) -> str:
    """A file-name tag of a row's options (:func:`split_fields`)."""
    return (f"s{split['streams']}_{split['index_writes']}_p{split['pipeline']}_g{split['gather_programs']}"
            f"_f{split['fetch_programs']}_{split['topk']}" + ("_w" if split["scan_writes"] else "")
            + ("_x" if split["xla_options"] else "") + (f"_u{split['layer_unroll']}" if split["layer_unroll"] > 1 else "")
            + (f"_c{split['row_cache']}" if split["row_cache"] else "")
            + (f"_r{split['rows']}" if split["rows"] != "model" else "")
            + (f"_s{split['scan']}" if split["scan"] != "default" else "")
            + ("_xattn" if split["attention"] == "xla" else ""))


def random_model(cfg, placement):
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)

    @jax.jit
    def init(key):
        leaves, tree = jax.tree_util.tree_flatten_with_path(state)
        out = []
        for i, (path, leaf) in enumerate(leaves):
            name = jax.tree_util.keystr(path)
            if "norm" in name:
                out.append(jnp.ones(leaf.shape, leaf.dtype))
            else:
                out.append((0.02 * jax.random.normal(jax.random.fold_in(key, i), leaf.shape, jnp.float32)).astype(leaf.dtype))
        return jax.tree_util.tree_unflatten(tree, out)

    params = placement.replicate(init(jax.random.key(0)))
    return nnx.merge(graphdef, params)
