"""Top-k token selection: 4 sink + 32 local + top-(k-36) by approximate score, per query head.

``scores f32 [R, n]`` (R = query heads), ``length i32 [R]`` (positions ``>= length`` are invalid) give
``index i32 [R, k]``: the selected positions in increasing order, ``-1`` padding at the end when fewer
than ``k`` positions are valid. Sinks are positions ``< min(sink, length)``, the local window is
``[max(sink, length - local), length)``, the middle ``[sink, length - local)`` contributes its
``k - sink - local`` best scores.

The fast paths never sort ``n`` scores (``lax.top_k`` over long rows is far slower on a GPU:
``results/kernels_h200.md``). Both keep the k' = k - sink - local best middle tokens through bucket maxima: every
top-k' token lies in a bucket whose maximum reaches the k'-th largest bucket maximum, so only those k' buckets'
tokens are candidates. The default ``path="fused"`` (below) does this in three to five Pallas kernels with a
one-bit-per-round search over registers and no XLA pass over ``[R, n]``; ``path="radix"``
(:mod:`pallas_kernels.topk_radix`) with XLA bucket maxima and a radix-select kernel. The set equals ``lax.top_k``'s
except among tied scores.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as C
from pallas_kernels.topk_radix import (  # noqa: F401 (KERNEL_NAME, kth_largest: this module's API too)
    BUCKET, INT_MIN, KERNEL_NAME, bitwise_kth, finish, kth_largest, masks, sink_local, sortable_key, topk_radix,
    validate)

# The paper's forced tokens per query head, for every method: the first SINK_TOKENS positions and the last
# LOCAL_TOKENS. Their one definition: the library's selection re-exports them.
SINK_TOKENS = 4
LOCAL_TOKENS = 32


def topk_select_reference(scores, length, *, k: int = 512, sink: int = SINK_TOKENS, local: int = LOCAL_TOKENS):
    """Plain-jnp selection with ``lax.top_k`` over the middle."""
    validate(scores, length, k, sink, local)
    r, n = scores.shape
    length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), (r,))
    _, _, middle_m = masks(n, length, sink, local)
    kp = min(k - sink - local, n)
    masked = jnp.where(middle_m, scores.astype(jnp.float32), -jnp.inf)
    _, top = jax.lax.top_k(masked, kp)
    ok = jnp.take_along_axis(middle_m, top, axis=-1)
    mid_idx = jnp.where(ok, top, -1).astype(jnp.int32)
    sink_idx, local_idx = sink_local(n, length, sink, local)
    return finish(sink_idx, local_idx, mid_idx, k)


# ----------------------------------------------------------------------------------------------
# Fused path ("fused"): three Pallas kernels, no XLA pass over [R, n] and no XLA cumsum/scatter.
#
# Buckets hold 32 tokens, or 64 / 128 where a row would otherwise have more than 65536 of them (``fused_bucket``).
# 1. ``bucket_max``: grid (R, tiles): masked order-preserving keys of a tile, max over each bucket.
# 2. ``select_buckets``: one program per row holds the row's bucket maxima in registers, finds the k'-th
#    largest by a 32-round bitwise search (one compare per element per round), and writes the ids of
#    the buckets > tau and then the first ones == tau, k' in all (index order, cumsum-compacted; nb-padded). Taking
#    the first k' buckets >= tau instead lost a higher bucket behind tied ones (a top score, not a tie).
# 3. ``select_tokens``: one program per row gathers the k' x bucket candidate scores, the exact k'-th largest
#    candidate v (the same search), selects ``> v`` plus the first ``== v`` ties and writes their positions.
# Steps 2 and 3 may each split a row over several programs and merge their survivors (below), by default the token
# selection over 4 and the bucket selection into slices of 16384 buckets (rows of 512k tokens and more).


def _middle(pos, length, sink, local):
    return (pos >= sink) & (pos < length - local)


def _bucket_max_kernel(len_ref, s_ref, out_ref, *, tb, nb, bucket, sink, local):
    r = pl.program_id(0)
    b0 = pl.program_id(1) * tb
    b = b0 + jnp.arange(tb, dtype=jnp.int32)
    pos = b[:, None] * bucket + jnp.arange(bucket, dtype=jnp.int32)[None, :]
    ok = _middle(pos, len_ref[r], sink, local) & (b[:, None] < nb)
    x = plgpu.load(s_ref.at[r, pl.ds(b0, tb), :], mask=(b < nb)[:, None], other=0.0)
    key = jnp.where(ok, sortable_key(x), INT_MIN)
    plgpu.store(out_ref.at[r, pl.ds(b0, tb)], jnp.max(key, axis=1), mask=b < nb)


def _select_buckets_kernel(bmax_ref, out_ref, *, nbp, nb, kp, kpp):
    r = pl.program_id(0)
    i = jnp.arange(nbp, dtype=jnp.int32)
    m = i < nb
    x = plgpu.load(bmax_ref.at[r, pl.ds(0, nbp)], mask=m, other=INT_MIN)
    valid = m & (x > INT_MIN)
    _compact_store(out_ref, (r,), _tie_select(x, valid, kp), i, kp, kpp, nb)


def _token_candidates(len_ref, bid_ref, s_ref, r, start, size, *, kp, nb, n, bucket, sink, local):
    """Positions ``[size, bucket]`` of candidate buckets ``start .. start + size - 1`` of row ``r``, which of them
    are valid middle tokens, and their order-preserving keys (INT_MIN where not)."""
    j = start + jnp.arange(size, dtype=jnp.int32)
    bid = plgpu.load(bid_ref.at[r, pl.ds(start, size)], mask=j < kp, other=nb)
    pos = bid[:, None] * bucket + jnp.arange(bucket, dtype=jnp.int32)[None, :]
    ok = (bid[:, None] < nb) & (pos < n) & _middle(pos, len_ref[r], sink, local)
    x = plgpu.load(s_ref.at[r, jnp.minimum(pos, n - 1)], mask=ok, other=0.0)
    return pos, ok, jnp.where(ok, sortable_key(x), INT_MIN)


def _select_tokens_kernel(len_ref, bid_ref, s_ref, out_ref, *, kp, kpp, nb, n, bucket, sink, local):
    r = pl.program_id(0)
    pos, ok, key = _token_candidates(len_ref, bid_ref, s_ref, r, 0, kpp, kp=kp, nb=nb, n=n, bucket=bucket, sink=sink,
                                     local=local)
    _compact_store(out_ref, (r,), _tie_select(key, ok, kp), pos, kp, kpp, -1)


# Split rows (``TopkConfig.bucket_splits`` / ``token_splits`` > 1): a row's selection is spread over P programs,
# each holding 1/P of the row's bucket maxima (or candidates), which keeps its local top-k' (and their keys); one
# program per row then merges the P x k' survivors. The global top-k' lies within the union of the slices' local
# top-k' sets, so the merge selects exactly what one program would have (among ties, possibly other positions).


def _compact_store(out_ref, at, sel, values, kp, kpp, fill, keys_ref=None, keys=None):
    """Write ``values`` where ``sel`` to slots ``0..`` of ``out_ref.at[at]`` in index order (the first ``kp``), the
    rest of the ``kp`` slots with ``fill`` (keys with INT_MIN); column ``kp`` is a dummy for masked lanes."""
    flat_sel = sel.reshape(-1)
    slot = (jnp.cumsum(flat_sel.astype(jnp.int32)) - 1).reshape(sel.shape)
    w = sel & (slot < kp)
    dst = jnp.where(w, slot, kp)
    plgpu.store(out_ref.at[(*at, dst)], values, mask=w)
    if keys_ref is not None:
        plgpu.store(keys_ref.at[(*at, dst)], keys, mask=w)
    cnt = jnp.minimum(jnp.sum(sel.astype(jnp.int32)), kp)
    s = jnp.arange(kpp, dtype=jnp.int32)
    w = (s >= cnt) & (s < kp)
    dst = jnp.where(w, s, kp)
    plgpu.store(out_ref.at[(*at, dst)], jnp.full((kpp,), fill, jnp.int32), mask=w)
    if keys_ref is not None:
        plgpu.store(keys_ref.at[(*at, dst)], jnp.full((kpp,), INT_MIN, jnp.int32), mask=w)


def _local_buckets_kernel(bmax_ref, ids_ref, keys_ref, *, nbs, nb, kp, kpp):
    """Program (r, p): the first k' buckets (index order) of slice p whose maxima reach the slice's k'-th largest."""
    r, p = pl.program_id(0), pl.program_id(1)
    i = p * nbs + jnp.arange(nbs, dtype=jnp.int32)
    m = i < nb
    x = plgpu.load(bmax_ref.at[r, pl.ds(p * nbs, nbs)], mask=m, other=INT_MIN)
    valid = m & (x > INT_MIN)
    cb = _tie_select(x, valid, kp)
    _compact_store(ids_ref, (r, p), cb, i, kp, kpp, nb, keys_ref, x)


