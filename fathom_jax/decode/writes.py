"""Writing a stacked cache: a prefill's layer, a decode step's new token, the commit after the layer scan, a flush.

In device memory every write is functional (XLA updates the donated buffers in place); in real host memory the
``cache_write`` kernel writes in place as a side effect and returns a completion token, which the program's outputs
depend on (:class:`Writer` returns it with each write, and so does every index part's write, by which the functions
here gather them). Every index part writes its own data (:mod:`fathom_jax.index.parts`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fathom_jax.decode.cache import LayerUpdate, SparseCache
from fathom_jax.decode.row_cache import commit_rows
from fathom_jax.format import BLOCK_TOKENS
from fathom_jax.index import KeyIndex
from pallas_kernels.cache_write import cache_write, cache_write_in_place
from pallas_kernels.operands import LayerTiers
from pallas_kernels.tier_write import tier_write, tier_write_in_place

Tokens = tuple  # the completion tokens of in-place writes, in the order they were made (none for functional ones)


@dataclasses.dataclass(frozen=True)
class Writer:
    """``write(dst, src, start, axis, layer) -> (dst, tokens)`` (and ``write.tiers`` for a tiered plane store): in
    place (``dst`` itself and the kernel's completion token) or functionally by the kernel or its reference (the new
    array and no token). Tokens are returned, never kept: a writer holds no state, so one traced twice (or reused
    across programs) cannot leak a token of one trace into another."""

    in_place: bool
    implementation: str

    def __call__(self, dst, src, start, axis, layer=0) -> tuple[object, Tokens]:
        if self.in_place:
            return dst, (cache_write_in_place(dst, src, start, axis=axis, layer=layer),)
        return cache_write(dst, src, start, axis=axis, layer=layer, implementation=self.implementation), ()

    def tiers(self, tiers: LayerTiers, src, start) -> tuple[tuple, Tokens]:
        """``((hot, cold), tokens)`` with plane words ``src [Ls, R, D, 4, M]`` of layers ``tiers.layer ..`` written
        into a tiered store's tiers (:mod:`pallas_kernels.tier_write`): one launch for every plane."""
        if self.in_place:
            return (tiers.hot, tiers.cold), (tier_write_in_place(tiers, src, start),)
        return tier_write(tiers, src, start, implementation=self.implementation), ()


def done(tokens: Tokens, previous):
    """The completion tokens of a program's in-place writes as one array (or the previous ones when it made none)."""
    return jnp.concatenate(tokens) if tokens else previous


def materialized(keys, values):
    """``keys, values`` computed once: both the stored K/V rows and the index are built from these bits. Without the
    barrier XLA may fuse the elementwise producers (RoPE) into each consumer, and on a GPU two fusions can contract
    multiply-adds differently, so the index could quantize other key bits than the rows hold."""
    return jax.lax.optimization_barrier((keys, values))


def write_layer(cache: SparseCache, layer, keys, values, built: KeyIndex, write: Writer, importance=None
                ) -> SparseCache:
    """Prefill: layer ``layer``'s K/V rows (``keys, values [R, T, Dh]``) and its ``built`` index written;
    ``importance [R, D]``: the prompt's, for plane stores that choose warm planes by it."""
    zero = jnp.zeros(keys.shape[:1], jnp.int32)
    kv, tokens = write(cache.kv, cache.layout.join(keys, values)[None], zero, 2, 0 if cache.shared_kv else layer)
    length = cache.index.length.at[layer].set(built.length)
    data = []
    for part, stacked, new in zip(cache.index.parts, cache.index.data, built.data):
        part_data, part_tokens = part.write_layer(write, stacked, new, layer, length, importance=importance)
        data.append(part_data)
        tokens += part_tokens
    row_cache = cache.row_cache
    if row_cache is not None:  # the layer's rows are new: its slots are emptied
        row_cache = dataclasses.replace(row_cache, tags=row_cache.tags.at[layer].set(0))
    return dataclasses.replace(cache, kv=kv, index=KeyIndex(length, cache.index.parts, tuple(data)),
                               writes=done(tokens, cache.writes), row_cache=row_cache)


def write_token(cache: SparseCache, update: LayerUpdate, position, layer, write: Writer, index_writes: str):
    """The new token's K/V rows and newest index blocks (``update`` stacked on layers ``layer ..``) written at group
    positions ``position [R]`` into the bulk arrays; returns ``(kv, index data, tokens)``: new arrays for functional
    writes, the same ones and the writes' completion tokens when written in place."""
    rows = cache.layout.join(update.key, update.value)  # [Ls, R, W]
    if cache.shared_kv:  # one row buffer for every layer keeps the last layer's row (others drop past the end)
        last = jnp.asarray(layer) + rows.shape[0] == cache.n_layers
        kv, tokens = write(cache.kv, rows[-1:, :, None, :], jnp.where(last, position, cache.capacity), 2, 0)
    else:
        kv, tokens = write(cache.kv, rows[:, :, None, :], position, 2, layer)
    # "full_blocks": only a block this step fills is written; a partial one stays in the stores' tails
    due = (position + 1) % BLOCK_TOKENS == 0 if index_writes == "full_blocks" else True
    data = []
    for part, stacked in zip(cache.index.parts, cache.index.data):
        part_data, part_tokens = part.write_token(write, stacked, update.blocks[part.name], position, layer, due)
        data.append(part_data)
        tokens += part_tokens
    return kv, tuple(data), tokens


def commit(cache: SparseCache, update: LayerUpdate, position, write: Writer, index_writes: str) -> SparseCache:
    """Every layer's step (``update`` stacked on [L]) into the cache: the bulk writes unless each layer made them
    in the layer scan (``update.written``), then the small leaves (tails, lengths, row-cache slots)."""
    if update.written is None:
        kv, data, tokens = write_token(cache, update, position, 0, write, index_writes)
        writes = done(tokens, cache.writes)
    else:
        kv, data = cache.kv, cache.index.data
        writes = jnp.sum(update.written, axis=0)  # depends on every layer's writes
    length = cache.index.length + 1
    data = tuple(part.commit(stacked, update.blocks[part.name], length) for part, stacked in zip(cache.index.parts, data))
    row_cache = cache.row_cache if update.rows is None else commit_rows(cache.row_cache, update.rows)
    return dataclasses.replace(cache, kv=kv, index=KeyIndex(length, cache.index.parts, data), length=cache.length + 1,
                               writes=writes, row_cache=row_cache)


def flush(cache: SparseCache, write: Writer) -> SparseCache:
    """The cache with every layer's partial newest plane block written into the stores (from their raw tails)."""
    length = cache.group_length()
    data, tokens = [], ()
    for part, stacked in zip(cache.index.parts, cache.index.data):
        part_data, part_tokens = part.flush(write, stacked, length)
        data.append(part_data)
        tokens += part_tokens
    return dataclasses.replace(cache, index=dataclasses.replace(cache.index, data=tuple(data)),
                               writes=done(tokens, cache.writes))


def writer(attn) -> Writer:
    """How ``attn`` (a :class:`~fathom_jax.decode.SparseAttention`) writes its cache: in place in real host memory."""
    return Writer(attn.placement.in_host_memory, attn.resolved_implementation)
