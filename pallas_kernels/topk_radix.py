"""Top-k's radix path and the pieces both its paths share: order-preserving keys, the sink and local windows, the
final merge. A part of :mod:`pallas_kernels.topk` (which holds the selection's entry, its reference and the
implementation switch, and describes the selection), kept apart to keep each file short.

The radix path (``TopkConfig(path="radix")``, and rows too long for the fused path) maps scores to order-preserving
int32 keys, then:

1. bucket maxima over 32-token buckets (one XLA pass, ``n/32`` values per row);
2. ``tau`` = the k'-th largest bucket maximum (k' = k - sink - local), by the Pallas radix-select kernel
   ``kth_largest`` (8 rounds of 4-bit digits; each round counts, for the 15 candidate digits at once,
   how many keys reach the candidate prefix);
3. every top-k' element lies in a bucket whose maximum is ``>= tau``, and there are k' such buckets
   (ties aside): gather those k' x 32 candidates;
4. ``v`` = the exact k'-th largest candidate (the same kernel), select ``> v`` plus the first ``== v``
   ties, compact to k' slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as C

KERNEL_NAME = "kth_largest"
BUCKET = 32
INT_MIN = -(2**31)


def sortable_key(x):
    """f32 -> int32 with the same order (signed compare); NaN-free inputs."""
    b = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return b ^ ((b >> 31) & jnp.int32(0x7FFFFFFF))


def bitwise_kth(xs, valids, k):
    """The k-th largest of the int32 keys ``xs`` (a list of vectors read as one) where ``valids`` (INT_MIN if fewer
    than k; with ``k <= 0`` the largest int32): 32 one-bit rounds, one compare per element per round, inside a
    kernel."""
    xus = [jnp.where(valid, x, INT_MIN) ^ jnp.int32(INT_MIN) for x, valid in zip(xs, valids)]  # unsigned order as bits

    def rnd(i, prefix):
        cand = (prefix | jnp.left_shift(jnp.int32(1), 31 - i)) ^ jnp.int32(INT_MIN)
        cnt = sum(jnp.sum((xu ^ jnp.int32(INT_MIN) >= cand).astype(jnp.int32)) for xu in xus)
        return jnp.where(cnt >= k, cand ^ jnp.int32(INT_MIN), prefix)

    return jax.lax.fori_loop(0, 32, rnd, jnp.int32(0)) ^ jnp.int32(INT_MIN)


def validate(scores, length, k, sink, local):
    """Clear errors for bad shapes, dtypes or window sizes, before any work."""
    C.check_array("scores", scores, ndim=2, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16))
    if jnp.shape(length) not in ((scores.shape[0],), ()):
        raise ValueError(f"length must be [R] or a scalar, got {jnp.shape(length)}")
    if sink < 0 or local < 0 or k <= sink + local:
        raise ValueError(f"need k > sink + local >= 0, got k={k}, sink={sink}, local={local}")


def masks(n, length, sink, local):
    """The sink, local and middle positions of each row, ``bool [R, n]`` each."""
    pos = jnp.arange(n, dtype=jnp.int32)[None, :]
    length = length[:, None]
    sink_m = pos < jnp.minimum(sink, length)
    local_m = (pos >= jnp.maximum(sink, length - local)) & (pos < length)
    middle_m = (pos >= sink) & (pos < length - local)
    return sink_m, local_m, middle_m


def finish(sink_idx, local_idx, mid_idx, k):
    """Sink, local and middle selections as one increasing ``i32 [R, k]`` per row, -1 padded at the end."""
    idx = jnp.concatenate([sink_idx, local_idx, mid_idx], axis=-1)
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.sort(jnp.where(idx < 0, big, idx), axis=-1)[:, :k]
    return jnp.where(idx == big, -1, idx).astype(jnp.int32)


def sink_local(n, length, sink, local):
    """The sink and local window positions of each row (``-1`` where a row is shorter)."""
    r = length.shape[0]
    s = jnp.broadcast_to(jnp.arange(sink, dtype=jnp.int32), (r, sink))
    sink_idx = jnp.where(s < jnp.minimum(sink, length)[:, None], s, -1)
    l = jnp.maximum(sink, length - local)[:, None] + jnp.arange(local, dtype=jnp.int32)
    local_idx = jnp.where(l < length[:, None], l, -1)
    return sink_idx, local_idx


# ----------------------------------------------------------------------------------------------
# Radix select kernel


def _kth_largest_kernel(
    # inputs
    x_ref,  # i32 [R, N]   sortable keys
    # outputs
    out_ref,  # i32 [R]     k-th largest key (INT_MIN if fewer than k keys are > INT_MIN)
    *,
    k: int,
    size: int,
    tile: int,
):
    r = pl.program_id(0)
    digits = jnp.arange(16, dtype=jnp.int32)
    prefix = jnp.int32(0)  # in unsigned-order space: key_u = key_s ^ INT_MIN
    for sh in range(28, -4, -4):
        cand_u = prefix | (digits << sh)  # [16]
        cand_s = cand_u ^ jnp.int32(INT_MIN)

        def body(i, counts, cand_s=cand_s):
            off = i * tile
            m = off + jnp.arange(tile, dtype=jnp.int32) < size
            x = plgpu.load(x_ref.at[r, pl.ds(off, tile)], mask=m, other=INT_MIN)
            hit = (x[:, None] >= cand_s[None, :]) & m[:, None]
            return counts + jnp.sum(hit.astype(jnp.int32), axis=0)

        counts = jax.lax.fori_loop(0, pl.cdiv(size, tile), body, jnp.zeros((16,), jnp.int32))
        best = jnp.sum(((counts >= k) & (digits > 0)).astype(jnp.int32))
        prefix = prefix | (best << sh)
    out_ref[r] = prefix ^ jnp.int32(INT_MIN)


@functools.partial(jax.jit, static_argnames=("k", "tile", "num_warps", "interpret"))
def kth_largest(keys, *, k: int, tile: int = 1024, num_warps: int = 4, interpret: bool = False):
    """Per row of ``keys i32 [R, N]``: the k-th largest value (exact; INT_MIN when fewer than k)."""
    r, n = keys.shape
    tile = min(tile, pl.next_power_of_2(n))
    return pl.pallas_call(
        functools.partial(_kth_largest_kernel, k=k, size=n, tile=tile),
        out_shape=jax.ShapeDtypeStruct((r,), jnp.int32),
        grid=(r,),
        interpret=interpret,
        name=KERNEL_NAME,
        compiler_params=C.compiler_params(num_warps),
    )(keys)


def _row_compact(mask, values, size, fill=-1):
    """Per row, the first ``size`` entries of ``values`` where ``mask`` (index order), ``fill``-padded."""
    pos = jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1
    pos = jnp.where(mask & (pos < size), pos, size)  # out-of-range slot is dropped
    out = jnp.full((mask.shape[0], size + 1), fill, values.dtype)
    rows = jnp.arange(mask.shape[0])[:, None]
    return out.at[rows, pos].set(values, mode="drop")[:, :size]


@functools.partial(jax.jit, static_argnames=("k", "sink", "local", "interpret", "tile", "num_warps"))
def topk_radix(scores, length, *, k, sink, local, interpret, tile, num_warps):
    """The radix path's selection, ``i32 [R, k]`` (see the module docstring); ``length i32 [R]``."""
    r, n = scores.shape
    kp = k - sink - local
    nb = pl.cdiv(n, BUCKET)
    _, _, middle_m = masks(n, length, sink, local)
    keys = jnp.where(middle_m, sortable_key(scores), INT_MIN)
    keys = jnp.pad(keys, ((0, 0), (0, nb * BUCKET - n)), constant_values=INT_MIN)
    buckets = keys.reshape(r, nb, BUCKET)
    bmax = jnp.max(buckets, axis=-1)  # [R, nb]
    tau = kth_largest(bmax, k=kp, tile=tile, num_warps=num_warps, interpret=interpret)
    # Buckets above tau, then the first ones equal to it: the first k' >= tau could leave out a higher bucket.
    tied = (bmax == tau[:, None]) & (bmax > INT_MIN)
    above_b = jnp.sum((bmax > tau[:, None]), axis=-1, keepdims=True)
    cb = (bmax > tau[:, None]) | (tied & (jnp.cumsum(tied.astype(jnp.int32), axis=-1) <= kp - above_b))
    bid = _row_compact(cb, jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (r, nb)), kp, fill=nb)
    padded = jnp.concatenate([buckets, jnp.full((r, 1, BUCKET), INT_MIN, jnp.int32)], axis=1)
    cand = jnp.take_along_axis(padded, bid[:, :, None], axis=1).reshape(r, kp * BUCKET)
    cand_idx = (bid[:, :, None] * BUCKET + jnp.arange(BUCKET, dtype=jnp.int32)).reshape(r, kp * BUCKET)
    v = kth_largest(cand, k=kp, tile=tile, num_warps=num_warps, interpret=interpret)
    above = (cand > v[:, None]) & (cand > INT_MIN)
    tie = (cand == v[:, None]) & (cand > INT_MIN)
    need = kp - jnp.sum(above, axis=-1, keepdims=True)
    sel = above | (tie & (jnp.cumsum(tie.astype(jnp.int32), axis=-1) <= need))
    mid_idx = _row_compact(sel, cand_idx, kp)
    sink_idx, local_idx = sink_local(n, length, sink, local)
    return finish(sink_idx, local_idx, mid_idx, k)

