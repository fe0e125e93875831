"""Sparse decoding with any scan method: the decoder's attention hook and the cache it reads.

    from fathom_jax import decode, methods
    attn = decode.SparseAttention(methods.Fathom(48), k=128, calibration=calib)   # corpus: calib [L, Hkv]
    attn = decode.from_spec("fathom_klt:48", k=128)                              # session calibration
    attn = decode.from_spec("fathom:48", k=512, placement="pinned_host")          # offloaded
    ids = generate(model, prompt, 64, attention_fn=attn)                         # fathom_jax.models

:class:`SparseCache` holds every layer's K/V rows and key index stacked ``[L, R, ...]`` (``R = batch x KV
heads``, sequence-major), bulk arrays where the placement puts them (HBM or ``pinned_host``), and one
length per sequence: a batch of different lengths decodes together.

A decode step (``fathom_jax.models.sparse``) runs all layers in one ``lax.scan``; per layer the hook's
:meth:`SparseAttention.attend` computes the new token's block of every index part in device memory
(:class:`~fathom_jax.sparse_step.NewToken`) and runs the one sparse step (plan, read, scan, select,
union, fetch, attend). The stored cache is written once per step, after the layer scan
(:meth:`SparseAttention.commit`: the new K/V row and the newest block's plane words of every layer, in
place), so the host arrays are loop invariants of the layer scan, read only by the kernels.
Calibration is a constant of the hook (corpus statistics, or the session's own prefill statistics
set once by :meth:`SparseAttention.with_calibration`), not decode state.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from fathom_jax import host_memory
from fathom_jax import landmarks as landmarks_lib
from fathom_jax import methods as methods_lib
from fathom_jax import store as store_lib
from fathom_jax.calibrate import SKIP_TOKENS, Calibration, calibrate_session
from fathom_jax.format import BLOCK_TOKENS, LANDMARK_TOKENS, N_PLANES, WORDS_PER_BLOCK, plane_words, round_capacity
from fathom_jax.index import KeyIndex, build_index
from fathom_jax.methods.base import ScanMethod
from fathom_jax.placement import Placement
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS
from fathom_jax.sparse_cache import (  # noqa: F401  (part of this API)
    LayerUpdate, RowCache, SparseCache, cache_bytes, commit_rows, empty_row_cache, join_kv)
from fathom_jax.sparse_step import NewToken, sparse_attention_step
from fathom_jax.store import KeyRotation, PlaneStore
from pallas_kernels import backend
from pallas_kernels.cache_write import cache_write, cache_write_in_place
from pallas_kernels.topk import TopkConfig

CalibrationSource = Literal["corpus", "session"]
_SOURCES = ("corpus", "session")
PLANE_PARTS = ("raw", "klt", "loki")


@dataclasses.dataclass(frozen=True)
class SparseAttention:
    """Top-k sparse decode attention driven by a scan method (a callable pytree hook of the decoder).

    Static: ``method``, ``k`` (tokens per query head, sinks and local window included),
    ``calibration_source``, ``sink``, ``local``, ``skip_tokens``, ``implementation`` (None: pallas on a
    GPU, xla elsewhere), ``placement`` (where the cache lives), ``topk`` (the top-k kernels' configuration;
    None: their defaults). Traced: ``calibration``, a
    :class:`Calibration` with leading axes ``[n_layers, Hkv]`` (corpus) or ``[n_layers, batch x Hkv]``
    (the session's own, set after prefill); new arrays of the same shapes reuse the compiled program.

    ``calibration_source="session"`` computes :func:`calibrate_session` on each sequence's prefill keys
    (per layer, during prefill). Methods without statistics (SparQ, thumbnail, landmark, full 4-bit,
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
    topk: TopkConfig | None = None

    def __post_init__(self):
        # Only static fields and `calibration is None` are checked here: jax rebuilds this object from
        # traced (or placeholder) leaves, so array contents are checked in check().
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
        if self.topk is not None and not isinstance(self.topk, TopkConfig):
            raise TypeError(f"SparseAttention: topk must be a pallas_kernels.topk.TopkConfig or None, got {self.topk!r}")
        if not isinstance(self.placement, Placement):
            object.__setattr__(self, "placement", Placement.parse(self.placement))
        if self.placement.row_cache and self.method.selects_all:
            raise ValueError(f"SparseAttention: placement row_cache={self.placement.row_cache} caches selected rows, "
                             f"and {self.method.label} selects every row (use row_cache=0)")
        if self.calibration_source not in _SOURCES:
            raise ValueError(
                f"SparseAttention: calibration_source must be one of {_SOURCES}, got {self.calibration_source!r}"
            )
        if self.uses_calibration and self.calibration_source == "corpus" and self.calibration is None:
            raise ValueError(
                f"SparseAttention: {self.method.label} needs calibration statistics: pass calibration= "
                "(a Calibration [n_layers, Hkv] from fathom_jax.calibrate.calibrate) or "
                "calibration_source='session'"
            )

    # -- description ---------------------------------------------------------------------------
    @property
    def uses_calibration(self) -> bool:
        return self.method.needs_calibration

    @property
    def label(self) -> str:
        src = f", {self.calibration_source} calibration" if self.uses_calibration else ""
        where = f", {self.placement.memory}" if self.placement.offloaded else ""
        return f"{self.method.label}, k={self.k}{src}{where}"

    @property
    def resolved_implementation(self) -> backend.Implementation:
        return self.placement.check(self.implementation)

    def with_calibration(self, calibration: Calibration | None) -> "SparseAttention":
        """The same hook with ``calibration`` (the session statistics computed during prefill)."""
        return dataclasses.replace(self, calibration=calibration)

    @property
    def index_parts(self) -> frozenset[str]:
        return self.method.parts - {"keys"}

    def check(self, *, n_layers: int, hkv: int, groups: int, capacity: int, head_dim: int) -> None:
        """Shape checks against the model and cache (raises ValueError naming the argument)."""
        self.method.validate(head_dim)
        self.placement.check(self.implementation)
        self.placement.check_groups(groups)
        if self.k > capacity:
            raise ValueError(
                f"SparseAttention: k={self.k} is larger than the KV cache capacity {capacity}; "
                f"pass capacity >= {self.k} (generate's default sizes the cache to at least k) or a smaller k"
            )
        c = self.calibration
        if c is not None:
            if not isinstance(c, Calibration):
                raise TypeError(f"SparseAttention: calibration must be a Calibration, got {type(c).__name__}")
            if c.batch_shape not in ((n_layers, hkv), (n_layers, groups)) or c.head_dim != head_dim:
                raise ValueError(
                    f"SparseAttention: calibration has leading axes {c.batch_shape} and head_dim {c.head_dim}; "
                    f"the model needs [n_layers, Hkv] = {(n_layers, hkv)} and head_dim {head_dim}"
                )

    # -- the cache ---------------------------------------------------------------------------
    def init_cache(self, *, n_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                   dtype, shared_kv: bool = False) -> SparseCache:
        """An empty cache (zeros) of ``capacity`` tokens per sequence, placed by :attr:`placement`.

        In host memory on a GPU, the pinned memory it will take in XLA's allocator is checked first (see
        :mod:`fathom_jax.host_memory`): a cap too low or regions larger than the machine fail here, before
        anything is allocated.
        """
        dims = dict(n_layers=n_layers, batch=batch, kv_heads=kv_heads, capacity=round_capacity(capacity),
                    head_dim=head_dim, dtype=dtype, shared_kv=shared_kv)
        if self.placement.memory_kind == "pinned_host":
            shards = self.placement.num_shards
            allocations = []

            def record(shape, dtype, *, bulk=True):
                if bulk:
                    allocations.append(math.prod(shape) * np.dtype(dtype).itemsize // shards)
                return jax.ShapeDtypeStruct(shape, dtype)

            self._build_cache(record, **dims)  # shapes only, in allocation order
            host_memory.check(allocations, devices=shards, what=f"a cache of {dims['capacity']} tokens")
        return self._build_cache(self.placement.zeros, **dims)

    def _build_cache(self, zeros, *, n_layers, batch, kv_heads, capacity, head_dim, dtype, shared_kv):
        r, d = batch * kv_heads, head_dim
        # Largest array first: XLA's pinned host allocator grows in regions of doubling size, and K/V rows
        # allocated after the planes left no region for them at 1M tokens (see NOTES.md).
        kv_layers = 1 if shared_kv else n_layers
        kv = zeros((kv_layers, r, capacity, 2 * d), dtype)  # each token's K and V side by side: one run to fetch
        small = lambda shape, dtype: zeros(shape, dtype, bulk=False)  # noqa: E731
        lengths = small((n_layers, r), jnp.int32)
        parts = self.index_parts

        def store(rotated: bool):
            rotation = None
            if rotated:
                rotation = KeyRotation(mean=small((n_layers, r, d), jnp.float32),
                                       basis=small((n_layers, r, d, d), jnp.float32))
            return PlaneStore(
                planes=zeros((n_layers, r, d, N_PLANES, plane_words(capacity)), jnp.uint32),
                scales=zeros((n_layers, r, d, capacity // BLOCK_TOKENS), jnp.float16),
                tail=small((n_layers, r, BLOCK_TOKENS, d), jnp.float32), length=lengths, rotation=rotation,
            )

        index = KeyIndex(
            length=lengths,
            raw=store(False) if "raw" in parts else None,
            klt=store(True) if "klt" in parts else None,
            loki=store(True) if "loki" in parts else None,
            landmarks=zeros((n_layers, r, capacity // LANDMARK_TOKENS, d), jnp.float16) if "landmarks" in parts else None,
            landmark_tail=small((n_layers, r, LANDMARK_TOKENS, d), jnp.float32) if "landmarks" in parts else None,
        )
        writes = 1 + 2 * len(index.stores) + (index.landmarks is not None)
        row_cache = None
        if self.placement.row_cache:
            row_cache = empty_row_cache(small, n_layers=n_layers, groups=r, slots=self.placement.row_cache,
                                        head_dim=d, dtype=dtype)
        return SparseCache(kv=kv, index=index, length=small((batch,), jnp.int32), writes=small((writes,), jnp.int32),
                           row_cache=row_cache)

    def _writer(self):
        """``write(dst, src, start, axis, layer) -> new dst``, collecting in-place write tokens in ``tokens``."""
        impl = self.resolved_implementation
        tokens = []

        def write(dst, src, start, axis, layer=0):
            if self.placement.writes_in_place:
                tokens.append(cache_write_in_place(dst, src, start, axis=axis, layer=layer))
                return dst
            return cache_write(dst, src, start, axis=axis, layer=layer, implementation=impl)

        return write, tokens

    def layer_calibration(self, layer, groups: int) -> Calibration | None:
        """This layer's statistics per group ``[R, ...]`` (corpus statistics tiled over the batch)."""
        if self.calibration is None or not self.uses_calibration:
            return None
        calib = jax.tree.map(lambda a: a[layer], self.calibration)
        if calib.batch_shape[0] != groups:
            calib = jax.tree.map(lambda a: jnp.tile(a, (groups // a.shape[0],) + (1,) * (a.ndim - 1)), calib)
        return calib

    def write_layer(self, cache: SparseCache, layer, keys: Float[Array, "R T Dh"], values: Float[Array, "R T Dh"],
                    length: Int[Array, "R"], calib: Calibration | None) -> SparseCache:
        """Prefill: layer ``layer``'s K/V rows and index (built from ``keys``, post-RoPE) written in place."""
        return self.placement.per_group(
            functools.partial(self._write_groups, shared_kv=cache.shared_kv), cache, keys, values, length, calib,
            jnp.asarray(layer, jnp.int32), axes=(1, 0, 0, 0, 0, None), out_axes=(cache, 1),
        )

    def _write_groups(self, cache, keys, values, length, calib, layer, *, shared_kv):
        keys, values = _materialized(keys, values)
        zero = jnp.zeros_like(length)
        put, tokens = self._writer()
        write = lambda dst, src, axis: put(dst, src[None], zero, axis, layer)  # noqa: E731
        kv_layer = 0 if shared_kv else layer
        kv = put(cache.kv, join_kv(keys, values, cache.kv.dtype)[None], zero, 2, kv_layer)
        built = build_index(keys.astype(jnp.float32), calib, (self.method,), capacity=cache.capacity, length=length,
                            parts=self.index_parts)
        set_small = lambda dst, src: dst.at[layer].set(src.astype(dst.dtype))  # noqa: E731
        lengths = set_small(cache.index.length, built.length)

        def store(old: PlaneStore | None, new: PlaneStore | None):
            if old is None:
                return None
            rotation = None
            if old.rotation is not None:
                rotation = KeyRotation(mean=set_small(old.rotation.mean, new.rotation.mean),
                                       basis=set_small(old.rotation.basis, new.rotation.basis))
            return PlaneStore(planes=write(old.planes, new.planes, 4), scales=write(old.scales, new.scales, 3),
                              tail=set_small(old.tail, new.tail), length=lengths, rotation=rotation)

        old = cache.index
        landmarks = landmark_tail = None
        if old.landmarks is not None:
            landmarks = write(old.landmarks, built.landmarks, 2)
            landmark_tail = set_small(old.landmark_tail, built.landmark_tail)
        index = KeyIndex(length=lengths, raw=store(old.raw, built.raw), klt=store(old.klt, built.klt),
                         loki=store(old.loki, built.loki), landmarks=landmarks, landmark_tail=landmark_tail)
        row_cache = cache.row_cache
        if row_cache is not None:  # the layer's rows are new: its slots are emptied
            row_cache = dataclasses.replace(row_cache, tags=row_cache.tags.at[layer].set(0))
        return SparseCache(kv=kv, index=index, length=cache.length, writes=_tokens(tokens, cache.writes),
                           row_cache=row_cache)

    def prefilled(self, cache: SparseCache, lengths: Int[Array, "B"]) -> SparseCache:
        """The cache with its per-sequence lengths set after the last prefill layer."""
        return dataclasses.replace(cache, length=jnp.asarray(lengths, jnp.int32))

    def session_calibration(self, keys: Float[Array, "R T D"], length: Int[Array, "R"]) -> Calibration | None:
        """The session statistics of one layer's prefill keys (None unless ``calibration_source="session"``)."""
        if not (self.uses_calibration and self.calibration_source == "session"):
            return None
        return calibrate_session(keys.astype(jnp.float32), length=length, skip_tokens=self.skip_tokens)

    # -- one decode step, per layer ----------------------------------------------------------
    def attend(self, q: Float[Array, "R G D"], key: Float[Array, "R D"], value: Float[Array, "R D"],
               cache: SparseCache, layer) -> tuple[Float[Array, "R G D"], LayerUpdate]:
        """Sparse attention of the new token's queries at layer ``layer`` (inside the layer scan).

        ``key`` / ``value`` are the new token's post-RoPE key and value; the cache does not hold them yet.
        Returns the attention output and what :meth:`commit` writes after the layer scan. Under a mesh each
        device runs this for its own groups.
        """
        return self.placement.per_group(
            functools.partial(self._attend_groups, shared_kv=cache.shared_kv),
            q, key, value, cache.group_length(), self.layer_calibration(layer, cache.groups), cache,
            jnp.asarray(layer, jnp.int32), axes=(0, 0, 0, 0, 0, 1, None), out_axes=0,
        )

    def _attend_groups(self, q, key, value, position, calib, cache, layer, *, shared_kv):
        small = lambda a: a[layer]  # noqa: E731
        index = cache.index
        key, value = _materialized(key, value)
        key32 = key.astype(jnp.float32)
        blocks, view = {}, {"length": small(index.length)}
        for part in PLANE_PARTS:
            store = getattr(index, part)
            if store is None:
                continue
            rotation = None if store.rotation is None else jax.tree.map(small, store.rotation)
            rotated = store_lib.rotate_keys(key32[:, None, :], rotation)[:, 0]
            words, scale, tail = jax.vmap(store_lib.append_block)(small(store.tail), position, rotated)
            blocks[part] = (words, scale, tail)
            view[part] = PlaneStore(planes=store.planes, scales=store.scales, tail=tail, length=position + 1,
                                    rotation=rotation)
        landmark = None
        if index.landmarks is not None:
            landmark = jax.vmap(landmarks_lib.append_block)(small(index.landmark_tail), position, key32)
            view["landmarks"], view["landmark_tail"] = index.landmarks, landmark[1]
        new = NewToken(position=position, key=key32, value=value, blocks={p: b[:2] for p, b in blocks.items()},
                       landmark=None if landmark is None else landmark[0])
        out, _, *fill = sparse_attention_step(
            self.method, q, KeyIndex(**view), cache.kv, position + 1, calib,
            k=self.k, sink=self.sink, local=self.local, layer=layer, kv_layer=0 if shared_kv else layer,
            new=new, placement=self.placement, implementation=self.resolved_implementation, topk=self.topk,
            row_cache=cache.row_cache,  # stacked: the step reads it at this layer in place
        )
        update = LayerUpdate(key=key, value=value, blocks=blocks, landmark=landmark, rows=fill[0] if fill else None)
        if self.placement.writes_in_scan:
            # This layer's K/V row and newest blocks go to host memory now: the write kernels depend only on
            # the new key, so they run beside this layer's plane transfers instead of as one serial burst of
            # scattered writes after the scan (the step reads neither: NewToken patches both in).
            stacked = jax.tree.map(lambda a: a[None], update)
            *_, tokens = self._write_new_token(cache, stacked, position, layer, shared_kv=shared_kv)
            update = dataclasses.replace(update, written=jnp.concatenate(tokens))
        return out, update

    def commit(self, cache: SparseCache, update: LayerUpdate) -> SparseCache:
        """Write every layer's new K/V row and newest index blocks (``update`` stacked on [L]) in place.

        A step past the capacity raises (at run time under ``jit``, through a callback that costs nothing
        otherwise): the writes would fall outside the arrays and be dropped.
        """
        store_lib.check_capacity(cache.length, 1, cache.capacity)
        return self.placement.per_group(
            functools.partial(self._commit_groups, shared_kv=cache.shared_kv), cache, update, cache.group_length(),
            axes=(1, 1, 0), out_axes=(cache, 1),
        )

    def _commit_groups(self, cache, update, p, *, shared_kv):
        index = cache.index
        if update.written is None:
            kv, blocks, landmarks, tokens = self._write_new_token(cache, update, p, 0, shared_kv=shared_kv)
            writes = _tokens(tokens, cache.writes)
        else:  # each layer wrote its own in the layer scan: only the small leaves change here
            kv, landmarks = cache.kv, index.landmarks
            blocks = {part: (store.planes, store.scales) for part in PLANE_PARTS
                      if (store := getattr(index, part)) is not None}
            writes = jnp.sum(update.written, axis=0)  # depends on every layer's writes
        lengths = index.length + 1

        def store(old: PlaneStore | None, part: str):
            if old is None:
                return None
            planes, scales = blocks[part]
            return PlaneStore(planes=planes, scales=scales, tail=update.blocks[part][2], length=lengths,
                              rotation=old.rotation)

        landmark_tail = None if update.landmark is None else update.landmark[1]
        index = KeyIndex(length=lengths, raw=store(index.raw, "raw"), klt=store(index.klt, "klt"),
                         loki=store(index.loki, "loki"), landmarks=landmarks, landmark_tail=landmark_tail)
        row_cache = cache.row_cache
        if update.rows is not None:
            row_cache = commit_rows(row_cache, update.rows)
        return SparseCache(kv=kv, index=index, length=cache.length + 1, writes=writes, row_cache=row_cache)

    def _write_new_token(self, cache, update: LayerUpdate, p, layer, *, shared_kv):
        """Write the new token's K/V rows and newest index blocks (``update`` stacked on layers ``layer ..``) at
        group positions ``p [R]`` into the bulk arrays. Returns ``(kv, {part: (planes, scales)}, landmarks,
        in-place write tokens)``: new arrays for functional updates, the same ones when written in place."""
        put, tokens = self._writer()
        write = lambda dst, src, start, axis: put(dst, src, start, axis, layer)  # noqa: E731
        rows = join_kv(update.key, update.value, cache.kv.dtype)  # [Ls, R, 2 Dh]
        if shared_kv:  # one row buffer for every layer keeps the last layer's row (others drop past the end)
            last = jnp.asarray(layer) + rows.shape[0] == cache.n_layers
            kv = put(cache.kv, rows[-1:, :, None, :], jnp.where(last, p, cache.capacity), 2, 0)
        else:
            kv = write(cache.kv, rows[:, :, None, :], p, 2)
        # "full_blocks": only a block this step fills is written; a partial one stays in the stores' tails
        due = (p + 1) % BLOCK_TOKENS == 0 if self.placement.index_writes == "full_blocks" else True
        index = cache.index
        blocks = {}
        for part in PLANE_PARTS:
            old = getattr(index, part)
            if old is not None:
                words, scale, _ = update.blocks[part]
                blocks[part] = _write_block(write, old, words, scale, p // BLOCK_TOKENS, due)
        landmarks = index.landmarks
        if landmarks is not None:
            landmarks = write(landmarks, update.landmark[0][:, :, None, :], p // LANDMARK_TOKENS, 2)
        return kv, blocks, landmarks, tokens

    def flush(self, cache: SparseCache) -> SparseCache:
        """The cache with every layer's partial newest plane block written into the stores (from their raw tails).

        With ``placement.index_writes="full_blocks"`` decode steps write a plane block only once it fills; call
        this (``fathom_jax.models.sparse.flush`` as one jitted program) before reading the stores themselves,
        e.g. to save them or compare them with :func:`fathom_jax.index.build_index`. With ``"every_step"`` the
        stores are always complete and this writes the same words again.
        """
        return self.placement.per_group(self._flush_groups, cache, cache.group_length(), axes=(1, 0),
                                        out_axes=(cache, 1))

    def _flush_groups(self, cache, length):
        write, tokens = self._writer()
        count = length % BLOCK_TOKENS
        pack = jax.vmap(jax.vmap(store_lib.pack_block), in_axes=(0, None))  # over layers, then groups

        def store(old: PlaneStore | None):
            if old is None:
                return None
            words, scale = pack(old.tail, count)
            planes, scales = _write_block(write, old, words, scale, length // BLOCK_TOKENS, count > 0)
            return dataclasses.replace(old, planes=planes, scales=scales)

        index = cache.index
        index = dataclasses.replace(index, raw=store(index.raw), klt=store(index.klt), loki=store(index.loki))
        return dataclasses.replace(cache, index=index, writes=_tokens(tokens, cache.writes))


def _write_block(write, store: PlaneStore, words, scale, block, due):
    """``store``'s planes and scales with each group's 64-token block number ``block [R]`` written where ``due``
    (words ``[L, R, D, 4, 2]``, scales ``[L, R, D]``); elsewhere the block index is past the end and the
    writes drop out."""
    block = jnp.where(due, block, store.scales.shape[-1])
    return write(store.planes, words, block * WORDS_PER_BLOCK, 4), write(store.scales, scale[..., None], block, 3)


def _materialized(keys, values):
    """``keys, values`` computed once: both the stored K/V rows and the index are built from these bits. Without
    the barrier XLA may fuse the elementwise producers (RoPE) into each consumer, and on a GPU two fusions can
    contract multiply-adds differently, so the index could quantize other key bits than the rows hold."""
    return jax.lax.optimization_barrier((keys, values))


def _tokens(tokens, previous):
    """The completion tokens of this program's in-place writes (or the previous ones when it made none)."""
    return jnp.concatenate(tokens) if tokens else previous


jax.tree_util.register_dataclass(
    SparseAttention,
    data_fields=["calibration"],
    meta_fields=["method", "k", "calibration_source", "sink", "local", "skip_tokens", "implementation", "placement",
                 "topk"],
)


def from_spec(
    spec: str | ScanMethod,
    *,
    k: int,
    calibration: Calibration | str | None = "session",
    sink: int = SINK_TOKENS,
    local: int = LOCAL_TOKENS,
    implementation: backend.Implementation | None = None,
    placement: Placement | str | None = None,
) -> SparseAttention:
    """The decode attention for a method spec (see :func:`fathom_jax.methods.parse`).

    ``calibration``: ``"session"`` (default: statistics of the prompt's own keys), a :class:`Calibration`
    ``[n_layers, Hkv]`` (corpus), or None; ignored by methods that read no statistics. ``placement``:
    ``"device"`` (default) or ``"pinned_host"``.
    """
    method = methods_lib.parse(spec)
    common = dict(sink=sink, local=local, implementation=implementation, placement=Placement.parse(placement))
    if not method.needs_calibration:
        return SparseAttention(method, k, **common)
    if isinstance(calibration, str):
        if calibration != "session":
            raise ValueError(f"calibration must be 'session', a Calibration or None, got {calibration!r}")
        return SparseAttention(method, k, calibration_source="session", **common)
    return SparseAttention(method, k, calibration=calibration, **common)
