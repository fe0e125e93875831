"""A KV group's selection in two kernels: from the approximate scores of its G query heads to the union of their
selected tokens, with no sort.

``scores f32 [R, G, n]`` (R groups), ``length i32 [R]`` give

* ``slots i32 [R, G k]``: head ``h``'s ``k`` selections in slots ``[h k, (h + 1) k)``: its ``sink`` sink tokens, its
  ``k' = k - sink - local`` middle tokens in increasing position, its ``local`` window (-1 where a window or the middle
  is short); a slot is -1 too where an earlier head holds its token, so every token appears once;
* ``member i32 [R, G, G k]``: 1 where head ``g`` attends slot ``s`` (never a masked slot).

Per head the selected set is the one :func:`pallas_kernels.topk.topk_select_reference` takes (``lax.top_k`` over the
middle): the k' largest scores, ties broken by position (the first ones). As a set this is the top k' of the pairs
``(score, -position)``, which two numbers per head decide: the k'-th largest score ``v`` and the position ``p`` of
the last tie taken; a token is the head's iff ``score > v`` or ``score == v`` and ``position <= p``. That rule is
what lets one program find every head's members of another head's slots without comparing lists.

1. ``group_bucket_max`` (grid rows x tiles): the maxima of 32-token buckets (the fused top-k's first kernel).
2. ``group_select`` (one program per group, every head at once, looping over global memory in tiles): per head
   ``tau``, the k'-th largest bucket maximum, by a 32-round bitwise search; the buckets above ``tau`` and the first
   ones equal to it (k' buckets, which hold the top k' pairs); ``v`` and ``p`` among their tokens (the same search);
   the head's slots; then, per slot, which heads hold its token (their scores at it against their ``v`` and ``p``).
   Bucket ids and head lists pass through scratch outputs in global memory, behind a barrier.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as C
from pallas_kernels.topk_radix import BUCKET, INT_MIN, bucket_max_kernel, middle, sink_local, sortable_key

KERNEL_NAME = "group_select"
BUCKET_MAX_NAME = "group_bucket_max"
TILE = 4096  # elements per head and tile step (x G heads): bounded registers at any n


def _check(scores, length, k, sink, local):
    C.check_array("scores", scores, ndim=3, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16))
    if jnp.shape(length) != scores.shape[:1]:
        raise ValueError(f"length must be [R] = [{scores.shape[0]}] (one per group of scores [R, G, n]), got "
                         f"{jnp.shape(length)}")
    if sink < 0 or local < 0 or k <= sink + local:
        raise ValueError(f"need k > sink + local >= 0, got k={k}, sink={sink}, local={local}")
    if k - sink - local > scores.shape[2]:
        raise ValueError(f"k - sink - local = {k - sink - local} must not exceed the n = {scores.shape[2]} positions")


def group_select_reference(scores, length, *, k: int, sink: int, local: int):
    """Plain jnp: ``lax.top_k`` of each head's middle keys, the slots laid out as the kernel does, duplicates and
    membership by comparing every slot with every head's list."""
    _check(scores, length, k, sink, local)
    r, g, n = scores.shape
    kp = k - sink - local
    length = jnp.asarray(length, jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32)
    mid = middle(pos, length[:, None, None], sink, local)
    keys = jnp.where(mid, sortable_key(scores), INT_MIN)
    top, idx = jax.lax.top_k(keys, kp)  # ties: the lower position first
    idx = jnp.sort(jnp.where(top > INT_MIN, idx, n), axis=-1)
    idx = jnp.where(idx == n, -1, idx).astype(jnp.int32)
    sink_idx, local_idx = sink_local(n, length, sink, local)
    heads = jnp.concatenate([jnp.broadcast_to(sink_idx[:, None], (r, g, sink)), idx,
                             jnp.broadcast_to(local_idx[:, None], (r, g, local))], axis=-1)  # [R, G, k]
    flat = heads.reshape(r, 1, g * k)
    holds = jnp.any((flat[..., None] == heads[:, :, None, :]) & (heads[:, :, None, :] >= 0), axis=-1)  # [R, G, Gk]
    owner = jnp.arange(g * k, dtype=jnp.int32) // k
    earlier = jnp.any(holds & (jnp.arange(g)[:, None] < owner[None, :]), axis=1)  # [R, Gk]
    keep = (flat[:, 0] >= 0) & ~earlier
    return jnp.where(keep, flat[:, 0], -1), (holds & keep[:, None, :]).astype(jnp.int32)


