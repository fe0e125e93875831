"""Exact attention of a group's query heads over its selected rows, each row read by its index where it lies.

``q [R, G, Dh]``, the rows ``[*, n, 2 Dh]`` in the model dtype (key in the first ``Dh`` features, value in the
last; a :class:`~pallas_kernels.operands.StoredRows`: a stacked ``[L, R, n, W]`` cache read at its layer, or a
fetched buffer), the union ``slots [R, S]`` (a row index, ``-1``: none) and ``member [R, G, S]`` (which head attends
which slot) give ``out f32 [R, G, Dh]``: each head's softmax attention over its own slots, f32 throughout; a head
with no slot gets zeros. ``new_row [R, 2 Dh]`` at ``new_position [R]`` stands in for the stored row of that index
(the token a decode step adds, which the cache holds only once the step writes it).

One program per (group, share of the slots), flash-decoding style: it walks its slots ``block`` rows at a time,
gathering each row by index straight from where it lies (no gathered copy of the rows), keeps a running maximum,
sum and weighted sum of values per head, and writes them; one small combine over the shares normalizes. From host
memory the rows are better fetched first (:mod:`pallas_kernels.row_fetch`: requests in flight, pages sorted) and
attended here from that buffer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import backend as B
from pallas_kernels.operands import StoredRows

KERNEL_NAME = "sparse_attend"


@dataclasses.dataclass(frozen=True)
class SparseAttendConfig:
    """``block``: rows per step of a program's loop (a power of two); ``shares``: programs per group (a power of
    two; None: enough to give a batch-1 step's groups about 64 programs); ``num_warps``: Triton warps."""

    block: int = 16
    shares: int | None = None
    num_warps: int = 4

    def __post_init__(self):
        B.check_pow2("block", self.block)
        if self.shares is not None:
            B.check_pow2("shares", self.shares)

    def resolved_shares(self, groups: int, slots: int) -> int:
        shares = self.shares or pl.next_power_of_2(max(1, 64 // groups))
        return max(1, min(shares, pl.next_power_of_2(pl.cdiv(slots, self.block))))


def _kernel(q_ref, slots_ref, member_ref, layer_ref, new_ref, position_ref, rows_ref, m_ref, l_ref, acc_ref, *,
            groups, head_dim, block, per_share, slots, n, group_start, scale, has_new):
    r, p = pl.program_id(0), pl.program_id(1)
    gp = pl.next_power_of_2(groups)
    h = jnp.arange(gp, dtype=jnp.int32)
    d = jnp.arange(head_dim, dtype=jnp.int32)
    q = plgpu.load(q_ref.at[r, h[:, None], d[None, :]], mask=(h < groups)[:, None], other=0.0) * scale
    layer, group = layer_ref[0], r + group_start
    end = jnp.minimum(slots, (p + 1) * per_share)
    if has_new:
        new_k = new_ref[r, pl.ds(0, head_dim)].astype(jnp.float32)
        new_v = new_ref[r, pl.ds(head_dim, head_dim)].astype(jnp.float32)
        new_at = position_ref[r]

    def body(i, carry):
        m, total, acc = carry
        s = p * per_share + i * block + jnp.arange(block, dtype=jnp.int32)
        inside = s < end
        index = plgpu.load(slots_ref.at[r, s], mask=inside, other=-1)
        valid = inside & (index >= 0) & (index < n)
        at = jnp.where(valid, index, 0)
        k = plgpu.load(rows_ref.at[layer, group, at[:, None], d[None, :]], mask=valid[:, None],
                       other=0).astype(jnp.float32)
        v = plgpu.load(rows_ref.at[layer, group, at[:, None], head_dim + d[None, :]], mask=valid[:, None],
                       other=0).astype(jnp.float32)
        if has_new:
            new = (valid & (index == new_at))[:, None]
            k, v = jnp.where(new, new_k[None, :], k), jnp.where(new, new_v[None, :], v)
        attends = plgpu.load(member_ref.at[r, h[:, None], s[None, :]], mask=(h < groups)[:, None] & inside[None, :],
                             other=0) != 0
        logits = jnp.where(attends, jnp.sum(q[:, None, :] * k[None, :, :], axis=-1), -jnp.inf)  # [Gp, block]
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        keep = jnp.where(m_new == -jnp.inf, 0.0, jnp.exp(m - m_new))  # nothing attended yet: nothing to keep
        weights = jnp.where(attends, jnp.exp(logits - m_new[:, None]), 0.0)
        total = total * keep + jnp.sum(weights, axis=1)
        acc = acc * keep[:, None] + jnp.sum(weights[:, :, None] * v[None, :, :], axis=1)
        return m_new, total, acc

    init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32),
            jnp.zeros((gp, head_dim), jnp.float32))
    m, total, acc = jax.lax.fori_loop(0, pl.cdiv(per_share, block), body, init)
    m_ref[r, p, pl.ds(0, gp)] = m
    l_ref[r, p, pl.ds(0, gp)] = total
    acc_ref[r, p, :, :] = acc


