"""Selection shared across layers, in plain jnp: the semantics of :class:`~fathom_jax.methods.sharing.SharedSelection`
at one decode position, which the study measures (:mod:`~fathom_jax.eval.share_study`) and a decode step mirrors.

* :func:`shared_positions`: at a selection layer, the union of every query head's choices (all KV heads) ranked and
  cut to the budget, sink and local window first;
* :func:`shared_attention`: every head of a sharing layer attends exactly those positions (exact attention over the
  rows, each KV head its own K/V rows at the shared positions);
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

from fathom_jax.methods.sharing import RANKINGS, Ranking, SharedSelection, SharingPlan
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS, attend_rows, select_topk, sparse_attention


def shared_positions(
    scores: Float[Array, "*B Hkv G n"],
    length: Int[Array, "*B"] | int,
    budget: int,
    *,
    scale: float,
    ranking: Ranking = "mass",
    sink: int = SINK_TOKENS,
    local: int = LOCAL_TOKENS,
) -> tuple[Int[Array, "*B S"], Bool[Array, "*B S"]]:
    """The ``S = budget`` positions a selection layer hands to the layers after it, and a mask of the slots that hold
    one (all of them unless ``length < budget``), in rank order: the sink and local tokens (in position order),
    then the rest of the valid positions by ``ranking`` over every head of every KV head, ties to the lower position.
    A smaller budget's set is a prefix of a larger one's.

    ``ranking``: ``"weight"`` ranks a token by its largest estimated attention weight over the heads (per head, a
    softmax of ``scale * scores`` over the valid positions), ``"mass"`` by their sum, ``"rank"`` by its best position
    in any head's own order (every head's first choice, then every head's second, ... ; heads in order within a rank).
    ``scale``: the attention logit scale (``1 / sqrt(D)``), what makes scores weights.
    """
    scores = jnp.asarray(scores)
    if scores.ndim < 3:
        raise ValueError(f"shared_positions: scores must be [*B, Hkv, G, n], got shape {list(scores.shape)}")
    if ranking not in RANKINGS:
        raise ValueError(f"shared_positions: ranking must be one of {RANKINGS}, got {ranking!r}")
    n = scores.shape[-1]
    if not isinstance(budget, (int, np.integer)) or not sink + local < budget <= n:
        raise ValueError(f"shared_positions: budget must be an int in ({sink + local}, {n}] (past the sink and local "
                         f"tokens, at most the {n} scored positions), got {budget!r}")
    batch = scores.shape[:-3]
    heads = scores.reshape(*batch, -1, n).astype(jnp.float32)  # every query head of every KV head
    length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), batch)[..., None]
    pos = jnp.arange(n, dtype=jnp.int32)
    valid = pos < length
    forced = valid & ((pos < sink) | (pos >= length - local))
    heads = jnp.where(jnp.isnan(heads), -jnp.finfo(jnp.float32).max, heads)  # NaN ranks lowest, as in select_topk
    if ranking == "rank":
        priority = _best_rank(jnp.where((valid & ~forced)[..., None, :], heads, -jnp.inf), budget)
    else:
        logits = jnp.where(valid[..., None, :], heads * scale, -jnp.inf)
        weights = jnp.exp(logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True))
        priority = jnp.max(weights, axis=-2) if ranking == "weight" else jnp.sum(weights, axis=-2)
    priority = jnp.where(forced, jnp.inf, jnp.where(valid, priority, -jnp.inf))
    top, idx = jax.lax.top_k(priority, budget)
    return idx.astype(jnp.int32), top > -jnp.inf


def _best_rank(ranked: Float[Array, "*B H n"], depth: int) -> Float[Array, "*B n"]:
    """Minus each position's best place in the heads' interleaved orders (head h's i-th choice is place ``i * H +
    h``), over each head's first ``depth`` choices; -inf where no head chose it (or it cannot be chosen)."""
    *batch, h, n = ranked.shape
    top, idx = jax.lax.top_k(ranked, depth)  # [*B, H, depth], each head's order
    place = jnp.arange(depth, dtype=jnp.int32)[None, :] * h + jnp.arange(h, dtype=jnp.int32)[:, None]
    big = jnp.iinfo(jnp.int32).max
    place = jnp.where(top > -jnp.inf, place, big)
    flat_idx, flat_place = idx.reshape(-1, h * depth), jnp.broadcast_to(place, idx.shape).reshape(-1, h * depth)
    best = jax.vmap(lambda i, p: jnp.full(n, big, jnp.int32).at[i].min(p))(flat_idx, flat_place).reshape(*batch, n)
    return jnp.where(best < big, -best.astype(jnp.float32), -jnp.inf)


def shared_attention(
    q: Float[Array, "*B Hkv G D"],
    keys: Float[Array, "*B Hkv n D"],
    values: Float[Array, "*B Hkv n D"],
    positions: Int[Array, "*B S"],
    mask: Bool[Array, "*B S"],
    *,
    scale: float | None = None,
) -> Float[Array, "*B Hkv G D"]:
    """Every head of a sharing layer over the shared positions: each KV head's own K/V rows there (fetched once per
    KV head, shared by its G query heads), exact softmax attention (f32) over the slots ``mask`` admits."""
    *batch, hkv, g, _ = q.shape
    at = jnp.broadcast_to(positions[..., None, :, None], (*batch, hkv, positions.shape[-1], 1))
    rows_k = jnp.take_along_axis(keys, at, axis=-2)[..., None, :, :]  # [*B, Hkv, 1, S, D]
    rows_v = jnp.take_along_axis(values, at, axis=-2)[..., None, :, :]
    heads_mask = jnp.broadcast_to(mask[..., None, None, :], (*batch, hkv, g, mask.shape[-1]))
    return attend_rows(q, rows_k, rows_v, heads_mask, scale=scale)


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
    (:func:`shared_attention`) and its ``scores`` are not read (pass None: it scans nothing). ``scale``: the
    attention logit scale (default ``1 / sqrt(D)``), also the rankings' temperature.
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
            outputs.append(shared_attention(q[layer], keys[layer], values[layer], *shared, scale=scale))
            continue
        if scores[layer] is None:
            raise ValueError(f"stack_attention: selection layer {plan.layers[layer]} needs its scores")
        idx, mask = select_topk(scores[layer], length[..., None], k, implementation="xla")
        outputs.append(sparse_attention(q[layer], keys[layer], values[layer], idx, mask, scale=scale))
        if not plan.every_layer_selects:
            shared = shared_positions(scores[layer], length, sharing.budget, scale=scale, ranking=sharing.ranking)
    return outputs
