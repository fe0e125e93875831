"""How a decode step selects each group's rows, as a :class:`Selection`.

Per query head the 4 sink + 32 local + top-(k - 36) tokens by the read's scores, ties to the smaller position: the
read writes every position's score, the newest block is patched in (:func:`patch_scores`), the top-k kernels
(``lax.top_k`` in the reference) pick each head's tokens and one sort lays out the group's union, in increasing
position order with duplicates masked (:func:`select`).

A selection by thresholds (a sampled scan setting each head's threshold, a scan keeping only the tokens above it,
the exact top-k among those candidates) measured slower than this one in both GPU runs and was deleted (NOTES.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fathom_jax import scan as scan_lib
from fathom_jax import store as store_lib
from fathom_jax.methods.base import BlockRead, KeyRead, PlaneRead
from fathom_jax.select import group_union, select_topk


@dataclasses.dataclass(frozen=True)
class Selection:
    """A chunk's selection before its rows are fetched: the union ``slots [Rc, S]`` (-1 where masked), which head
    attends which slot (``member``) and ``scores [Rc, G, n]`` (every position's score, the newest block patched in:
    what the chunk's scan produced, so what a later fetch may wait for)."""

    q: jax.Array
    bits: jax.Array
    slots: jax.Array
    member: jax.Array
    group_start: int
    new: object
    scores: jax.Array


def select(read, q, source, view, ctx, group_start: int) -> Selection:
    """The selection of ``read`` (a method's read of the f32 queries ``q``) over ``source``, the view's groups from
    ``group_start`` of the stacked cache (see the module docstring)."""
    scores = _patched(read.scores(source), read, view.new)
    slots, member = _sorted(scores, view.length, ctx)
    return Selection(q=q, bits=read.bits, slots=slots, member=member, group_start=group_start,
                     new=view.new, scores=scores)


def _sorted(scores, length, ctx):
    """The union ``(slots, member)`` of ``scores [R, G, n]``."""
    # No masking pass over the scores: the selection takes positions >= length as invalid.
    idx, mask = select_topk(scores, length, ctx.k, sink=ctx.sink, local=ctx.local,
                            implementation=ctx.run.implementation, config=ctx.run.topk)
    # One XLA sort even though the Pallas top-k lists each head's tokens in order: the sort-free union, faster
    # alone, made the pipelined step slower (results/union_h200.md).
    union, union_mask, member = group_union(idx, mask)
    return jnp.where(union_mask, union, -1), member


def _patched(scores, read, new):
    return scores if new is None else patch_scores(scores, read, new)


def _put_block(scores, block_scores, start):
    """``scores [R, G, n]`` with ``block_scores [R, G, m]`` written at position ``start [R]`` (clipped in range)."""
    return jax.vmap(lambda s, b, at: jax.lax.dynamic_update_slice(s, b, (0, at)))(scores, block_scores, start)


def patch_scores(scores, read, new):
    """Scores of the newest block from the fresh block data (the stored block is stale until written): the read
    scores the newest block (:class:`NewestBlock`), whose width ``m`` places it at ``position // m * m``."""
    block_scores = read.scores(NewestBlock(new))
    size = block_scores.shape[-1]
    return _put_block(scores, block_scores, new.position // size * size)


@dataclasses.dataclass(frozen=True)
class NewestBlock:
    """The :class:`~fathom_jax.methods.base.ReadSource` of a step's newest block, from the fresh block data of each
    index part (its 64-token plane block, its newest row) and the new key (a
    :class:`~fathom_jax.decode.step.NewToken`): scores ``[R, G, m]`` of the block's ``m`` tokens (64, the read's
    block, 1)."""

    new: object

    def plane_scores(self, read: PlaneRead):
        block = self.new.blocks[read.part]
        codes = store_lib.unpack_planes(block.words, read.depths)  # [R, 64, D]
        values = store_lib.dequantize_codes(codes, block.scale.astype(jnp.float32)[:, None, :], read.depths[:, None, :])
        return scan_lib.dot(read.queries, values)

    def block_scores(self, read: BlockRead):
        return scan_lib.block_scores(read, self.new.blocks[read.part].row[:, None, :])

    def key_scores(self, read: KeyRead):
        return scan_lib.dot(read.queries, self.new.key[:, None, :].astype(jnp.float32))