def _survivor_slots(splits, kp, kpp):
    """Indices ``[P', 1]`` and ``[1, kpp]`` (P' = ``splits`` rounded up to a power of two) of the ``[splits, kp]``
    survivors, and their mask; in row-major order they are index order."""
    sp = jnp.arange(pl.next_power_of_2(splits), dtype=jnp.int32)[:, None]
    col = jnp.arange(kpp, dtype=jnp.int32)[None, :]
    return jnp.minimum(sp, splits - 1), col, (sp < splits) & (col < kp)


def _merge_buckets_kernel(ids_ref, keys_ref, out_ref, *, splits, kp, kpp, nb):
    """One program per row: the first k' candidate buckets (index order) whose maxima reach the k'-th largest."""
    r = pl.program_id(0)
    sp, col, m = _survivor_slots(splits, kp, kpp)
    x = plgpu.load(keys_ref.at[r, sp, col], mask=m, other=INT_MIN)
    ids = plgpu.load(ids_ref.at[r, sp, col], mask=m, other=nb)
    valid = x > INT_MIN
    cb = _tie_select(x, valid, kp)
    _compact_store(out_ref, (r,), cb, ids, kp, kpp, nb)


def _tie_select(key, ok, kp):
    """The k' largest keys where ``ok``: all above the k'-th largest ``v``, then the first ties (index order)."""
    v = bitwise_kth([key], [ok], kp)
    above = ok & (key > v)
    tie = ok & (key == v)
    need = kp - jnp.sum(above.astype(jnp.int32))
    tie_rank = jnp.cumsum(tie.reshape(-1).astype(jnp.int32)).reshape(tie.shape)
    return above | (tie & (tie_rank <= need))


