"""The plane scan that selects: per query head, only the tokens whose score reaches a threshold, compacted.

The same scores as :func:`pallas_kernels.plane_scan.plane_scan` (the same kernel bodies, bit for bit), but no score
array: each program (group, tile of tokens) keeps, per query head ``h``, the tokens at positions ``start <= i <
stop[r]`` whose order-preserving key (:func:`~pallas_kernels.topk_radix.sortable_key`) of ``score + shift[r, h]``
reaches ``threshold[r, h]`` (an int32 key), and appends them to the head's candidate list: one scalar atomic per
(program, head) reserves their slots, a prefix sum places them. What comes back (:class:`Candidates`) is, per head, how many
tokens passed (``count``, which may exceed the ``capacity`` slots: the rest were dropped) and the first ``capacity``
of them (positions and scores, in no particular order on a GPU; in position order interpreted).

The decode step finishes the exact top-k on the candidates (:mod:`pallas_kernels.candidate_topk`): if at least k'
tokens reach the threshold and none was dropped, the top-k' of all tokens lie among them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as B
from pallas_kernels import plane_scan_common as common
from pallas_kernels.operands import ResidentPlanes, RunList, StorePlanes
from pallas_kernels.plane_layout import WORD_BITS
from pallas_kernels.topk_radix import INT_MIN, kth_largest, sortable_key

KERNEL_NAME = "fathom_scan_select"
SAMPLE_NAME = "fathom_scan_sample"


@dataclasses.dataclass(frozen=True)
class Candidates:
    """Per group ``r`` and query head ``h``: ``count[r, h]`` tokens passed (the counts padded to ``Gp``, a power of
    two, with zeros), the first ``capacity`` of them in ``position / score [R, G, capacity + 1]`` (the last column
    is scratch). ``count > capacity``: the list overflowed."""

    count: jax.Array  # i32 [R, Gp]
    position: jax.Array  # i32 [R, G, capacity + 1]
    score: jax.Array  # f32 [R, G, capacity + 1]

    @property
    def capacity(self) -> int:
        return self.position.shape[-1] - 1


jax.tree_util.register_dataclass(Candidates, data_fields=["count", "position", "score"], meta_fields=[])


def _select_epilogue(refs, tile, scores, *, start: int, capacity: int, shifted: bool):
    """Each head's tokens in ``[start, stop)`` with keys reaching its threshold, appended to its list."""
    if shifted:
        key_ref, stop_ref, shift_ref, _, count_ref, pos_ref, score_ref = refs
    else:
        key_ref, stop_ref, _, count_ref, pos_ref, score_ref = refs
    r = tile.r
    inside = (tile.tok >= start) & (tile.tok < stop_ref[r]) & tile.emask[:, None]
    tokens = tile.tok.reshape(-1)
    for h, s in enumerate(scores):
        if shifted:
            s = s + shift_ref[r, h]
        keep = (inside & (sortable_key(s) >= key_ref[r, h])).reshape(-1).astype(jnp.int32)
        # the head's slots reserved by one scalar atomic (adding 0 where no token passed)
        slot = plgpu.atomic_add(count_ref, (r, jnp.int32(h)), jnp.sum(keep)) + jnp.cumsum(keep) - 1
        write = (keep > 0) & (slot < capacity)
        at = jnp.where(write, slot, capacity)  # masked lanes point at the scratch column
        plgpu.store(pos_ref.at[r, jnp.int32(h), at], tokens, mask=write)
        plgpu.store(score_ref.at[r, jnp.int32(h), at], s.reshape(-1), mask=write)


@functools.partial(jax.jit, static_argnames=("start", "capacity", "config", "interpret", "hot_group_start"))
def _scan_select_pallas(q, store: StorePlanes, length, runs: RunList, extra: tuple, key, stop, shift, *, start,
                        capacity, config, interpret, hot_group_start) -> Candidates:
    r, g = q.shape[:2]
    gp = pl.next_power_of_2(g)
    tail = (key, stop) + (() if shift is None else (shift,)) + (jnp.zeros((r, gp), jnp.int32),)
    epilogue = functools.partial(_select_epilogue, start=start, capacity=capacity, shifted=shift is not None)
    count, position, score = common.scan_call(
        q, store, length, runs, extra, config=config, interpret=interpret, hot_group_start=hot_group_start,
        epilogue=epilogue, tail=tail, aliases={len(tail) - 1: 0}, raw_outputs=True,
        out_shape=(jax.ShapeDtypeStruct((r, gp), jnp.int32), jax.ShapeDtypeStruct((r, g, capacity + 1), jnp.int32),
                   jax.ShapeDtypeStruct((r, g, capacity + 1), jnp.float32)),
        name=KERNEL_NAME if config.math == "f32" else f"{KERNEL_NAME}_{config.math}")
    return Candidates(count, position, score)


