"""The exact top-k of each query head among the candidates a thresholded scan kept (:mod:`pallas_kernels.scan_select`).

Per group ``r`` and query head ``h`` the selection is the paper's: the sink (positions ``< min(sink, length)``), the
local window (``[max(sink, length - local), length)``) and the ``k' = k - sink - local`` best middle tokens by
(score descending, position ascending): the set :func:`pallas_kernels.topk.topk_select` and ``lax.top_k`` choose.
The middle tokens come from two lists: the scan's candidates (stored positions ``[sink, stop)`` whose key reached
the threshold ``T``) and ``extra`` ones taken whole (the newest block, scored apart: the stored copy is stale).

That set is exact when it provably holds the top k': when none of the scan's candidates was dropped (``count <=
capacity``) and either at least k' middle tokens reach ``T`` (then the k'-th best does too, and every token at
least as good is a candidate) or every stored middle token passed. Otherwise the head is marked ``failed`` and its
selection must come from elsewhere (the decode step's second path, over written scores).

One program per (group, head): the k'-th largest key by a bitwise search over the candidates held in registers,
ties broken by the smallest positions (the same search on negated positions), compaction by prefix sums.

Output ``selected i32 [R, G, k + 1]``: per head its ``k`` positions in slots ``0 .. k - 1`` (sink, local window,
then the middle in no particular order; ``-1`` where fewer), the last column scratch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as B
from pallas_kernels.topk_radix import INT_MIN, bitwise_kth, sink_local, sortable_key

KERNEL_NAME = "candidate_topk"
INT_MAX = 2**31 - 1


def _kernel(count_ref, pos_ref, score_ref, len_ref, key_ref, stop_ref, *rest, k, sink, local, extra):
    if extra:
        epos_ref, escore_ref, sel_ref, failed_ref = rest
    else:
        sel_ref, failed_ref = rest
    r, h = pl.program_id(0), pl.program_id(1)
    capacity = pos_ref.shape[-1] - 1
    kp = k - sink - local
    length, threshold, stop = len_ref[r], key_ref[r, h], stop_ref[r]
    count = count_ref[r, h]
    i = jnp.arange(capacity, dtype=jnp.int32)
    valid = [i < jnp.minimum(count, capacity)]
    pos = [plgpu.load(pos_ref.at[r, h, pl.ds(0, capacity)], mask=valid[0], other=0)]
    key = [jnp.where(valid[0], sortable_key(plgpu.load(score_ref.at[r, h, pl.ds(0, capacity)], mask=valid[0],
                                                                  other=0.0)), INT_MIN)]
    reached = jnp.minimum(count, capacity)  # the stored candidates all reach the threshold
    if extra:
        width = epos_ref.shape[-1]
        p = epos_ref[r, pl.ds(0, width)]
        ok = (p >= sink) & (p < length - local)
        valid.append(ok)
        pos.append(p)
        key.append(jnp.where(ok, sortable_key(escore_ref[r, h, pl.ds(0, width)]), INT_MIN))
        reached += jnp.sum((ok & (key[1] >= threshold)).astype(jnp.int32))
    complete = count == jnp.maximum(stop - sink, 0)
    failed = (count > capacity) | ((reached < kp) & ~complete)

    held = sum(jnp.sum(v.astype(jnp.int32)) for v in valid)
    want = jnp.minimum(kp, held)
    v = bitwise_kth(key, valid, want)
    above = [ok & (x > v) for ok, x in zip(valid, key)]
    tie = [ok & (x == v) for ok, x in zip(valid, key)]
    need = want - sum(jnp.sum(a.astype(jnp.int32)) for a in above)
    last = -bitwise_kth([-p for p in pos], tie, need)  # the need-th smallest tied position (none: need <= 0)
    chosen = [a | (t & (p <= last)) for a, t, p in zip(above, tie, pos)]

    # the middle after the sink and the local window, each list after the one before it
    first = sink + local
    for p, c in zip(pos, chosen):
        slot = first + jnp.cumsum(c.astype(jnp.int32)) - 1
        plgpu.store(sel_ref.at[r, h, jnp.where(c, slot, k)], p, mask=c)
        first = first + jnp.sum(c.astype(jnp.int32))
    pad = sink + local + jnp.arange(pl.next_power_of_2(kp), dtype=jnp.int32)
    empty = (pad >= first) & (pad < k)
    plgpu.store(sel_ref.at[r, h, jnp.where(empty, pad, k)], jnp.full(pad.shape, -1, jnp.int32), mask=empty)
    for start, size, fixed in _windows(length, sink, local):
        s = start + jnp.arange(pl.next_power_of_2(size), dtype=jnp.int32)
        inside = s < start + size
        plgpu.store(sel_ref.at[r, h, jnp.where(inside, s, k)], jnp.where(inside, fixed(s - start), -1), mask=inside)

    failed_ref[r, h] = failed.astype(jnp.int32)


def _windows(length, sink, local):
    """The sink's and the local window's slots ``(first slot, size, position of slot i)`` (-1 where the context is
    shorter), as :func:`~pallas_kernels.topk_radix.sink_local` places them."""
    local_start = jnp.maximum(sink, length - local)
    out = []
    if sink:
        out.append((0, sink, lambda j: jnp.where(j < jnp.minimum(sink, length), j, -1)))
    if local:
        out.append((sink, local, lambda j: jnp.where(local_start + j < length, local_start + j, -1)))
    return out


@functools.partial(jax.jit, static_argnames=("k", "sink", "local", "interpret", "num_warps"))
def _candidate_topk_pallas(count, position, score, length, threshold, stop, extra_position, extra_score, *, k, sink,
                           local, interpret, num_warps):
    r, g = position.shape[:2]
    extra = extra_position is not None
    inputs = (count, position, score, length, threshold, stop) + ((extra_position, extra_score) if extra else ())
    return pl.pallas_call(
        functools.partial(_kernel, k=k, sink=sink, local=local, extra=extra),
        out_shape=(jax.ShapeDtypeStruct((r, g, k + 1), jnp.int32), jax.ShapeDtypeStruct((r, g), jnp.int32)),
        grid=(r, g), in_specs=[B.any_spec()] * len(inputs), interpret=interpret, name=KERNEL_NAME,
        compiler_params=B.compiler_params(num_warps),
    )(*inputs)


def _validate(count, position, score, length, threshold, stop, extra_position, extra_score, k, sink, local):
    B.check_array("count", count, ndim=2, dtypes=(jnp.int32,))
    B.check_array("position", position, ndim=3, dtypes=(jnp.int32,))
    B.check_array("score", score, ndim=3, dtypes=(jnp.float32,))
    r, g, width = position.shape
    if score.shape != position.shape or count.shape != (r, pl.next_power_of_2(g)):
        raise ValueError(f"candidates: score must be [R, G, capacity + 1] = {position.shape} and count [R, Gp] = "
                         f"{[r, pl.next_power_of_2(g)]}, got {score.shape}, {count.shape}")
    if not B.is_pow2(width - 1):
        raise ValueError(f"candidates: capacity must be a power of two, got {width - 1}")
    for name, x, shape in (("length", length, (r,)), ("threshold", threshold, (r, g)), ("stop", stop, (r,))):
        B.check_array(name, x, dtypes=(jnp.int32,))
        if x.shape != shape:
            raise ValueError(f"{name} must be int32 {list(shape)}, got {x.shape}")
    if (extra_position is None) != (extra_score is None):
        raise ValueError("extra_position and extra_score come together (both or neither)")
    if extra_position is not None:
        B.check_array("extra_position", extra_position, ndim=2, dtypes=(jnp.int32,))
        B.check_array("extra_score", extra_score, ndim=3, dtypes=(jnp.float32,))
        e = extra_position.shape[1]
        if extra_position.shape[0] != r or extra_score.shape != (r, g, e) or not B.is_pow2(e):
            raise ValueError(f"extra_position must be [R, E] and extra_score [R, G, E] (E a power of two) with R, G = "
                             f"{r, g}, got {extra_position.shape}, {extra_score.shape}")
    if sink < 0 or local < 0 or k <= sink + local:
        raise ValueError(f"need k > sink + local >= 0, got k={k}, sink={sink}, local={local}")


def candidate_topk_reference(count, position, score, length, threshold, stop, extra_position=None, extra_score=None,
                             *, k: int, sink: int, local: int):
    """Plain jnp: the candidates ranked by one sort on (key descending, position ascending)."""
    _validate(count, position, score, length, threshold, stop, extra_position, extra_score, k, sink, local)
    r, g, width = position.shape
    capacity, kp = width - 1, k - sink - local
    count = count[:, :g]
    valid = jnp.arange(capacity) < jnp.minimum(count, capacity)[..., None]
    pos, scores = position[..., :capacity], score[..., :capacity]
    reached = jnp.sum(valid, axis=-1)
    if extra_position is not None:
        ok = (extra_position >= sink) & (extra_position < (length - local)[:, None])
        ok = jnp.broadcast_to(ok[:, None, :], extra_score.shape)
        reached = reached + jnp.sum(ok & (sortable_key(extra_score) >= threshold[..., None]), axis=-1)
        valid = jnp.concatenate([valid, ok], axis=-1)
        pos = jnp.concatenate([pos, jnp.broadcast_to(extra_position[:, None, :], extra_score.shape)], axis=-1)
        scores = jnp.concatenate([scores, extra_score], axis=-1)
    key = jnp.where(valid, sortable_key(scores), INT_MIN)
    order_pos = jnp.where(valid, pos, INT_MAX)
    _, by_pos = jax.lax.sort((jnp.bitwise_not(key), order_pos), num_keys=2)  # key descending, position ascending
    held = jnp.sum(valid, axis=-1)
    mid = jnp.where(jnp.arange(by_pos.shape[-1]) < jnp.minimum(kp, held)[..., None], by_pos, -1)[..., :kp]
    mid = jnp.pad(mid, [(0, 0), (0, 0), (0, max(0, kp - mid.shape[-1]))], constant_values=-1)
    sink_idx, local_idx = sink_local(1 << 30, jnp.repeat(length, g), sink, local)
    selected = jnp.concatenate([sink_idx.reshape(r, g, sink), local_idx.reshape(r, g, local), mid,
                                jnp.full((r, g, 1), -1, jnp.int32)], axis=-1)
    complete = count == jnp.maximum(stop - sink, 0)[:, None]
    failed = (count > capacity) | ((reached < kp) & ~complete)
    return selected, failed.astype(jnp.int32)


def candidate_topk(count, position, score, length, threshold, stop, extra_position=None, extra_score=None, *, k: int,
                   sink: int, local: int, implementation: B.Implementation | None = None, num_warps: int = 8,
                   interpret: bool | None = None):
    """``(selected i32 [R, G, k + 1], failed i32 [R, G])`` of the candidates (``count [R, Gp]``,
    ``position / score [R, G, capacity + 1]``, as :class:`pallas_kernels.scan_select.Candidates` holds them) of
    groups of ``length [R]`` scanned with thresholds ``threshold [R, G]`` (keys) over ``[sink, stop [R])``, and the
    ``extra`` middle candidates ``extra_position [R, E]`` / ``extra_score [R, G, E]`` (see the module docstring)."""
    implementation = B.resolve_implementation(implementation)
    args = (count, position, score, jnp.asarray(length, jnp.int32), threshold, stop, extra_position, extra_score)
    if implementation == "xla":
        return candidate_topk_reference(*args, k=k, sink=sink, local=local)
    _validate(*args, k, sink, local)
    return _candidate_topk_pallas(*args, k=k, sink=sink, local=local, interpret=B.resolve_interpret(interpret),
                                  num_warps=num_warps)
