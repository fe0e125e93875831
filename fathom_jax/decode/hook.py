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

Only the protocol lives here, so that a feature edits the module that owns it: the static fields and their checks
are :class:`~fathom_jax.decode.spec.AttentionSpec`'s, the cache's allocation and a prompt's writes and statistics
:mod:`fathom_jax.decode.prefill`'s, one layer of a step over the cache :func:`~fathom_jax.decode.step.layer_step`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fathom_jax import store as store_lib
from fathom_jax.calibrate import Calibration
from fathom_jax.checks import is_traced
from fathom_jax.decode import prefill as prefill_lib
from fathom_jax.decode import writes as writes_lib
from fathom_jax.decode.cache import LayerUpdate, SparseCache
from fathom_jax.decode.cache_program import cache_program
from fathom_jax.decode.config import ResolvedStep
from fathom_jax.decode.sharing import LayerSharing, SharedSet
from fathom_jax.decode.spec import (
    AttentionSpec,
    CalibrationSource,
    check_calibration,
    check_calibration_shape,
    parse_spec,
    static,
)
from fathom_jax.decode.step import StepContext, layer_step
from fathom_jax.format import round_capacity
from fathom_jax.methods.base import ScanMethod
from fathom_jax.models.attention import CacheShape
from fathom_jax.models.prompt_attention import PREFILL_MLP_CHUNK, prefill_attention
from fathom_jax.placement import Placement

__all__ = ["CalibrationSource", "SparseAttention", "from_spec"]