def _sample_epilogue(refs, tile, scores, *, start: int, shifted: bool):
    """Every sampled token's key (the lowest int32 outside ``[start, stop)``)."""
    if shifted:
        stop_ref, shift_ref, out_ref = refs
    else:
        stop_ref, out_ref = refs
    inside = (tile.tok >= start) & (tile.tok < stop_ref[tile.r]) & tile.emask[:, None]
    for h, s in enumerate(scores):
        if shifted:
            s = s + shift_ref[tile.r, h]
        plgpu.store(out_ref.at[tile.r, jnp.int32(h), pl.ds(tile.e0, tile.elems), :],
                    jnp.where(inside, sortable_key(s), INT_MIN), mask=tile.emask[:, None])


@functools.partial(jax.jit, static_argnames=("start", "m", "stride", "config", "interpret", "hot_group_start"))
def _sample_threshold_pallas(q, store: StorePlanes, length, runs: RunList, extra: tuple, stop, shift, *, start, m,
                             stride, config, interpret, hot_group_start):
    r, g = q.shape[:2]
    split = WORD_BITS // config.lanes
    epilogue = functools.partial(_sample_epilogue, start=start, shifted=shift is not None)
    keys = common.scan_call(
        q, store, length, runs, extra, config=config, interpret=interpret, hot_group_start=hot_group_start,
        epilogue=epilogue, tail=(stop,) + (() if shift is None else (shift,)), stride=stride, name=SAMPLE_NAME,
        out_shape=jax.ShapeDtypeStruct((r, g, store.width * split, config.lanes // stride), jnp.int32))
    return kth_largest(keys.reshape(r * g, -1), k=m, interpret=interpret).reshape(r, g)


def sample_threshold_reference(q, store: StorePlanes, length, runs: RunList, stop, *, start: int, m: int, stride: int,
                               shift=None, resident: ResidentPlanes | None = None):
    """Plain jnp: the ``m``-th largest key of the reference scores of every ``stride``-th position in ``[start, stop)``
    (the lowest int32 where fewer)."""
    common.check_scan_inputs(q, store, length, runs, "sample_threshold")
    scores = common.scores_reference(q, store, length, runs, resident=resident)
    if shift is not None:
        scores = scores + shift[..., None]
    pos = jnp.arange(scores.shape[-1], dtype=jnp.int32)
    inside = (pos % stride == 0) & (pos >= start) & (pos < stop[..., None, None])
    keys = jnp.where(inside, sortable_key(scores), INT_MIN)
    return jnp.bitwise_not(jnp.sort(jnp.bitwise_not(keys), axis=-1)[..., m - 1])  # ~ reverses the order exactly


def sample_threshold(q, store: StorePlanes, length, runs: RunList, stop, *, start: int, m: int, stride: int,
                     shift=None, resident: ResidentPlanes | None = None, implementation: B.Implementation | None = None,
                     config: common.PlaneScanConfig | None = None, interpret: bool | None = None):
    """Per query head, the key of the ``m``-th largest score among every ``stride``-th token of ``[start, stop)``
    (``i32 [R, G]``, flat over the batch; the lowest int32 where fewer): a threshold about ``m x stride`` tokens
    reach, from ``1 / stride`` of the scan's arithmetic (the f32 kernel body, whatever ``config.math``; ``stride``
    a power of two up to its lanes), and one radix select (:func:`~pallas_kernels.topk_radix.kth_largest`)."""
    implementation = B.resolve_implementation(implementation)
    common.check_scan_inputs(q, store, length, runs, "sample_threshold")
    r = B.prod(q.shape[:-2])
    flat = lambda x: None if x is None else x.reshape(r, *x.shape[len(q.shape) - 2:])  # noqa: E731
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"m must be an int >= 1, got {m!r}")
    if implementation == "xla":
        return flat(sample_threshold_reference(q, store, length, runs, stop, start=start, m=m, stride=stride,
                                               shift=shift, resident=resident))
    config = dataclasses.replace(config or common.PlaneScanConfig(), math="f32", lanes=16, tile=512)
    if resident is not None:
        resident.check(store, runs, "sample_threshold")
    extra, hot_group_start = ((), None) if resident is None else (resident.kernel_operands(),
                                                                  resident.tiers.group_start)
    return _sample_threshold_pallas(flat(q), store.stacked(), flat(jnp.asarray(length, jnp.int32)), runs.flat(), extra,
                                    flat(stop), flat(shift), start=start, m=m, stride=stride, config=config,
                                    interpret=B.resolve_interpret(interpret), hot_group_start=hot_group_start)


def _validate(q, threshold, stop, shift, start, capacity):
    batch = q.shape[:-2]
    B.check_array("threshold", threshold, dtypes=(jnp.int32,))
    B.check_array("stop", stop, dtypes=(jnp.int32,))
    if threshold.shape != q.shape[:-1]:
        raise ValueError(f"threshold must be int32 keys [*batch, G] = {list(q.shape[:-1])}, got {threshold.shape}")
    if stop.shape != batch:
        raise ValueError(f"stop must be [*batch] = {list(batch)}, got {stop.shape}")
    if shift is not None and shift.shape != q.shape[:-1]:
        raise ValueError(f"shift must be [*batch, G] = {list(q.shape[:-1])}, got {shift.shape}")
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    if not isinstance(capacity, int) or not B.is_pow2(capacity):
        raise ValueError(f"capacity must be a power of two (candidates per head), got {capacity!r}")


def scan_select_reference(q, store: StorePlanes, length, runs: RunList, threshold, stop, *, start: int, capacity: int,
                          shift=None, resident: ResidentPlanes | None = None) -> Candidates:
    """Plain jnp: the reference scores (:func:`~pallas_kernels.plane_scan_common.scores_reference`), thresholded,
    each head's candidates in position order."""
    common.check_scan_inputs(q, store, length, runs, "scan_select")
    _validate(q, threshold, stop, shift, start, capacity)
    scores = common.scores_reference(q, store, length, runs, resident=resident)
    return _threshold(scores, threshold, stop, shift, start, capacity)


def _threshold(scores, threshold, stop, shift, start: int, capacity: int) -> Candidates:
    """The candidates of scores ``[*, G, n]`` (plain jnp, position order)."""
    if shift is not None:
        scores = scores + shift[..., None]
    n = scores.shape[-1]
    pos = jnp.arange(n, dtype=jnp.int32)
    keep = (pos >= start) & (pos < stop[..., None, None]) & (sortable_key(scores) >= threshold[..., None])
    count = jnp.sum(keep, axis=-1, dtype=jnp.int32)
    order = jnp.argsort(~keep, axis=-1, stable=True)[..., :capacity]  # the passing positions first, in order
    width = min(capacity, n)
    position = jnp.full(scores.shape[:-1] + (capacity + 1,), -1, jnp.int32).at[..., :width].set(order[..., :width])
    taken = jnp.arange(capacity + 1) < count[..., None]
    position = jnp.where(taken, position, -1)
    score = jnp.where(taken, jnp.take_along_axis(scores, jnp.maximum(position, 0), axis=-1), 0.0)
    gp = pl.next_power_of_2(scores.shape[-2])
    count = jnp.pad(count, [(0, 0)] * (count.ndim - 1) + [(0, gp - count.shape[-1])])
    return Candidates(count, position, score)


def scan_select(
    q,  # [*, G, D] queries (store basis)
    store: StorePlanes,
    length,  # i32 [*]
    runs: RunList,
    threshold,  # i32 [*, G] order-preserving keys
    stop,  # i32 [*]
    *,
    start: int,
    capacity: int,
    shift=None,  # f32 [*, G] added to every score of the head, or None
    resident: ResidentPlanes | None = None,
    implementation: B.Implementation | None = None,
    config: common.PlaneScanConfig | None = None,
    interpret: bool | None = None,
) -> Candidates:
    """Each query head's tokens ``start <= i < stop`` with ``sortable_key(score + shift) >= threshold`` (see the module
    docstring), over the store and run list as :func:`pallas_kernels.plane_scan.plane_scan` takes them (``resident``
    too). ``capacity`` (a power of two): the list's slots per head. Candidates come back flat over the batch: ``[R,
    ...]`` with ``R = prod(*)``.
    """
    implementation = B.resolve_implementation(implementation)
    common.check_scan_inputs(q, store, length, runs, "scan_select")
    _validate(q, threshold, stop, shift, start, capacity)
    if resident is not None:
        resident.check(store, runs, "scan_select")
    r = B.prod(q.shape[:-2])
    flat = lambda x: None if x is None else x.reshape(r, *x.shape[len(q.shape) - 2:])  # noqa: E731
    if implementation == "xla":
        out = scan_select_reference(q, store, length, runs, threshold, stop, start=start, capacity=capacity,
                                    shift=shift, resident=resident)
        return jax.tree.map(lambda x: x.reshape(r, *x.shape[len(q.shape) - 2:]), out)
    config = config or common.PlaneScanConfig.heuristic(store.width * WORD_BITS)
    extra, hot_group_start = ((), None) if resident is None else (resident.kernel_operands(),
                                                                  resident.tiers.group_start)
    return _scan_select_pallas(flat(q), store.stacked(), flat(jnp.asarray(length, jnp.int32)), runs.flat(), extra,
                               flat(threshold), flat(stop), flat(shift), start=start, capacity=capacity,
                               config=config, interpret=B.resolve_interpret(interpret),
                               hot_group_start=hot_group_start)
