"""Sparse decoding with any scan method: the decoder's attention with a cache of its own.

    attn = SparseAttention(methods.Fathom(48), k=128, calibration=calib)         # corpus statistics [L, Hkv]
    attn = from_spec("fathom_klt:48", k=128)                                    # the session's own statistics
    attn = from_spec("fathom:48", k=512, placement="pinned_host")                # offloaded
    ids = fathom_jax.models.generate(model, prompt, 64, attention_fn=attn)

:class:`SparseAttention` implements the models' :class:`~fathom_jax.models.attention.CacheAttention` protocol: the
decoder hands it each layer's prompt (:meth:`~SparseAttention.attend_prompt`: dense causal attention, and the keys
and values written by :meth:`~SparseAttention.write_prompt`), and in a decode step calls
:meth:`~SparseAttention.attend` per layer inside its layer scan and :meth:`~SparseAttention.commit` after it. The
cache (:class:`~fathom_jax.decode.cache.SparseCache`) holds every layer's K/V rows and key index stacked ``[L, R,
...]``, bulk arrays where the placement puts them, and one length per sequence: a batch of different lengths decodes
together. How a step runs is the hook's :class:`~fathom_jax.decode.config.StepConfig`, resolved once for a cache's
shape by :meth:`~SparseAttention.bind` (the drivers do it) into the strategies the step reads.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp

from fathom_jax import methods as methods_lib
from fathom_jax import planner as planner_lib
from fathom_jax import store as store_lib
from fathom_jax.calibrate import SKIP_TOKENS, Calibration, calibrate_session
from fathom_jax.checks import is_traced
from fathom_jax.decode import writes as writes_lib
from fathom_jax.decode.cache import LayerUpdate, SparseCache, allocate, bulk_allocations
from fathom_jax.decode.cache_program import cache_program
from fathom_jax.decode.config import ResolvedStep, StepConfig
from fathom_jax.decode.step import CacheView, NewToken, StepContext, sparse_attention_step
from fathom_jax.format import round_capacity
from fathom_jax.index import KeyIndex, build_index
from fathom_jax.index.parts import KEYS
from fathom_jax.methods.base import ScanMethod
from fathom_jax.models.attention import CacheShape
from fathom_jax.models.prompt_attention import PREFILL_MLP_CHUNK, prefill_attention
from fathom_jax.placement import Placement
from fathom_jax.placement import host_memory
from fathom_jax.rows.formats import RowFormat
from fathom_jax.rows.layout import RowLayout, row_format
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS
from pallas_kernels import backend

CalibrationSource = Literal["corpus", "session"]
_SOURCES = ("corpus", "session")


@dataclasses.dataclass(frozen=True)
class SparseAttention:
    """Top-k sparse decode attention driven by a scan method (a callable pytree hook of the decoder).

    Static: ``method``, ``k`` (tokens per query head, sinks and local window included), ``calibration_source``,
    ``sink``, ``local``, ``skip_tokens``, ``implementation`` (None: triton on a GPU, xla elsewhere), ``placement``
    (where the cache lives), ``rows`` (how the cache stores K/V rows: None for the model dtype, or a row format with
    per-token scales such as ``"k8v8"``, :mod:`fathom_jax.rows.layout`), ``step`` (how a step runs) and ``run`` (the step resolved for a cache's shape: set by
    :meth:`bind`). Traced: ``calibration``, corpus statistics with leading axes ``[n_layers, Hkv]``; new arrays of
    the same shapes reuse the compiled program.

    ``calibration_source="session"`` computes :func:`~fathom_jax.calibrate.calibrate_session` on each sequence's
    prefill keys, per layer, into the cache. Methods without statistics (SparQ, thumbnail, landmark, full 4-bit,
    exact, dense) take neither.
    """

    method: ScanMethod
    k: int
    calibration: Calibration | None = None
    calibration_source: CalibrationSource = "corpus"
    sink: int = SINK_TOKENS
    local: int = LOCAL_TOKENS
    skip_tokens: int = SKIP_TOKENS
    implementation: backend.Implementation | None = None
    placement: Placement = Placement()
    step: StepConfig = StepConfig()
    rows: RowFormat | None = None
    run: ResolvedStep | None = None

    def __post_init__(self):
        # Only static fields and `calibration is None` are checked here: jax rebuilds this object from traced (or
        # placeholder) leaves, so array contents are checked in check().
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
        if self.calibration_source not in _SOURCES:
            raise ValueError(
                f"SparseAttention: calibration_source must be one of {_SOURCES}, got {self.calibration_source!r}")
        if self.uses_calibration and self.calibration_source == "corpus" and self.calibration is None:
            raise ValueError(
                f"SparseAttention: {self.method.label} needs calibration statistics: pass calibration= "
                "(a Calibration [n_layers, Hkv] from fathom_jax.calibrate.calibrate) or "
                "calibration_source='session'")

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
        return f"{self.method.label}, k={self.k}{src}{where}{rows}"

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

    # -- the CacheAttention protocol: how the decoder drives it ---------------------------------
    @property
    def fused(self) -> bool:
        """Whether a whole generation can be one program (the cache in device memory on one device)."""
        return not self.placement.offloaded and self.placement.mesh is None

    ragged = True  # one length per sequence
    mlp_chunk = PREFILL_MLP_CHUNK

    @property
    def offloaded(self) -> bool:
        return self.placement.offloaded

    @property
    def min_capacity(self) -> int:
        return self.k

    @property
    def layer_unroll(self) -> int:
        return self.step.layer_unroll

    @property
    def compiler_options(self) -> dict:
        """XLA options for the programs that run this hook's steps (its resolved step's; empty until bound)."""
        return {} if self.run is None else self.run.options

    def check(self, shape: CacheShape) -> None:
        """Shape checks against the model and cache (raises ValueError naming the argument)."""
        self.method.validate(shape.head_dim)
        self.row_layout(shape)
        self.placement.check(self.implementation)
        self.placement.check_groups(shape.groups)
        if self.k > shape.capacity:
            raise ValueError(
                f"SparseAttention: k={self.k} is larger than the KV cache capacity {shape.capacity}; "
                f"pass capacity >= {self.k} (generate's default sizes the cache to at least k) or a smaller k")
        c = self.calibration
        if c is not None:
            if not isinstance(c, Calibration):
                raise TypeError(f"SparseAttention: calibration must be a Calibration, got {type(c).__name__}")
            if c.batch_shape != (shape.layers, shape.kv_heads) or c.head_dim != shape.head_dim:
                raise ValueError(
                    f"SparseAttention: calibration has leading axes {c.batch_shape} and head_dim {c.head_dim}; "
                    f"the model needs [n_layers, Hkv] = {(shape.layers, shape.kv_heads)} and head_dim "
                    f"{shape.head_dim}")

    def row_layout(self, shape: CacheShape) -> RowLayout:
        """How a cache of ``shape`` stores its K/V rows (checks the format against the head_dim)."""
        return RowLayout.of(self.rows, shape.head_dim, shape.dtype)

    def bind(self, shape: CacheShape) -> "SparseAttention":
        """This hook for caches of ``shape``: checked, its step configuration resolved (before any tracing)."""
        self.check(shape)
        run = self.step.resolve(self.placement, groups=shape.groups, capacity=round_capacity(shape.capacity),
                                implementation=self.resolved_implementation, layers=shape.layers)
        return dataclasses.replace(self, run=run)

    @property
    def context(self) -> StepContext:
        if self.run is None:
            raise ValueError("SparseAttention: not bound to a cache shape; use the hook that prefill / "
                             "cache_from_dense returned, or attn.bind(shape)")
        return StepContext(k=self.k, run=self.run, sink=self.sink, local=self.local)

    def init_cache(self, shape: CacheShape, *, shared_kv: bool = False) -> SparseCache:
        """An empty cache (zeros) of ``shape.capacity`` tokens per sequence, placed by :attr:`placement`.

        In host memory on a GPU, the pinned memory it will take in XLA's allocator is checked first (see
        :mod:`fathom_jax.placement.host_memory`): a cap too low or regions larger than the machine fail here, before
        anything is allocated. ``shared_kv``: one K/V row buffer for every layer (a benchmark mode).
        """
        options = dict(rows=self.rows, shared_kv=shared_kv, **self._row_cache(shape),
                       session_calibration=_session_template(shape.head_dim) if self.session else None,
                       second_path=self.counts_second_path)
        parts = self.cache_parts(shape.layers)
        if self.placement.in_host_memory:
            shards = self.placement.num_shards
            sizes = [size // shards for size in bulk_allocations(parts, shape, **options)]
            host_memory.check(sizes, devices=self.placement.local_shards,  # this host's share of the mesh
                              what=f"a cache of {round_capacity(shape.capacity)} tokens")
        return allocate(self.placement.zeros, parts, shape, **options)

    def _row_cache(self, shape: CacheShape) -> dict:
        """The row cache's slots and mode (``row_cache="last"``: the union's ``G k`` slots of the previous step)."""
        if self.step.row_cache != "last":
            return dict(row_cache=self.step.row_cache)
        if not shape.query_heads:
            raise ValueError("SparseAttention: step row_cache='last' keeps the previous step's union of G x k rows: "
                             "the cache shape must give its query heads per KV head (CacheShape.query_heads)")
        return dict(row_cache=shape.query_heads * self.k, row_cache_mode="last")

    @property
    def counts_second_path(self) -> bool:
        """Whether the cache counts the steps whose threshold selection took its sorted second path."""
        return self.step.selection == "threshold" and not self.method.selects_all

    def attend_prompt(self, cache: SparseCache, layer, q, keys, values, lengths):
        """The prompt's dense causal attention at ``layer``, and the cache with its rows written
        (:meth:`write_prompt`)."""
        return prefill_attention(q, keys, values), self.write_prompt(cache, layer, keys, values, lengths, q)

    def write_prompt(self, cache: SparseCache, layer, keys, values, lengths, queries=None) -> SparseCache:
        """Prefill: layer ``layer``'s post-RoPE ``keys, values [B, Hkv, T, Dh]`` of sequences of ``lengths [B]``
        written into the cache (K/V rows and the index built from them), wherever it lives. ``queries [B, Hkv, G, T,
        Dh]`` (post-RoPE): what a placement with warm planes chooses them by (the prompt's importance), else unused."""
        b, hkv, t, d = keys.shape
        keys, values = keys.reshape(b * hkv, t, d), values.reshape(b * hkv, t, d)
        lengths = jnp.repeat(jnp.asarray(lengths, jnp.int32), hkv)
        session = None
        if self.session:
            session = calibrate_session(keys.astype(jnp.float32), length=lengths, skip_tokens=self.skip_tokens)
        if not self.placement.warm_planes:
            queries = None
        elif queries is None:
            raise ValueError(f"write_prompt: the placement keeps warm planes (warm_planes={self.placement.warm_planes}),"
                             " chosen from the prompt's queries: pass queries [B, Hkv, G, T, Dh]")
        else:
            queries = queries.reshape(b * hkv, *queries.shape[2:])
        return self.placement.per_group(
            self._write_groups, cache, keys, values, lengths, session, queries, jnp.asarray(layer, jnp.int32),
            axes=(1, 0, 0, 0, 0, 0, None), out_axes=(cache, 1))

    def _write_groups(self, cache, keys, values, lengths, session, queries, layer):
        keys, values = writes_lib.materialized(keys, values)
        if self.rows is not None:  # out-of-range values would come back wrong from the rows (checked at run time)
            valid = (jnp.arange(keys.shape[1]) < lengths[:, None])[..., None]
            self.rows.check_values("write_prompt", jnp.where(valid, keys, 0), jnp.where(valid, values, 0))
        if session is not None:
            cache = dataclasses.replace(cache, calibration=jax.tree.map(lambda a, s: a.at[layer].set(s),
                                                                        cache.calibration, session))
            calib = session
        else:
            calib = self.corpus_calibration(layer, keys.shape[0])
        built = build_index(keys.astype(jnp.float32), calib, cache.index.parts, capacity=cache.capacity, length=lengths)
        importance = None if queries is None else planner_lib.prompt_importance(queries, calib.variance, lengths)
        return writes_lib.write_layer(cache, layer, keys, values, built, self._writer(), importance)

    def start_decode(self, cache: SparseCache, lengths) -> SparseCache:
        """The cache with its per-sequence lengths set after the last prefill layer (placed like the cache's other
        small leaves: a length made elsewhere would be another signature of the step program, compiled again)."""
        length = jnp.asarray(lengths, jnp.int32)
        if not is_traced(length):
            length = jax.device_put(length, self.placement.sharding(1, bulk=False))
        return dataclasses.replace(cache, length=length)

    def positions(self, cache: SparseCache):
        return cache.length

    def attend(self, cache: SparseCache, layer, q, key, value):
        """Sparse attention of the new token's queries ``q [B, Hkv, G, D]`` at layer ``layer`` (inside the layer
        scan); ``key, value [B, Hkv, D]`` are the new token's post-RoPE key and value, not in the cache yet.
        Returns the output and what :meth:`commit` writes after the layer scan. Under a mesh each device runs
        this for its own groups."""
        b, hkv, g, d = q.shape
        r = b * hkv
        out, update = self.placement.per_group(
            self._attend_groups, q.reshape(r, g, d), key.reshape(r, d), value.reshape(r, d), cache.group_length(),
            self.layer_calibration(cache, layer), cache, jnp.asarray(layer, jnp.int32),
            axes=(0, 0, 0, 0, 0, 1, None), out_axes=0)
        return out.reshape(b, hkv, g, -1), update

    def _attend_groups(self, q, key, value, position, calib, cache, layer):
        ctx = self.context
        key, value = writes_lib.materialized(key, value)
        key32 = key.astype(jnp.float32)
        index, views, blocks = cache.index, [], {}
        for part, stacked in zip(index.parts, index.data):
            view, blocks[part.name] = part.add_token(stacked, layer, position, key32)
            views.append(view)
        new = NewToken(position=position, key=key32, value=value, blocks=blocks)
        view = CacheView(index=KeyIndex(index.length[layer], index.parts, tuple(views)), kv=cache.kv,
                         length=position + 1, calib=calib, layer=layer, kv_layer=0 if cache.shared_kv else layer,
                         new=new, row_cache=cache.row_cache, layout=cache.layout)  # the row cache is read in place
        out, _, fill, second_path = sparse_attention_step(self.method, q, view, ctx)
        update = LayerUpdate(key=key, value=value, blocks=blocks, rows=fill, second_path=second_path)
        if ctx.run.in_place:
            # This layer's K/V row and newest blocks go to host memory now: the write kernels depend only on the new
            # key, so they run beside this layer's plane transfers instead of as one serial burst of scattered writes
            # after the scan (the step reads neither: NewToken patches both in).
            write = self._writer()
            writes_lib.write_token(cache, jax.tree.map(lambda a: a[None], update), position, layer, write,
                                   ctx.run.index_writes)
            update = dataclasses.replace(update, written=jnp.concatenate(write.tokens))
        return out, update

    def commit(self, cache: SparseCache, updates: LayerUpdate) -> SparseCache:
        """Write every layer's new K/V row and newest index blocks (``updates`` stacked on [L]) in place.

        A step past the capacity raises (at run time under ``jit``, through a callback that costs nothing
        otherwise): the writes would fall outside the arrays and be dropped.
        """
        store_lib.check_capacity(cache.length, 1, cache.capacity)
        index_writes = self.context.run.index_writes
        return self.placement.per_group(
            lambda c, u, p: writes_lib.commit(c, u, p, self._writer(), index_writes),
            cache, updates, cache.group_length(), axes=(1, 1, 0), out_axes=(cache, 1))

    def flush(self, cache: SparseCache) -> SparseCache:
        """The cache with every layer's partial newest plane block written into the stores (from their raw tails).

        With ``StepConfig(index_writes="full_blocks")`` decode steps write a plane block only once it fills; call
        this (:func:`fathom_jax.decode.flush` as one jitted program) before reading the stores themselves, e.g. to
        save them or compare them with :func:`fathom_jax.index.build_index`. With ``"every_step"`` the stores are
        always complete and this writes the same words again.
        """
        return self.placement.per_group(lambda c: writes_lib.flush(c, self._writer()), cache, axes=(1,),
                                        out_axes=(cache, 1))

    def program(self, fn, cache: SparseCache, *, static: tuple = (), options: dict | None = None):
        """``fn(*static, attention, *args, cache) -> (outs, cache)`` as one compiled program, called as
        ``run(*args, cache=cache) -> (outs, cache)`` (see :mod:`fathom_jax.decode.programs`)."""
        return cache_program(self, fn, cache, static=static, options=options)

    # -- statistics ------------------------------------------------------------------------------
    def layer_calibration(self, cache: SparseCache, layer) -> Calibration | None:
        """This layer's statistics per group ``[R, ...]``: the session's from the cache, or the corpus statistics
        tiled over the batch."""
        if not self.uses_calibration:
            return None
        if self.session:
            return jax.tree.map(lambda a: a[layer], cache.calibration)
        return self.corpus_calibration(layer, cache.groups)

    def corpus_calibration(self, layer, groups: int) -> Calibration | None:
        """The hook's corpus statistics of ``layer`` tiled over ``groups`` groups (None without them)."""
        if self.calibration is None or not self.uses_calibration:
            return None
        calib = jax.tree.map(lambda a: a[layer], self.calibration)
        if calib.batch_shape[0] != groups:
            calib = jax.tree.map(lambda a: jnp.tile(a, (groups // a.shape[0],) + (1,) * (a.ndim - 1)), calib)
        return calib

    def _writer(self) -> writes_lib.Writer:
        return writes_lib.Writer(self.placement.in_host_memory, self.resolved_implementation)


jax.tree_util.register_dataclass(
    SparseAttention, data_fields=["calibration"],
    meta_fields=["method", "k", "calibration_source", "sink", "local", "skip_tokens", "implementation", "placement",
                 "step", "rows", "run"])


@functools.lru_cache(maxsize=None)
def _session_template(head_dim: int) -> Calibration:
    """The shapes of one group's session statistics (what a cache holds per layer and group)."""
    shapes = jax.eval_shape(calibrate_session, jax.ShapeDtypeStruct((1, 2 * SKIP_TOKENS + 2, head_dim), jnp.float32))
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), shapes)


def from_spec(spec: str | ScanMethod, *, k: int, calibration: Calibration | str | None = "session",
              placement: Placement | str | None = None, **fields) -> SparseAttention:
    """The decode attention for a method spec (see :func:`fathom_jax.methods.parse`).

    ``calibration``: ``"session"`` (default: statistics of the prompt's own keys), a :class:`Calibration`
    ``[n_layers, Hkv]`` (corpus), or None; ignored by methods that read no statistics. ``placement``: ``"device"``
    (default) or ``"pinned_host"`` (or a :class:`Placement`). ``fields``: the other fields of
    :class:`SparseAttention` (``sink``, ``local``, ``implementation``, ``step``: how a step runs, ``rows``: the K/V
    row format, None / ``"model"`` for the model dtype, e.g. ``"k8v8"``).
    """
    method = methods_lib.parse(spec)
    if fields.get("step", ...) is None:  # None: the default StepConfig
        del fields["step"]
    common = dict(placement=Placement.parse(placement), **fields)
    if not method.needs_calibration:
        return SparseAttention(method, k, **common)
    if isinstance(calibration, str):
        if calibration != "session":
            raise ValueError(f"calibration must be 'session', a Calibration or None, got {calibration!r}")
        return SparseAttention(method, k, calibration_source="session", **common)
    return SparseAttention(method, k, calibration=calibration, **common)
