"""The union of a KV group's per-head selections, laid out as one sort would lay it out, without sorting.

``selected i32 [R, G, >= k]`` (each head's ``k`` positions in its first ``k`` columns, distinct, ``-1`` where fewer;
as :mod:`pallas_kernels.candidate_topk` writes them) gives, over the ``S = G k`` entries of a group:

* ``slots i32 [R, S]``: the entries in increasing position order, duplicates (a token more than one head chose)
  and padding as ``-1`` after the first copy of each token, so ``slots[u]`` holds a token exactly where a stable
  sort of the entries puts its first copy; the padding at the end;
* ``member i32 [R, G, S]``: 1 where head ``g`` chose the token of slot ``u``.

That is the layout of the library's sort-based union (``fathom_jax.select.group_union``), bit for bit, so attention
over it sums in the same order. Each entry's slot is the number of entries below it plus its copies before it in
(head, column) order; one program per (group, tile of entries) counts them against all ``S`` entries (``S^2``
comparisons a group, spread over ``S / tile`` programs), and writes its entries' slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as B

KERNEL_NAME = "group_union"
_BIG = 2**31 - 1  # above every position: padding sorts last
MAX_TILE = 128  # entries per program
CHUNK = 32  # entries compared per step of a program's loop


def _tile(s: int) -> int:
    """Entries per program: the largest power of two up to MAX_TILE dividing ``s`` (then no lane is masked), or
    MAX_TILE with a scratch column where ``s`` has no such divisor of at least 16."""
    tile = MAX_TILE
    while tile >= 16 and s % tile:
        tile //= 2
    return tile if tile >= 16 else MAX_TILE


def _kernel(sel_ref, slots_ref, member_ref, *, groups, k, tile):
    r, c = pl.program_id(0), pl.program_id(1)
    s = groups * k
    e = c * tile + jnp.arange(tile, dtype=jnp.int32)
    inside = e < s
    x = plgpu.load(sel_ref.at[r, jnp.minimum(e // k, groups - 1), e % k], mask=inside, other=-1)
    valid = inside & (x >= 0)
    x = jnp.where(valid, x, _BIG)

    def body(i, carry):
        below, copies, earlier_valid, total, hits = carry
        j = i * CHUNK + jnp.arange(CHUNK, dtype=jnp.int32)
        there = j < s
        y = plgpu.load(sel_ref.at[r, jnp.minimum(j // k, groups - 1), j % k], mask=there, other=-1)
        ok = there & (y >= 0)
        y = jnp.where(ok, y, _BIG)
        same = (y[None, :] == x[:, None]) & ok[None, :]
        earlier = j[None, :] < e[:, None]
        below += jnp.sum(((y[None, :] < x[:, None]) & ok[None, :]).astype(jnp.int32), axis=1)
        copies += jnp.sum((same & earlier).astype(jnp.int32), axis=1)
        earlier_valid += jnp.sum((ok[None, :] & earlier).astype(jnp.int32), axis=1)
        total += jnp.sum(ok.astype(jnp.int32))
        head = j // k
        hits = tuple(hit + jnp.sum((same & (head[None, :] == g)).astype(jnp.int32), axis=1) for g, hit in
                     enumerate(hits))
        return below, copies, earlier_valid, total, hits

    zeros = jnp.zeros((tile,), jnp.int32)
    below, copies, earlier_valid, total, hits = jax.lax.fori_loop(
        0, pl.cdiv(s, CHUNK), body, (zeros, zeros, zeros, jnp.int32(0), (zeros,) * groups))
    slot = jnp.where(valid, below + copies, total + e - earlier_valid)
    slot = jnp.where(inside, slot, slots_ref.shape[-1] - 1)  # masked lanes: the scratch column
    first = valid & (copies == 0)
    plgpu.store(slots_ref.at[r, slot], jnp.where(first, x, -1), mask=inside)
    for g, hit in enumerate(hits):
        plgpu.store(member_ref.at[r, jnp.int32(g), slot], (first & (hit > 0)).astype(jnp.int32), mask=inside)


@functools.partial(jax.jit, static_argnames=("k", "interpret", "num_warps"))
def _group_union_pallas(selected, *, k, interpret, num_warps):
    r, g = selected.shape[:2]
    s = g * k
    tile = _tile(s)
    width = s if s % tile == 0 else s + 1
    slots, member = pl.pallas_call(
        functools.partial(_kernel, groups=g, k=k, tile=tile),
        out_shape=(jax.ShapeDtypeStruct((r, width), jnp.int32), jax.ShapeDtypeStruct((r, g, width), jnp.int32)),
        grid=(r, pl.cdiv(s, tile)), in_specs=[B.any_spec()], interpret=interpret, name=KERNEL_NAME,
        compiler_params=B.compiler_params(num_warps),
    )(selected)
    return (slots, member) if width == s else (slots[:, :s], member[..., :s])


def _validate(selected, k):
    B.check_array("selected", selected, ndim=3, dtypes=(jnp.int32,))
    if not isinstance(k, int) or not 1 <= k <= selected.shape[-1]:
        raise ValueError(f"k must be an int in [1, {selected.shape[-1]}] (the columns of selected), got {k!r}")


def group_union_reference(selected, *, k: int):
    """Plain jnp: the entries sorted, first copies kept, each head's membership by comparison."""
    _validate(selected, k)
    r, g = selected.shape[:2]
    heads = selected[..., :k]
    flat = jnp.where(heads >= 0, heads, _BIG).reshape(r, g * k)
    ordered = jnp.sort(flat, axis=-1)
    first = jnp.concatenate([jnp.ones((r, 1), bool), ordered[:, 1:] != ordered[:, :-1]], axis=-1) & (ordered != _BIG)
    slots = jnp.where(first, ordered, -1)
    chose = jnp.any(heads[:, :, None, :] == ordered[:, None, :, None], axis=-1)  # [R, G, S]
    return slots, (chose & first[:, None, :]).astype(jnp.int32)


def group_union(selected, *, k: int, implementation: B.Implementation | None = None, num_warps: int = 4,
                interpret: bool | None = None):
    """``(slots i32 [R, G k], member i32 [R, G, G k])`` of the heads' selections ``selected i32 [R, G, >= k]`` (see
    the module docstring)."""
    implementation = B.resolve_implementation(implementation)
    _validate(selected, k)
    if implementation == "xla":
        return group_union_reference(selected, k=k)
    return _group_union_pallas(selected, k=k, interpret=B.resolve_interpret(interpret), num_warps=num_warps)
