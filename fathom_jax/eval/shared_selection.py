"""Selection shared across layers, in plain jnp: the semantics of :class:`~fathom_jax.methods.sharing.SharedSelection`
at one decode position, which the study measures (:mod:`~fathom_jax.eval.share_study`) and a decode step mirrors.

* :func:`~fathom_jax.decode.sharing.shared_positions` (the decode step's own): at a selection layer, the union of
  every query head's choices (all KV heads) ranked and cut to the budget, sink and local window first;
* :func:`shared_attention`: every head of a sharing layer attends exactly those positions (exact attention over the
  rows, each KV head its own K/V rows at the shared positions), or with ``attend=topk`` each head its own exact top k
  of them;
* :func:`stack_attention`: one layer stack at one position, the plan deciding per layer which of the two it runs.

With every layer a selection layer the stack is today's per-layer selection (``select_topk``, then
``sparse_attention``), bit for bit (``tests/eval/test_shared_selection.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from fathom_jax.decode.sharing import shared_positions
from fathom_jax.methods.sharing import SharedSelection, SharingPlan
from fathom_jax.select import (
    LOCAL_TOKENS,
    SINK_TOKENS,
    attend_rows,
    select_topk,
    sparse_attention,
)


def shared_attention(
    q: Float[Array, "*B Hkv G D"],
    keys: Float[Array, "*B Hkv n D"],
    values: Float[Array, "*B Hkv n D"],
    positions: Int[Array, "*B S"],
    mask: Bool[Array, "*B S"],
    *,
    scale: float | None = None,
    topk: tuple[int, Int[Array, "*B"] | int] | None = None,
) -> Float[Array, "*B Hkv G D"]:
    """Every head of a sharing layer over the shared positions: each KV head's own K/V rows there (fetched once per
    KV head, shared by its G query heads), exact softmax attention (f32) over the slots ``mask`` admits.

    ``topk = (k, length)``: each head attends only its own ``select_topk`` of exact scores ``q . k`` restricted to
    the shared positions (sink and local window forced, as a selection layer's head), the sequence ``length`` long.
    """
    if topk is not None:
        return _shared_topk_attention(q, keys, values, positions, mask, *topk, scale=scale)
    *batch, hkv, g, _ = q.shape
    at = jnp.broadcast_to(positions[..., None, :, None], (*batch, hkv, positions.shape[-1], 1))
    rows_k = jnp.take_along_axis(keys, at, axis=-2)[..., None, :, :]  # [*B, Hkv, 1, S, D]
    rows_v = jnp.take_along_axis(values, at, axis=-2)[..., None, :, :]
    heads_mask = jnp.broadcast_to(mask[..., None, None, :], (*batch, hkv, g, mask.shape[-1]))
    return attend_rows(q, rows_k, rows_v, heads_mask, scale=scale)


def _shared_topk_attention(q, keys, values, positions, mask, k: int, length, *, scale):
    """Each head's exact top ``k`` among the shared positions: every position's exact score, those outside the set
    at -inf, then today's selection and sparse attention over them (the decode step ranks its fetched rows
    instead)."""
    *batch, hkv, _, _ = q.shape
    n = keys.shape[-2]
    scores = jnp.einsum("...hgd,...hnd->...hgn", q.astype(jnp.float32), keys.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    in_set = jnp.zeros((*batch, n), bool)
    in_set = jax.vmap(lambda row, at, ok: row.at[jnp.where(ok, at, n)].set(True, mode="drop"))(
        in_set.reshape(-1, n), positions.reshape(-1, positions.shape[-1]), mask.reshape(-1, mask.shape[-1])
    ).reshape(*batch, n)
    length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), tuple(batch))
    pos = jnp.arange(n)
    forced = (pos < SINK_TOKENS) | (pos >= length[..., None] - LOCAL_TOKENS)  # only where the set holds them
    scores = jnp.where((in_set & forced)[..., None, None, :], jnp.inf, scores)
    scores = jnp.where(in_set[..., None, None, :], scores, -jnp.inf)
    idx, sel = select_topk(scores, jnp.broadcast_to(length[..., None], (*batch, hkv)), k, sink=0, local=0,
                           implementation="xla")
    return sparse_attention(q, keys, values, idx, sel, scale=scale)


def stack_attention(
    plan: SharingPlan,
    sharing: SharedSelection,
    q: Sequence[Float[Array, "*B Hkv G D"]],
    keys: Sequence[Float[Array, "*B Hkv n D"]],
    values: Sequence[Float[Array, "*B Hkv n D"]],
    length: Int[Array, "*B"] | int,
    scores: Sequence[Float[Array, "*B Hkv G n"] | None],
    k: int,
    *,
    scale: float | None = None,
) -> list[Float[Array, "*B Hkv G D"]]:
    """Attention outputs of every scanning layer of ``plan`` at one decode position (the reference semantics).

    A selection layer attends each head's own ``select_topk`` of its ``scores`` (k per head, as without sharing) and
    publishes :func:`shared_positions` of the same scores; a sharing layer attends the last published set
    (:func:`shared_attention`: all of it, or with ``sharing.attending == "topk"`` each head its exact top ``k``) and
    its ``scores`` are not read (pass None: it scans nothing). ``scale``: the attention logit scale (default
    ``1 / sqrt(D)``), also the rankings' temperature.
    """
    n_layers = len(plan.selects)
    if not len(q) == len(keys) == len(values) == len(scores) == n_layers:
        raise ValueError(f"stack_attention: q, keys, values and scores must hold one entry per scanning layer of the "
                         f"plan ({n_layers}), got {len(q)}, {len(keys)}, {len(values)}, {len(scores)}")
    sharing.validate(k, keys[0].shape[-2])
    scale = 1.0 / np.sqrt(q[0].shape[-1]) if scale is None else scale
    length = jnp.asarray(length, jnp.int32)
    outputs, shared = [], None
    for layer, selects in enumerate(plan.selects):
        if not selects:
            topk = (k, length) if sharing.attending == "topk" else None
            outputs.append(shared_attention(q[layer], keys[layer], values[layer], *shared, scale=scale, topk=topk))
            continue
        if scores[layer] is None:
            raise ValueError(f"stack_attention: selection layer {plan.layers[layer]} needs its scores")
        idx, mask = select_topk(scores[layer], length[..., None], k, implementation="xla")
        outputs.append(sparse_attention(q[layer], keys[layer], values[layer], idx, mask, scale=scale))
        if not plan.every_layer_selects:
            shared = shared_positions(scores[layer], length, sharing.budget, scale=scale, ranking=sharing.ranking)
    return outputs