def _kth(load, tiles: int, kth: int, init):
    """Per head (``[Gp, 1]``), the ``kth`` largest of the int32 keys ``load(t)`` yields for tiles ``t < tiles``
    (INT_MIN marks none; INT_MIN if fewer): 32 one-bit rounds, each a pass over the tiles."""
    flip = jnp.int32(INT_MIN)

    def rnd(i, prefix):
        cand = prefix | jnp.left_shift(jnp.int32(1), 31 - i)

        def count(t, cnt):
            x = load(t)[1] ^ flip  # unsigned order as bits, compared in signed space
            return cnt + jnp.sum((x ^ flip >= cand ^ flip).astype(jnp.int32), axis=1, keepdims=True)

        cnt = jax.lax.fori_loop(0, tiles, count, jnp.zeros_like(init))
        return jnp.where(cnt >= kth, cand, prefix)

    return jax.lax.fori_loop(0, 32, rnd, init) ^ flip


def _first(load, tiles: int, kth: int, v, init, emit):
    """Per head, the keys above ``v`` and then the first ties, up to ``kth`` in all, in tile order: calls
    ``emit(t, aux, sel, rank)`` per tile (``rank``: 0-based slot of each selected element); returns the count and
    the position ``aux`` of the last tie taken (-1 if none)."""
    def above(t, cnt):
        _, x = load(t)
        return cnt + jnp.sum((x > v).astype(jnp.int32), axis=1, keepdims=True)

    need = kth - jax.lax.fori_loop(0, tiles, above, jnp.zeros_like(init))

    def body(t, carry):
        taken, ties, last = carry
        aux, x = load(t)
        tie = (x == v) & (x > INT_MIN)
        tie_rank = ties + jnp.cumsum(tie.astype(jnp.int32), axis=1)
        sel = (x > v) | (tie & (tie_rank <= need))
        emit(t, aux, sel, taken + jnp.cumsum(sel.astype(jnp.int32), axis=1) - 1)
        last = jnp.maximum(last, jnp.max(jnp.where(tie & (tie_rank <= need), aux, -1), axis=1, keepdims=True))
        return (taken + jnp.sum(sel.astype(jnp.int32), axis=1, keepdims=True),
                ties + jnp.sum(tie.astype(jnp.int32), axis=1, keepdims=True), last)

    taken, _, last = jax.lax.fori_loop(0, tiles, body, (jnp.zeros_like(init),) * 2 + (init - 1,))
    return taken, last


def _barrier(interpret: bool) -> None:
    """The program's threads wait here for each other's stores (interpret mode runs a program as one sequence and has
    no barrier)."""
    if not interpret:
        plgpu.debug_barrier()


