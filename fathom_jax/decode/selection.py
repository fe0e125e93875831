"""How a decode step selects each group's rows: one strategy object per way, chosen once.

Both give the same :class:`Selection` (per query head the 4 sink + 32 local + top-(k - 36) tokens by the read's
scores, ties to the smaller position; the group's union laid out in increasing position order, duplicates masked):

* :class:`SortedSelection`: the read writes every position's score, the newest block is patched in, the top-k
  kernels (``lax.top_k`` in the reference) pick each head's tokens and one sort lays out the union.
* :class:`ThresholdSelection`: for a plane read on the kernels, no score array. A sampled scan of every s-th token
  gives each query head a threshold that about ``rank x k'`` tokens reach (k' = k - sink - local); the scan keeps
  only the tokens reaching it (:mod:`pallas_kernels.scan_select`), and the exact top-k among those candidates and the
  newest block (:mod:`pallas_kernels.candidate_topk`) and the union (:mod:`pallas_kernels.group_union`) are two small
  kernels. Where a group's candidates cannot prove a head's selection (fewer than k' reached the threshold, or more
  than the list holds) the chunk takes the sorted path instead (``lax.cond``), counted per layer and group in the
  cache's ``second_path``. Other reads (landmarks, Quest, the oracle) and the reference implementation select the
  sorted way.

A threshold from the previous step's candidates instead of a sample failed on 6-29% of head-steps at k = 128 on real
decodes, the sample on none of 168,000 (``results/threshold_seeds_*.md``, ``results/threshold_rules_*.md``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fathom_jax import scan as scan_lib
from fathom_jax import store as store_lib
from fathom_jax.format import BLOCK_TOKENS
from fathom_jax.methods.base import BlockRead, KeyRead, PlaneRead
from fathom_jax.select import group_union, select_topk
from pallas_kernels import candidate_topk as candidate_lib
from pallas_kernels import group_union as union_lib
from pallas_kernels.topk_radix import INT_MIN


@dataclasses.dataclass(frozen=True)
class Selection:
    """A chunk's selection before its rows are fetched: the union ``slots [Rc, S]`` (-1 where masked), which head
    attends which slot (``member``), ``done`` (an array the chunk's scan produced: what a later fetch may wait for),
    ``second_path [Rc]`` (1 where the group's candidates failed and the sorted path ran; None: no threshold) and
    ``scores [Rc, G, n]`` (every position's score, the newest block patched in, where the selection wrote them; None:
    it wrote none)."""

    q: jax.Array
    bits: jax.Array
    slots: jax.Array
    member: jax.Array
    done: jax.Array
    group_start: int
    new: object
    second_path: jax.Array | None = None
    scores: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SortedSelection:
    """Every score written, the top-k kernels, the union by one sort (see the module docstring)."""

    def select(self, read, q, source, view, ctx, group_start: int) -> Selection:
        scores = _patched(read.scores(source), read, view.new)
        slots, member = _sorted(scores, view.length, ctx)
        return Selection(q=q, bits=read.bits, slots=slots, member=member, done=scores, group_start=group_start,
                         new=view.new, scores=scores)


@dataclasses.dataclass(frozen=True)
class ThresholdSelection:
    """Candidates above each head's threshold from a sample of this step, the exact top-k among them (see the module
    docstring).

    ``rank``: a step expects about ``rank x k'`` candidates a head: the threshold is the ``m``-th best of every
    ``stride``-th middle token with ``m x stride ~ rank x k'`` and ``m >= samples`` (:meth:`sampling`); ``slack``: the
    list holds ``slack x rank x k'`` candidates (rounded up to a power of two) before it overflows."""

    rank: int = 4
    slack: int = 4
    samples: int = 32

    def __post_init__(self):
        for name in ("rank", "slack", "samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"threshold selection {name} must be an int >= 1, got {value!r}")

    def capacity(self, kp: int) -> int:
        return pl.next_power_of_2(self.slack * self.rank * kp)

    def sampling(self, kp: int) -> tuple[int, int]:
        """``(m, stride)`` of the sampled threshold: every ``stride``-th token (a power of two up to 16), its
        ``m``-th best, with ``m >= samples`` and ``m x stride ~ rank x k'``."""
        stride = 1
        while stride < 16 and self.rank * kp // (2 * stride) >= self.samples:
            stride *= 2
        return -(-self.rank * kp // stride), stride

    def select(self, read, q, source, view, ctx, group_start: int) -> Selection:
        if not (isinstance(read, PlaneRead) and view.layer is not None and ctx.run.implementation == "triton"):
            return SortedSelection().select(read, q, source, view, ctx, group_start)
        reader = source.reader
        operands = source.plane_operands(read)
        kp = ctx.k - ctx.sink - ctx.local
        newest = view.length if view.new is None else view.new.position // BLOCK_TOKENS * BLOCK_TOKENS
        stop = jnp.minimum(view.length - ctx.local, newest)
        m, stride = self.sampling(kp)
        threshold = operands.sample_threshold(reader, stop, start=ctx.sink, m=m, stride=stride, shift=read.shift)
        # where the whole middle fits the list, every token is a candidate (and the selection complete)
        fits = (stop - ctx.sink <= self.capacity(kp))[:, None]
        threshold = jnp.where(fits, jnp.int32(INT_MIN), threshold)
        candidates = operands.candidates(reader, threshold, stop, start=ctx.sink, capacity=self.capacity(kp),
                                         shift=read.shift)
        extra = (None, None)
        if view.new is not None:  # the newest block, scored from its fresh data
            extra = (newest[:, None] + jnp.arange(BLOCK_TOKENS, dtype=jnp.int32), read.scores(NewestBlock(view.new)))
        selected, failed = candidate_lib.candidate_topk(
            candidates.count, candidates.position, candidates.score, view.length, threshold, stop, *extra, k=ctx.k,
            sink=ctx.sink, local=ctx.local, implementation=reader.implementation)

        def by_candidates():
            slots, member = union_lib.group_union(selected, k=ctx.k, implementation=reader.implementation)
            return slots, member > 0

        def by_scores():  # the second path: every score written (from the same staged planes)
            return _sorted(_patched(_shifted(operands.scores(reader), read), read, view.new), view.length, ctx)

        slots, member = jax.lax.cond(jnp.any(failed > 0), by_scores, by_candidates)
        return Selection(q=q, bits=read.bits, slots=slots, member=member, done=candidates.count,
                         group_start=group_start, new=view.new,
                         second_path=jnp.any(failed > 0, axis=-1).astype(jnp.int32))


def _shifted(scores, read):
    """``scores`` as ``read.scores`` returns them (with the read's shift, added only where it has one)."""
    return scores if read.shift is None else scores + read.shift[..., None]


def _sorted(scores, length, ctx):
    """The sorted path's union ``(slots, member)`` of ``scores [R, G, n]``."""
    # No masking pass over the scores: both selections take positions >= length as invalid.
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