@jax.tree_util.register_dataclass  # the static fields say so in their metadata (spec.static)
@dataclasses.dataclass(frozen=True)
class SparseAttention(AttentionSpec):
    """Top-k sparse decode attention driven by a scan method (a callable pytree hook of the decoder).

    Static: the fields of :class:`~fathom_jax.decode.spec.AttentionSpec` (``method``, ``k``, ``calibration_source``,
    ``sink``, ``local``, ``skip_tokens``, ``implementation``, ``placement``, ``step``, ``rows``; checked when built)
    and ``run`` (the step resolved for a cache's shape: set by :meth:`bind`). Traced: ``calibration``, corpus
    statistics with leading axes ``[n_layers, Hkv]``; new arrays of the same shapes reuse the compiled program.

    ``calibration_source="session"`` computes :func:`~fathom_jax.calibrate.calibrate_session` on each sequence's
    prefill keys, per layer, into the cache. Methods without statistics (SparQ, thumbnail, landmark, full 4-bit,
    exact, dense) take neither.
    """

    calibration: Calibration | None = None
    run: ResolvedStep | None = static(None, kw_only=True)
    share: LayerSharing | None = static(None, kw_only=True)  # the sharing bound to a cache's layers (bind)

    ragged = True  # one length per sequence
    mlp_chunk = PREFILL_MLP_CHUNK

    def __post_init__(self):
        # Only static fields and `calibration is None` are checked here: jax rebuilds this object from traced (or
        # placeholder) leaves, so array contents are checked in check().
        super().__post_init__()
        check_calibration(self, self.calibration)

    @property
    def compiler_options(self) -> dict:
        """XLA options for the programs that run this hook's steps (its resolved step's; empty until bound)."""
        return {} if self.run is None else self.run.options

    def check(self, shape: CacheShape) -> None:
        """Shape checks against the model and cache (raises ValueError naming the argument)."""
        super().check(shape)
        check_calibration_shape(self.calibration, shape)

    def bind(self, shape: CacheShape) -> "SparseAttention":
        """This hook for caches of ``shape``: checked, its step configuration resolved (before any tracing)."""
        self.check(shape)
        run = self.step.resolve(self.placement, groups=shape.groups, capacity=round_capacity(shape.capacity),
                                implementation=self.resolved_implementation, layers=shape.layers)
        share = None if self.sharing is None else LayerSharing.bind(self.sharing, shape)
        return dataclasses.replace(self, run=run, share=share)

    @property
    def layer_kinds(self) -> tuple[bool, ...] | None:
        """Whether each cache layer selects (True) or attends the shared set (False), with a selection shared across
        layers; None without one (every layer the same step)."""
        return None if self.share is None else self.share.selects

    @property
    def context(self) -> StepContext:
        if self.run is None:
            raise ValueError("SparseAttention: not bound to a cache shape; use the hook that prefill / "
                             "cache_from_dense returned, or attn.bind(shape)")
        return StepContext(k=self.k, run=self.run, sink=self.sink, local=self.local, share=self.share)

    def init_cache(self, shape: CacheShape, *, shared_kv: bool = False) -> SparseCache:
        """An empty cache (zeros) of ``shape.capacity`` tokens per sequence, placed by :attr:`placement`.

        In host memory on a GPU, the pinned memory it will take in XLA's allocator is checked first (see
        :mod:`fathom_jax.placement.host_memory`): a cap too low or regions larger than the machine fail here, before
        anything is allocated. ``shared_kv``: one K/V row buffer for every layer (a benchmark mode).
        """
        return prefill_lib.empty_cache(self, shape, shared_kv=shared_kv)

    def attend_prompt(self, cache: SparseCache, layer, q, keys, values, lengths):
        """The prompt's dense causal attention at ``layer``, and the cache with its rows written
        (:meth:`write_prompt`)."""
        return prefill_attention(q, keys, values), self.write_prompt(cache, layer, keys, values, lengths, q)

    def write_prompt(self, cache: SparseCache, layer, keys, values, lengths, queries=None) -> SparseCache:
        """Prefill: layer ``layer``'s post-RoPE ``keys, values [B, Hkv, T, Dh]`` of sequences of ``lengths [B]``
        written into the cache (K/V rows and the index built from them), wherever it lives. ``queries [B, Hkv, G, T,
        Dh]`` (post-RoPE): what a placement with warm planes chooses them by (the prompt's importance), else unused."""
        return prefill_lib.write_prompt(self, cache, layer, keys, values, lengths, queries)

    def start_decode(self, cache: SparseCache, lengths) -> SparseCache:
        """The cache with its per-sequence lengths set after the last prefill layer (placed like the cache's other
        small leaves: a length made elsewhere would be another signature of the step program, compiled again)."""
        length = jnp.asarray(lengths, jnp.int32)
        if not is_traced(length):
            length = jax.device_put(length, self.placement.sharding(1, bulk=False))
        return dataclasses.replace(cache, length=length)

    def positions(self, cache: SparseCache):
        return cache.length

    def decode_carry(self, cache: SparseCache) -> SharedSet | None:
        """The positions a shared selection's last selection layer chose (None without sharing)."""
        return None if self.share is None else SharedSet.empty(cache.batch, self.share.selection.budget)

    def attend(self, cache: SparseCache, layer, q, key, value, carry=None, kind=None):
        """Sparse attention of the new token's queries ``q [B, Hkv, G, D]`` at layer ``layer`` (inside the layer
        scan); ``key, value [B, Hkv, D]`` are the new token's post-RoPE key and value, not in the cache yet.
        Returns the output, what :meth:`commit` writes after the layer scan and the carry (a shared selection's
        set). ``kind``: ``layer_kinds[layer]`` where the caller knows it (a shared selection's layer then runs its
        own program, with no branch on the traced layer). Under a mesh each device runs this for its own groups."""
        b, hkv, g, d = q.shape
        r = b * hkv
        step = functools.partial(layer_step, self.method, self.context, writes_lib.writer(self), selects=kind)
        out, update, carry = self.placement.per_group(
            step, q.reshape(r, g, d), key.reshape(r, d), value.reshape(r, d), cache.group_length(),
            prefill_lib.layer_calibration(self, cache, layer), cache, jnp.asarray(layer, jnp.int32), carry,
            axes=(0, 0, 0, 0, 0, 1, None, None), out_axes=0)
        return out.reshape(b, hkv, g, -1), update, carry

    def commit(self, cache: SparseCache, updates: LayerUpdate) -> SparseCache:
        """Write every layer's new K/V row and newest index blocks (``updates`` stacked on [L]) in place.

        A step past the capacity raises (at run time under ``jit``, through a callback that costs nothing
        otherwise): the writes would fall outside the arrays and be dropped.
        """
        store_lib.check_capacity(cache.length, 1, cache.capacity)
        index_writes = self.context.run.index_writes
        return self.placement.per_group(
            lambda c, u, p: writes_lib.commit(c, u, p, writes_lib.writer(self), index_writes),
            cache, updates, cache.group_length(), axes=(1, 1, 0), out_axes=(cache, 1))

    def flush(self, cache: SparseCache) -> SparseCache:
        """The cache with every layer's partial newest plane block written into the stores (from their raw tails).

        With ``StepConfig(index_writes="full_blocks")`` decode steps write a plane block only once it fills; call
        this (:func:`fathom_jax.decode.flush` as one jitted program) before reading the stores themselves, e.g. to
        save them or compare them with :func:`fathom_jax.index.build_index`. With ``"every_step"`` the stores are
        always complete and this writes the same words again.
        """
        return self.placement.per_group(lambda c: writes_lib.flush(c, writes_lib.writer(self)), cache, axes=(1,),
                                        out_axes=(cache, 1))

    def program(self, fn, cache: SparseCache, *, static: tuple = (), options: dict | None = None):
        """``fn(*static, attention, *args, cache) -> (outs, cache)`` as one compiled program, called as
        ``run(*args, cache=cache) -> (outs, cache)`` (see :mod:`fathom_jax.decode.programs`)."""
        return cache_program(self, fn, cache, static=static, options=options)


def from_spec(spec: str | ScanMethod, *, k: int, calibration: Calibration | str | None = "session",
              placement: Placement | str | None = None, **fields) -> SparseAttention:
    """The decode attention for a method spec (see :func:`fathom_jax.methods.parse`).

    ``calibration``: ``"session"`` (default: statistics of the prompt's own keys), a :class:`Calibration`
    ``[n_layers, Hkv]`` (corpus), or None; ignored by methods that read no statistics. ``placement``: ``"device"``
    (default) or ``"pinned_host"`` (or a :class:`Placement`). ``fields``: the other fields of
    :class:`SparseAttention` (``sink``, ``local``, ``implementation``, ``step``: how a step runs, ``rows``: the K/V
    row format, None / ``"model"`` for the model dtype, e.g. ``"k8v8"``).
    """
    return SparseAttention(**parse_spec(spec, k=k, calibration=calibration, placement=placement, **fields))