@functools.partial(jax.jit, static_argnames=("config", "interpret", "scale"))
def _sparse_attend_pallas(q, rows: StoredRows, slots, member, new_row, new_position, *, config, interpret, scale):
    r, g, head_dim = q.shape
    s = slots.shape[1]
    gp = pl.next_power_of_2(g)
    shares = config.resolved_shares(r, s)
    per_share = pl.cdiv(pl.cdiv(s, shares), config.block) * config.block
    has_new = new_row is not None
    if not has_new:
        new_row, new_position = jnp.zeros((r, 2 * head_dim), rows.keys.dtype), jnp.zeros((r,), jnp.int32)
    m, total, acc = pl.pallas_call(
        functools.partial(_kernel, groups=g, head_dim=head_dim, block=config.block, per_share=per_share, slots=s,
                          n=rows.keys.shape[-2], group_start=rows.group_start, scale=scale, has_new=has_new),
        out_shape=(jax.ShapeDtypeStruct((r, shares, gp), jnp.float32), jax.ShapeDtypeStruct((r, shares, gp), jnp.float32),
                   jax.ShapeDtypeStruct((r, shares, gp, head_dim), jnp.float32)),
        grid=(r, shares), in_specs=[B.any_spec()] * 7, interpret=interpret, name=KERNEL_NAME,
        compiler_params=B.compiler_params(config.num_warps),
    )(q.astype(jnp.float32), slots, member.astype(jnp.int32), rows.layer, new_row, new_position, rows.keys)
    # the shares combined: each rescaled to the largest running maximum of its head
    top = jnp.max(m, axis=1, keepdims=True)
    weight = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - jnp.where(top == -jnp.inf, 0.0, top)))
    total = jnp.sum(weight * total, axis=1)
    out = jnp.sum(weight[..., None] * acc, axis=1) / jnp.where(total > 0, total, 1.0)[..., None]
    return out[:, :g]


def _validate(q, rows: StoredRows, slots, member, new_row, new_position):
    B.check_array("q", q, ndim=3, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16))
    B.check_array("slots", slots, ndim=2, dtypes=(jnp.int32,))
    B.check_array("rows.keys", rows.keys, ndim_min=3, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16))
    r, g, head_dim = q.shape
    if rows.values is not None or rows.columns is not None:
        raise ValueError("sparse_attend reads rows of [key | value] side by side: rows.values and rows.columns must "
                         "be None")
    if rows.keys.shape[-1] != 2 * head_dim:
        raise ValueError(f"rows must be [.., n, 2 Dh] = [.., n, {2 * head_dim}] (key and value side by side), got "
                         f"{rows.keys.shape}")
    if not B.is_pow2(head_dim):
        raise ValueError(f"head_dim must be a power of two (Triton blocks), got {head_dim}")
    lead = 0 if rows.layer is None else 1
    B.request_groups(rows.keys.shape[lead:-2], (r,), rows.layer, rows.group_start, "sparse_attend")
    if slots.shape[0] != r or member.shape != (r, g, slots.shape[1]):
        raise ValueError(f"slots must be [R, S] and member [R, G, S] with R, G = {r, g}, got {slots.shape}, "
                         f"{member.shape}")
    if (new_row is None) != (new_position is None):
        raise ValueError("new_row and new_position come together (both or neither)")
    if new_row is not None and (new_row.shape != (r, 2 * head_dim) or new_position.shape != (r,)):
        raise ValueError(f"new_row must be [R, 2 Dh] = {[r, 2 * head_dim]} and new_position [R], got {new_row.shape}, "
                         f"{new_position.shape}")


def sparse_attend_reference(q, rows: StoredRows, slots, member, *, new_row=None, new_position=None,
                            scale: float | None = None):
    """Plain jnp: the selected rows gathered (zero rows at ``-1``), the new row put in, each head's masked softmax."""
    _validate(q, rows, slots, member, new_row, new_position)
    r, g, head_dim = q.shape
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    keys = rows.keys if rows.layer is None else rows.keys[rows.layer]
    keys = keys.reshape(-1, *keys.shape[-2:])[rows.group_start:rows.group_start + r]
    n = keys.shape[-2]
    valid = (slots >= 0) & (slots < n)
    got = jnp.where(valid[..., None], jnp.take_along_axis(keys, jnp.where(valid, slots, 0)[..., None], axis=1), 0)
    if new_row is not None:
        got = jnp.where((valid & (slots == new_position[:, None]))[..., None], new_row[:, None, :].astype(got.dtype),
                        got)
    k, v = got[..., :head_dim].astype(jnp.float32), got[..., head_dim:].astype(jnp.float32)
    attends = member != 0
    logits = jnp.einsum("rgd,rsd->rgs", q.astype(jnp.float32), k, precision="highest") * scale
    weights = jax.nn.softmax(jnp.where(attends, logits, -jnp.inf), axis=-1, where=attends)
    weights = jnp.where(attends, weights, 0.0)
    return jnp.einsum("rgs,rsd->rgd", weights, v, precision="highest")


def sparse_attend(q, rows: StoredRows, slots, member, *, new_row=None, new_position=None, scale: float | None = None,
                  implementation: B.Implementation | None = None, config: SparseAttendConfig | None = None,
                  interpret: bool | None = None):
    """``out f32 [R, G, Dh]`` (see the module docstring); ``rows`` at a layer are read for groups ``rows.group_start ..
    + R - 1``; ``scale`` defaults to ``1 / sqrt(Dh)``."""
    implementation = B.resolve_implementation(implementation)
    if implementation == "xla":
        return sparse_attend_reference(q, rows, slots, member, new_row=new_row, new_position=new_position,
                                       scale=scale)
    _validate(q, rows, slots, member, new_row, new_position)
    head_dim = q.shape[-1]
    keys, layer = B.layered(rows.keys, rows.layer, 2, "rows.keys")
    stacked = dataclasses.replace(rows, keys=keys, layer=layer)
    return _sparse_attend_pallas(q, stacked, slots, member, new_row, new_position, config=config or SparseAttendConfig(),
                                 interpret=B.resolve_interpret(interpret),
                                 scale=float(1.0 / np.sqrt(head_dim) if scale is None else scale))