def _local_tokens_kernel(len_ref, bid_ref, s_ref, pos_ref, keys_ref, *, kps, kp, kpp, nb, n, bucket, sink, local):
    """Program (r, p): the local top-k' tokens of candidate buckets ``p * kps ..`` (positions and keys)."""
    r, p = pl.program_id(0), pl.program_id(1)
    pos, ok, key = _token_candidates(len_ref, bid_ref, s_ref, r, p * kps, kps, kp=kp, nb=nb, n=n, bucket=bucket,
                                     sink=sink, local=local)
    _compact_store(pos_ref, (r, p), _tie_select(key, ok, kp), pos, kp, kpp, -1, keys_ref, key)


def _merge_tokens_kernel(pos_ref, keys_ref, out_ref, *, splits, kp, kpp):
    """One program per row: the top-k' of the slices' survivors (positions in index order)."""
    r = pl.program_id(0)
    sp, col, m = _survivor_slots(splits, kp, kpp)
    pos = plgpu.load(pos_ref.at[r, sp, col], mask=m, other=-1)
    key = plgpu.load(keys_ref.at[r, sp, col], mask=m, other=INT_MIN)
    ok = pos >= 0
    _compact_store(out_ref, (r,), _tie_select(key, ok, kp), pos, kp, kpp, -1)