def _group_select_kernel(len_ref, bmax_ref, s_ref, bid_ref, list_ref, slots_ref, member_ref, *, g, gp, n, nb, k,
                         kq, sink, local, bucket, tb, tc, interpret):
    r = pl.program_id(0)
    length = len_ref[r]
    kp = k - sink - local
    heads = jnp.arange(gp, dtype=jnp.int32)[:, None]
    head = jnp.minimum(heads, g - 1)
    zero = jnp.zeros((gp, 1), jnp.int32)

    def bucket_tile(t):
        i = t * tb + jnp.arange(tb, dtype=jnp.int32)[None, :]
        x = plgpu.load(bmax_ref.at[r, head, jnp.minimum(i, nb - 1)], mask=i < nb, other=INT_MIN)
        return i, x

    tau = _kth(bucket_tile, pl.cdiv(nb, tb), kp, zero)

    def keep_bucket(t, i, sel, rank):
        plgpu.store(bid_ref.at[r, head, jnp.where(sel, rank, kp)], i + zero, mask=sel)

    taken, _ = _first(bucket_tile, pl.cdiv(nb, tb), kp, tau, zero, keep_bucket)
    s = jnp.arange(pl.next_power_of_2(kp + 1), dtype=jnp.int32)[None, :]
    plgpu.store(bid_ref.at[r, head, jnp.minimum(s, kp)], jnp.full(s.shape, nb, jnp.int32) + zero,
                mask=(s >= taken) & (s < kp))
    _barrier(interpret)

    def token_tile(t):
        j = t * tc + jnp.arange(tc, dtype=jnp.int32)[None, :]
        bid = plgpu.load(bid_ref.at[r, head, jnp.minimum(j // bucket, kp - 1)], mask=j < kp * bucket, other=nb)
        pos = bid * bucket + j % bucket
        ok = (bid < nb) & (pos < n) & middle(pos, length, sink, local)
        x = plgpu.load(s_ref.at[r, head, jnp.minimum(pos, n - 1)], mask=ok, other=0.0)
        return pos, jnp.where(ok, sortable_key(x), INT_MIN)

    tiles = pl.cdiv(kp * bucket, tc)
    v = _kth(token_tile, tiles, kp, zero)

    def keep_token(t, pos, sel, rank):
        plgpu.store(list_ref.at[r, jnp.where(sel, head * k + sink + rank, g * k)], pos, mask=sel)

    taken, last = _first(token_tile, tiles, kp, v, zero, keep_token)
    s = jnp.arange(kq, dtype=jnp.int32)[None, :]
    window = jnp.where(s < sink, s, jnp.maximum(sink, length - local) + s - sink - kp)
    window = jnp.where((s < sink) & (s < length) | (s >= sink + kp) & (window < length), window, -1)
    fill = (s < sink) | (s >= sink + taken)  # the windows, and the middle past the head's selections
    fill = fill & (s < k)
    plgpu.store(list_ref.at[r, jnp.where(fill, head * k + s, g * k)], window + zero, mask=fill)
    _barrier(interpret)

    for h in range(g):  # slot blocks of the heads, in order: a token stays in the first head's block holding it
        at = h * k + jnp.minimum(s, k - 1)
        tok = plgpu.load(list_ref.at[r, at])
        x = plgpu.load(s_ref.at[r, head, jnp.maximum(tok, 0)], mask=tok >= 0, other=0.0)
        key = sortable_key(x)
        ranked = (key > v) | (key == v) & (tok <= last)
        holds = (tok >= 0) & jnp.where(middle(tok, length, sink, local), ranked, tok < length)
        keep = (tok >= 0) & (jnp.sum((holds & (heads < h)).astype(jnp.int32), axis=0, keepdims=True) == 0)
        plgpu.store(slots_ref.at[r, at], jnp.where(keep, tok, -1))
        plgpu.store(member_ref.at[r, head, at], (holds & keep).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("k", "sink", "local", "interpret", "num_warps"))
def _group_select_pallas(scores, length, *, k, sink, local, interpret, num_warps):
    r, g, n = scores.shape
    nb = pl.cdiv(n, BUCKET)
    scores = scores.astype(jnp.float32)
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, nb * BUCKET - n))) if nb * BUCKET != n else scores
    tb = min(64, pl.next_power_of_2(nb))
    bmax = pl.pallas_call(
        functools.partial(bucket_max_kernel, tb=tb, nb=nb, bucket=BUCKET, sink=sink, local=local),
        out_shape=jax.ShapeDtypeStruct((r * g, nb), jnp.int32), grid=(r * g, pl.cdiv(nb, tb)),
        interpret=interpret, name=BUCKET_MAX_NAME, compiler_params=C.compiler_params(4),
    )(jnp.repeat(length, g), padded.reshape(r * g, nb, BUCKET)).reshape(r, g, nb)
    gp = pl.next_power_of_2(g)
    kp = k - sink - local
    per_head = max(TILE // gp, BUCKET)
    shapes = [((r, g, kp + 1), jnp.int32), ((r, g * k + 1), jnp.int32), ((r, g * k), jnp.int32), ((r, g, g * k), jnp.int32)]
    _, _, slots, member = pl.pallas_call(
        functools.partial(_group_select_kernel, g=g, gp=gp, n=n, nb=nb, k=k, kq=pl.next_power_of_2(k), sink=sink,
                          local=local, bucket=BUCKET, interpret=interpret, tb=min(per_head, pl.next_power_of_2(nb)),
                          tc=min(per_head, pl.next_power_of_2(kp * BUCKET))),
        out_shape=[jax.ShapeDtypeStruct(*shape) for shape in shapes], grid=(r,), interpret=interpret,
        name=KERNEL_NAME, compiler_params=C.compiler_params(num_warps),
    )(length, bmax, scores)
    return slots, member


def group_select(
    scores,  # f32 [R, G, n]
    length,  # i32 [R]
    *,
    k: int,
    sink: int,
    local: int,
    implementation: C.Implementation | None = None,
    interpret: bool | None = None,
    num_warps: int = 16,
):
    """``(slots i32 [R, G k], member i32 [R, G, G k])`` (see the module docstring); ``length`` in [0, n]."""
    implementation = C.resolve_implementation(implementation)
    _check(scores, length, k, sink, local)
    length = jnp.asarray(length, jnp.int32)
    if implementation == "xla":
        return group_select_reference(scores, length, k=k, sink=sink, local=local)
    return _group_select_pallas(scores, length, k=k, sink=sink, local=local,
                                interpret=C.resolve_interpret(interpret), num_warps=num_warps)
