"""Selection shared across layers in a decode step (:mod:`fathom_jax.methods.sharing`): what a selection layer
publishes and how a sharing layer attends it.

    shared = publish(q, view, ctx, sharing, kv_heads, scores)     # at a selection layer, from its own step's scores
    result = attend_shared(q, view, ctx, shared, sharing, kv_heads)  # at a sharing layer: no plan, scan or selection

The published set is :func:`shared_positions` of the selection layer's scores over every query head of every KV head
of a sequence: the set the fidelity study measures (:mod:`fathom_jax.eval.shared_selection`). A sharing layer fetches each KV
head's own rows at those positions (its newest row patched in, as every step does) and every head attends all of
them, or (``attend=topk``) each head its own top k of them by exact score, ranked from the fetched keys. A selection layer publishes from the scores its own step wrote (one read of its planes); the layers that
share read none.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from fathom_jax.methods.sharing import RANKINGS, Ranking, SharedSelection
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS, attend


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


@dataclasses.dataclass(frozen=True)
class LayerSharing:
    """A bound hook's sharing (static): the option, whether each of the cache's layers selects, and the KV heads of
    a sequence (its groups share one set)."""

    selection: SharedSelection
    selects: tuple[bool, ...]
    kv_heads: int

    @classmethod
    def bind(cls, selection: SharedSelection, shape) -> "LayerSharing | None":
        """The sharing of caches of ``shape`` (a :class:`~fathom_jax.models.attention.CacheShape`: its layers are
        model layers ``shape.layer_ids`` of ``shape.model_layers``); None where every layer selects (today's step)."""
        plan = selection.plan_layers(shape.model_layers or shape.layers, shape.layer_ids or None)
        if len(plan.selects) != shape.layers:
            raise ValueError(f"share: the plan covers {len(plan.selects)} layers, the cache {shape.layers}")
        return None if plan.every_layer_selects else cls(selection, plan.selects, shape.kv_heads)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedSet:
    """The positions a selection layer hands to the layers after it, per sequence: ``positions [B, S]`` in
    increasing order, -1 in the slots ``mask`` leaves empty (a context shorter than the budget)."""

    positions: Int[Array, "B S"]
    mask: Bool[Array, "B S"]

    @classmethod
    def empty(cls, batch: int, budget: int) -> SharedSet:
        """Nothing published yet (the carry before the first layer, which always selects)."""
        return cls(jnp.full((batch, budget), -1, jnp.int32), jnp.zeros((batch, budget), bool))


def publish(q: Float[Array, "R G D"], view, ctx, sharing: SharedSelection, kv_heads: int,
            scores: Float[Array, "R G n"]) -> SharedSet:
    """The set a selection layer publishes from the ``scores`` its own step's selection wrote for the queries ``q``
    (every stored position's, the newest block patched in), ranked over all query heads of each sequence's
    ``kv_heads`` groups and cut to ``sharing.budget``."""
    r, g, n = scores.shape
    batch = r // kv_heads
    length = view.length.reshape(batch, kv_heads)[:, 0]
    positions, mask = shared_positions(scores.reshape(batch, kv_heads, g, n), length, sharing.budget,
                                       scale=1.0 / np.sqrt(q.shape[-1]), ranking=sharing.ranking,
                                       sink=ctx.sink, local=ctx.local)
    # in position order, as a selection's union: the row fetch walks them in order
    order = jnp.where(mask, positions, jnp.iinfo(jnp.int32).max)
    order = jnp.sort(order, axis=-1)
    mask = order < jnp.iinfo(jnp.int32).max
    return SharedSet(jnp.where(mask, order, -1), mask)


def attend_shared(q: Float[Array, "R G D"], view, ctx, shared: SharedSet, sharing: SharedSelection, kv_heads: int
                  ) -> tuple[Float[Array, "R G Dh"], object]:
    """Every head of every group attends its sequence's shared positions (each KV head its own rows there), or with
    ``sharing.attending == "topk"`` its own top ``ctx.k`` of them: ``(out, row-cache fill)``."""
    q = q.astype(jnp.float32)
    slots = jnp.repeat(shared.positions, kv_heads, axis=0)  # [R, S]: groups are batch-major
    member = jnp.broadcast_to(jnp.repeat(shared.mask, kv_heads, axis=0)[:, None, :],
                              (q.shape[0], q.shape[1], slots.shape[-1]))
    if sharing.attending == "all":
        return ctx.run.fetcher.attend(q, slots, member, view)
    rows, fill = ctx.run.fetcher.fetch(slots, view)  # fetched once: ranked, then attended
    keys, values = view.rows.split(rows)
    member = head_topk(q, keys, slots, member, view.length, ctx.k, sink=ctx.sink, local=ctx.local)
    return attend(q, keys, values, member), fill


def head_topk(q: Float[Array, "R G D"], keys: Float[Array, "R S D"], slots: Int[Array, "R S"],
              member: Bool[Array, "R G S"], length: Int[Array, "R"], k: int, *, sink: int, local: int
              ) -> Bool[Array, "R G S"]:
    """Each head's own ``k`` slots of ``member`` by exact score ``q . key``: the sink and local window first (as a
    selection's), then the highest scores, ties to the lower slot."""
    scores = jnp.einsum("rgd,rsd->rgs", q, keys.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    forced = (slots < sink) | (slots >= (length - local)[:, None])
    ranked = jnp.where(forced[:, None, :], jnp.inf, jnp.where(jnp.isnan(scores), -jnp.finfo(jnp.float32).max, scores))
    ranked = jnp.where(member, ranked, -jnp.inf)
    _, top = jax.lax.top_k(ranked, min(k, slots.shape[-1]))
    chosen = jnp.zeros(member.shape, bool).at[
        jnp.arange(member.shape[0])[:, None, None], jnp.arange(member.shape[1])[None, :, None], top].set(True)
    return chosen & member