# Bucket maxima of a row held in one program's registers. 65536, not 32768: a decode cache of 1M tokens has 2^20 + 64
# slots, and 64-token buckets there doubled the last kernel's candidates (measured slower on the H200:
# results/topk_tune_h200.md).
MAX_FUSED_BUCKETS = 65536
AUTO_SLICE_BUCKETS = 16384  # bucket maxima per program of the bucket selection with bucket_splits="auto"
MAX_FUSED_BUCKET = 128  # candidates per selected bucket (k' x bucket of them held in one program)


def fused_bucket(n: int, max_buckets: int = MAX_FUSED_BUCKETS) -> int:
    """Tokens per bucket of the fused path: 32, doubled until a row of ``n`` has at most ``max_buckets`` buckets
    (rows past 2M tokens). Wider buckets make the last kernel hold more candidates (k' x bucket)."""
    bucket = BUCKET
    while pl.cdiv(n, bucket) > max_buckets:
        bucket *= 2
    return bucket


@functools.partial(jax.jit, static_argnames=("k", "sink", "local", "interpret", "bucket", "config"))
def _topk_fused(scores, length, *, k, sink, local, interpret, bucket, config):
    """``config``: resolved (``num_warps`` set, ``token_splits`` at most the candidate buckets' power of two)."""
    num_warps, bucket_splits, token_splits = config.num_warps, config.bucket_splits, config.token_splits
    r, n = scores.shape
    kp = k - sink - local
    kpp = pl.next_power_of_2(kp)
    nb = pl.cdiv(n, bucket)
    nbp = pl.next_power_of_2(nb)
    scores = scores.astype(jnp.float32)
    padded = jnp.pad(scores, ((0, 0), (0, nb * bucket - n))) if nb * bucket != n else scores
    tb = min(64 * BUCKET // bucket, nbp)
    bmax = pl.pallas_call(
        functools.partial(_bucket_max_kernel, tb=tb, nb=nb, bucket=bucket, sink=sink, local=local),
        out_shape=jax.ShapeDtypeStruct((r, nb), jnp.int32),
        grid=(r, pl.cdiv(nb, tb)), interpret=interpret, name="topk_bucket_max",
        compiler_params=C.compiler_params(4),
    )(length, padded.reshape(r, nb, bucket))
    survivors = lambda splits: (jax.ShapeDtypeStruct((r, splits, kp + 1), jnp.int32),) * 2  # noqa: E731
    params = C.compiler_params(num_warps)
    if bucket_splits == "auto":
        nbs = min(nbp, AUTO_SLICE_BUCKETS)
    else:
        nbs = pl.next_power_of_2(pl.cdiv(nb, bucket_splits))
    if pl.cdiv(nb, nbs) > 1:
        splits = pl.cdiv(nb, nbs)
        ids, keys = pl.pallas_call(
            functools.partial(_local_buckets_kernel, nbs=nbs, nb=nb, kp=kp, kpp=kpp),
            out_shape=survivors(splits), grid=(r, splits), interpret=interpret, name="topk_local_buckets",
            compiler_params=params,
        )(bmax)
        bid = pl.pallas_call(
            functools.partial(_merge_buckets_kernel, splits=splits, kp=kp, kpp=kpp, nb=nb),
            out_shape=jax.ShapeDtypeStruct((r, kp + 1), jnp.int32), grid=(r,), interpret=interpret,
            name="topk_select_buckets", compiler_params=params,
        )(ids, keys)
    else:
        bid = pl.pallas_call(
            functools.partial(_select_buckets_kernel, nbp=nbp, nb=nb, kp=kp, kpp=kpp),
            out_shape=jax.ShapeDtypeStruct((r, kp + 1), jnp.int32),
            grid=(r,), interpret=interpret, name="topk_select_buckets", compiler_params=params,
        )(bmax)
    if token_splits > 1:
        kps = kpp // token_splits  # candidate buckets per program
        splits = pl.cdiv(kp, kps)
        pos, keys = pl.pallas_call(
            functools.partial(_local_tokens_kernel, kps=kps, kp=kp, kpp=kpp, nb=nb, n=n, bucket=bucket, sink=sink,
                              local=local),
            out_shape=survivors(splits), grid=(r, splits), interpret=interpret,
            name="topk_local_tokens", compiler_params=params,
        )(length, bid, scores)
        mid_idx = pl.pallas_call(
            functools.partial(_merge_tokens_kernel, splits=splits, kp=kp, kpp=kpp),
            out_shape=jax.ShapeDtypeStruct((r, kp + 1), jnp.int32), grid=(r,), interpret=interpret,
            name="topk_select_tokens", compiler_params=params,
        )(pos, keys)[:, :kp]
    else:
        mid_idx = pl.pallas_call(
            functools.partial(_select_tokens_kernel, kp=kp, kpp=kpp, nb=nb, n=n, bucket=bucket, sink=sink,
                              local=local),
            out_shape=jax.ShapeDtypeStruct((r, kp + 1), jnp.int32),
            grid=(r,), interpret=interpret, name="topk_select_tokens", compiler_params=params,
        )(length, bid, scores)[:, :kp]
    sink_idx, local_idx = sink_local(n, length, sink, local)
    return finish(sink_idx, local_idx, mid_idx, k)


@dataclasses.dataclass(frozen=True)
class TopkConfig:
    """``path``: ``"fused"`` (three fused kernels, rows of up to 65536 buckets of 32 to 128 tokens = 8M tokens;
    longer rows fall back to ``"radix"``) or ``"radix"`` (XLA bucket maxima + two radix selects); ``num_warps`` (default 16
    fused, 4 radix); ``tile``: elements per step of the radix kernel. The fused path is the faster from 32k to 1M
    tokens on the H200 (``results/topk_tune_h200.md``)."""

    path: str = "fused"
    num_warps: int | None = None
    tile: int = 1024
    max_buckets: int = MAX_FUSED_BUCKETS  # buckets per row of the fused path (tests lower it to reach wide buckets)
    # Programs per row of the fused path's two selections, each then merged by one program per row: the bucket
    # selection ("auto": slices of at most AUTO_SLICE_BUCKETS buckets) and the token selection among the candidates.
    # Both splits measured faster on the H200 for a decode chunk's rows, except the bucket selection of rows under
    # 512k tokens, whose split costs more than it saves (results/decode_step_h200.md).
    bucket_splits: int | str = "auto"
    token_splits: int = 4

    def __post_init__(self):
        if self.path not in ("radix", "fused"):
            raise ValueError(f"path must be 'radix' or 'fused', got {self.path!r}")
        C.check_pow2("tile", self.tile)
        C.check_pow2("max_buckets", self.max_buckets)
        if self.bucket_splits != "auto":
            C.check_pow2("bucket_splits", self.bucket_splits)
        C.check_pow2("token_splits", self.token_splits)


def topk_select(
    scores,  # f32 [R, n]
    length,  # i32 [R] or scalar
    *,
    k: int = 512,
    sink: int = SINK_TOKENS,
    local: int = LOCAL_TOKENS,
    implementation: C.Implementation | None = None,
    config: TopkConfig | None = None,
    interpret: bool | None = None,
):
    """Selected positions ``i32 [R, k]`` (increasing, -1 padded); see the module docstring."""
    implementation = C.resolve_implementation(implementation)
    config = config or TopkConfig()
    validate(scores, length, k, sink, local)
    length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), (scores.shape[0],))
    if implementation == "xla" or k - sink - local > scores.shape[1]:
        return topk_select_reference(scores, length, k=k, sink=sink, local=local)
    interpret = C.resolve_interpret(interpret)
    bucket = fused_bucket(scores.shape[1], config.max_buckets)
    if config.path == "fused" and bucket <= MAX_FUSED_BUCKET:
        fused = dataclasses.replace(config, num_warps=16 if config.num_warps is None else config.num_warps,
                                    token_splits=min(config.token_splits, pl.next_power_of_2(k - sink - local)))
        return _topk_fused(scores, length, k=k, sink=sink, local=local, interpret=interpret, bucket=bucket,
                           config=fused)
    return topk_radix(scores, length, k=k, sink=sink, local=local, interpret=interpret, tile=config.tile,
                        num_warps=4 if config.num_warps is None else config.num_warps)
