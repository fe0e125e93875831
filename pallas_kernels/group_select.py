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

1. ``group_bucket_max`` (grid rows x tiles): the maxima of 32-token buckets, and of groups of ``gsz`` buckets (as
   many groups as one program holds for every head, :func:`group_size`: 16 buckets at 1M tokens and 4 heads).
2. ``group_select`` (one program per group, every head at once, its loops over global memory in tiles):

   * ``tau0``, the k'-th largest group maximum, held in registers: k' groups hold a bucket >= it, so ``tau`` (the
     k'-th largest bucket maximum) is >= it, and only the buckets >= ``tau0`` are kept (compacted in index order);
   * ``tau`` among them by a 32-round bitwise search; the buckets above it and then the first ones equal to it (k'
     buckets, which hold the top k' pairs);
   * their tokens >= ``tau`` (each chosen bucket holds one, so ``v >= tau``), compacted; ``v`` and ``p`` among
     them; the head's slots;
   * per slot, which heads hold its token (their scores at it against their ``v`` and ``p``).

   The compacted lists pass through scratch outputs in global memory, behind barriers. They hold a few times k'
   entries on real scores; scores tied at scale keep up to every bucket (the same result, more tiles to search).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as C
from pallas_kernels.topk_radix import BUCKET, INT_MIN, middle, sink_local, sortable_key

KERNEL_NAME = "group_select"
BUCKET_MAX_NAME = "group_bucket_max"
TILE = 4096  # elements of a tile step over every head: bounded registers at any n
REGISTERS = 16384  # group maxima of every head held at once by one program


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


def _kth(load, tiles, kth: int, init):
    """Per head (``[Gp, 1]``), the ``kth`` largest of the int32 keys ``load(t)`` yields for tiles ``t < tiles``
    (INT_MIN marks none; INT_MIN if fewer): 32 one-bit rounds, each a pass over the tiles. The first tile (often the
    only one) stays in registers over the rounds."""
    flip = jnp.int32(INT_MIN)
    first = load(0)[1]

    def rnd(i, prefix):  # the prefix in unsigned order (bits), each candidate compared in signed space
        bit = prefix | jnp.left_shift(jnp.int32(1), 31 - i)
        ge = lambda x: jnp.sum((x >= bit ^ flip).astype(jnp.int32), axis=1, keepdims=True)  # noqa: E731
        cnt = jax.lax.fori_loop(1, tiles, lambda t, cnt: cnt + ge(load(t)[1]), ge(first))
        return jnp.where(cnt >= kth, bit, prefix)

    return jax.lax.fori_loop(0, 32, rnd, init) ^ flip


def _first(load, tiles, kth: int, v, init, emit):
    """Per head, the keys above ``v`` and then the first ties, up to ``kth`` in all, in tile order: calls
    ``emit(aux, sel, rank)`` per tile (``rank``: 0-based slot of each selected element); returns the count and the
    position ``aux`` of the last tie taken (-1 if none). The first tile is loaded once."""
    first = load(0)
    above = lambda x: jnp.sum((x > v).astype(jnp.int32), axis=1, keepdims=True)  # noqa: E731
    need = kth - jax.lax.fori_loop(1, tiles, lambda t, cnt: cnt + above(load(t)[1]), above(first[1]))

    def take(tile, carry):
        (aux, x), (taken, ties, last) = tile, carry
        tie = (x == v) & (x > INT_MIN)
        tie_rank = ties + jnp.cumsum(tie.astype(jnp.int32), axis=1)
        sel = (x > v) | (tie & (tie_rank <= need))
        emit(aux, sel, taken + jnp.cumsum(sel.astype(jnp.int32), axis=1) - 1)
        last = jnp.maximum(last, jnp.max(jnp.where(tie & (tie_rank <= need), aux, -1), axis=1, keepdims=True))
        return (taken + jnp.sum(sel.astype(jnp.int32), axis=1, keepdims=True),
                ties + jnp.sum(tie.astype(jnp.int32), axis=1, keepdims=True), last)

    carry = take(first, (jnp.zeros_like(init),) * 2 + (init - 1,))
    taken, _, last = jax.lax.fori_loop(1, tiles, lambda t, carry: take(load(t), carry), carry)
    return taken, last


def _barrier(interpret: bool) -> None:
    """The program's threads wait here for each other's stores (interpret mode runs a program as one sequence and has
    no barrier)."""
    if not interpret:
        plgpu.debug_barrier()


def _bucket_max_kernel(len_ref, s_ref, bmax_ref, gmax_ref, *, tg, gsz, nb, ng, sink, local):
    """Program (row, tile): the maxima of ``tg`` groups of ``gsz`` buckets, and of those buckets (INT_MIN: none)."""
    row = pl.program_id(0)
    gi = pl.program_id(1) * tg + jnp.arange(tg, dtype=jnp.int32)
    b = gi[:, None] * gsz + jnp.arange(gsz, dtype=jnp.int32)[None, :]
    col = jnp.arange(BUCKET, dtype=jnp.int32)[None, None, :]
    x = plgpu.load(s_ref.at[row, jnp.minimum(b, nb - 1)[:, :, None], col], mask=(b < nb)[:, :, None], other=0.0)
    ok = middle(b[:, :, None] * BUCKET + col, len_ref[row], sink, local) & (b < nb)[:, :, None]
    bmax = jnp.max(jnp.where(ok, sortable_key(x), INT_MIN), axis=2)
    plgpu.store(bmax_ref.at[row, jnp.minimum(b, nb - 1)], bmax, mask=b < nb)
    plgpu.store(gmax_ref.at[row, jnp.minimum(gi, ng - 1)], jnp.max(bmax, axis=1), mask=gi < ng)


def _compact(load, tiles, keep, r, head, pos_ref, key_ref, cap, zero):
    """Per head, ``load``'s elements where ``keep`` (positions and keys, in tile order) to ``pos_ref`` / ``key_ref``
    ``[R, G, cap + 1]`` (column ``cap`` takes the lanes left out); returns how many per head."""
    def body(t, count):
        aux, x = load(t)
        sel = keep(x)
        at = (r, head, jnp.where(sel, count + jnp.cumsum(sel.astype(jnp.int32), axis=1) - 1, cap))
        plgpu.store(pos_ref.at[at], aux, mask=sel)
        plgpu.store(key_ref.at[at], x, mask=sel)
        return count + jnp.sum(sel.astype(jnp.int32), axis=1, keepdims=True)

    return jax.lax.fori_loop(0, tiles, body, zero)


def _group_select_kernel(len_ref, gmax_ref, bmax_ref, s_ref, cb_ref, ck_ref, bid_ref, tp_ref, tk_ref, list_ref,
                         slots_ref, member_ref, *, g, gp, n, nb, ng, ngp, k, kq, sink, local, tb, tc, interpret):
    r = pl.program_id(0)
    length = len_ref[r]
    kp = k - sink - local
    heads = jnp.arange(gp, dtype=jnp.int32)[:, None]
    head = jnp.minimum(heads, g - 1)
    zero = jnp.zeros((gp, 1), jnp.int32)

    # tau0, the k'-th largest group maximum, bounds tau from below (k' groups hold a bucket >= it): only the buckets
    # >= tau0 are searched, a few times k' of them unless scores tie at scale (then up to every bucket, slower).
    i = jnp.arange(ngp, dtype=jnp.int32)[None, :]
    gmax = plgpu.load(gmax_ref.at[r, head, jnp.minimum(i, ng - 1)], mask=i < ng, other=INT_MIN)
    tau0 = _kth(lambda t: (None, gmax), 1, kp, zero)

    def bucket_tile(t):
        i = t * tb + jnp.arange(tb, dtype=jnp.int32)[None, :]
        return i + zero, plgpu.load(bmax_ref.at[r, head, jnp.minimum(i, nb - 1)], mask=i < nb, other=INT_MIN)

    above0 = lambda x: (x >= tau0) & (x > INT_MIN)  # noqa: E731
    held = _compact(bucket_tile, pl.cdiv(nb, tb), above0, r, head, cb_ref, ck_ref, nb, zero)
    _barrier(interpret)

    def held_tile(pos_ref, key_ref, count, size, cap):
        def load(t):
            j = t * size + jnp.arange(size, dtype=jnp.int32)[None, :]
            at = (r, head, jnp.minimum(j, cap - 1))
            return plgpu.load(pos_ref.at[at]), jnp.where(j < count, plgpu.load(key_ref.at[at]), INT_MIN)
        return load

    bucket_held = held_tile(cb_ref, ck_ref, held, tb, nb)
    tiles = pl.cdiv(jnp.max(held), tb)
    tau = _kth(bucket_held, tiles, kp, zero)

    def keep_bucket(i, sel, rank):
        plgpu.store(bid_ref.at[r, head, jnp.where(sel, rank, kp)], i, mask=sel)

    taken, _ = _first(bucket_held, tiles, kp, tau, zero, keep_bucket)
    s = jnp.arange(pl.next_power_of_2(kp + 1), dtype=jnp.int32)[None, :]
    plgpu.store(bid_ref.at[r, head, jnp.minimum(s, kp)], jnp.full(s.shape, nb, jnp.int32) + zero,
                mask=(s >= taken) & (s < kp))
    _barrier(interpret)

    def token_tile(t):
        j = t * tc + jnp.arange(tc, dtype=jnp.int32)[None, :]
        bid = plgpu.load(bid_ref.at[r, head, jnp.minimum(j // BUCKET, kp - 1)], mask=j < kp * BUCKET, other=nb)
        pos = bid * BUCKET + j % BUCKET
        ok = (bid < nb) & (pos < n) & middle(pos, length, sink, local)
        x = plgpu.load(s_ref.at[r, head, jnp.minimum(pos, n - 1)], mask=ok, other=0.0)
        return pos, jnp.where(ok, sortable_key(x), INT_MIN)

    # Every one of the k' tokens reaches tau (each selected bucket holds one): only tokens >= tau are searched.
    cap = kp * BUCKET
    above = lambda x: (x >= tau) & (x > INT_MIN)  # noqa: E731
    held = _compact(token_tile, pl.cdiv(cap, tc), above, r, head, tp_ref, tk_ref, cap, zero)
    _barrier(interpret)
    token_held = held_tile(tp_ref, tk_ref, held, tc, cap)
    tiles = pl.cdiv(jnp.max(held), tc)
    v = _kth(token_held, tiles, kp, zero)

    def keep_token(pos, sel, rank):
        plgpu.store(list_ref.at[r, jnp.where(sel, head * k + sink + rank, g * k)], pos, mask=sel)

    taken, last = _first(token_held, tiles, kp, v, zero, keep_token)
    s = jnp.arange(kq, dtype=jnp.int32)[None, :]
    window = jnp.where(s < sink, s, jnp.maximum(sink, length - local) + s - sink - kp)
    window = jnp.where((s < sink) & (s < length) | (s >= sink + kp) & (window < length), window, -1)
    fill = ((s < sink) | (s >= sink + taken)) & (s < k)  # the windows, and the middle past the head's selections
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


def group_size(heads: int, nb: int, registers: int = REGISTERS) -> int:
    """Buckets per group of the bucket-maxima kernel's second output: a power of two that keeps a group's maxima of
    every head (``heads x groups``, rounded up to powers of two) within ``registers`` elements of one program."""
    gsz, gp = 1, pl.next_power_of_2(heads)
    while gp * pl.next_power_of_2(pl.cdiv(nb, gsz)) > registers:
        gsz *= 2
    return gsz


@functools.partial(jax.jit, static_argnames=("k", "sink", "local", "interpret", "num_warps", "tile", "registers"))
def _group_select_pallas(scores, length, *, k, sink, local, interpret, num_warps, tile, registers):
    r, g, n = scores.shape
    nb = pl.cdiv(n, BUCKET)
    scores = scores.astype(jnp.float32)
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, nb * BUCKET - n))) if nb * BUCKET != n else scores
    gsz = group_size(g, nb, registers)
    ng = pl.cdiv(nb, gsz)
    tg = max(1, min(64 // gsz, pl.next_power_of_2(ng)))
    gmax, bmax = pl.pallas_call(
        functools.partial(_bucket_max_kernel, tg=tg, gsz=gsz, nb=nb, ng=ng, sink=sink, local=local),
        out_shape=(jax.ShapeDtypeStruct((r * g, nb), jnp.int32), jax.ShapeDtypeStruct((r * g, ng), jnp.int32)),
        grid=(r * g, pl.cdiv(ng, tg)), interpret=interpret, name=BUCKET_MAX_NAME, compiler_params=C.compiler_params(4),
    )(jnp.repeat(length, g), padded.reshape(r * g, nb, BUCKET))[::-1]
    gp = pl.next_power_of_2(g)
    kp = k - sink - local
    per_head = max(tile // gp, BUCKET)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    scratch = [i32(r, g, nb + 1)] * 2 + [i32(r, g, kp + 1)] + [i32(r, g, kp * BUCKET + 1)] * 2 + [i32(r, g * k + 1)]
    *_, slots, member = pl.pallas_call(
        functools.partial(_group_select_kernel, g=g, gp=gp, n=n, nb=nb, ng=ng, ngp=pl.next_power_of_2(ng), k=k,
                          kq=pl.next_power_of_2(k), sink=sink, local=local, interpret=interpret,
                          tb=min(per_head, pl.next_power_of_2(nb)), tc=min(per_head, pl.next_power_of_2(kp * BUCKET))),
        out_shape=[*scratch, i32(r, g * k), i32(r, g, g * k)], grid=(r,), interpret=interpret,
        name=KERNEL_NAME, compiler_params=C.compiler_params(num_warps),
    )(length, gmax.reshape(r, g, ng), bmax.reshape(r, g, nb), scores)
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
    tile: int = TILE,
    registers: int = REGISTERS,
):
    """``(slots i32 [R, G k], member i32 [R, G, G k])`` (see the module docstring); ``length`` in [0, n]. ``tile``:
    elements per step of the loops over every head; ``registers``: group maxima one program holds (powers of two;
    tests lower both to reach several tiles and wide groups on small rows)."""
    implementation = C.resolve_implementation(implementation)
    _check(scores, length, k, sink, local)
    length = jnp.asarray(length, jnp.int32)
    if implementation == "xla":
        return group_select_reference(scores, length, k=k, sink=sink, local=local)
    C.check_pow2("tile", tile)
    C.check_pow2("registers", registers)
    return _group_select_pallas(scores, length, k=k, sink=sink, local=local, interpret=C.resolve_interpret(interpret),
                                num_warps=num_warps, tile=tile, registers=registers)
