"""Token selection and exact attention over the selected set.

Per query head the selected set is 4 sink tokens + the 32 most recent tokens + the top-(k - 36) of the
rest by the scan's approximate score (the paper's protocol for every method). The G heads of a KV
group fetch the union of their winners once; each head still attends over its own k tokens.
Shapes are static: ``k`` and the union size ``G * k`` are fixed, slots past the context are masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from fathom_jax.checks import CheckError, fail_if
from pallas_kernels import backend
from pallas_kernels.topk import LOCAL_TOKENS, SINK_TOKENS, TopkConfig, topk_select  # the window is defined there


def check_k(k: int, n: int, sink: int, local: int) -> None:
    if not isinstance(k, (int, np.integer)) or k <= 0:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if k > n:
        raise ValueError(f"k={k} is larger than the context capacity n={n}")
    if sink < 0 or local < 0 or sink + local > k:
        raise ValueError(f"sink + local = {sink} + {local} must not exceed k={k}")


def select_topk(
    scores: Float[Array, "*B G n"],
    length: Int[Array, "*B"] | int,
    k: int,
    *,
    sink: int = SINK_TOKENS,
    local: int = LOCAL_TOKENS,
    implementation: backend.Implementation | None = None,
    config: TopkConfig | None = None,
) -> tuple[Int[Array, "*B G k"], Bool[Array, "*B G k"]]:
    """Indices of the ``k`` selected tokens per query head and a mask of the slots that hold one.

    Positions ``< sink`` and ``>= length - local`` are always taken; the remaining slots go to the
    highest scores among the other valid positions. With ``length < k`` every valid token is taken
    and the spare slots are masked. NaN scores rank below every real score (XLA path).
    ``implementation="triton"`` uses the top-k kernels (``pallas_kernels.topk``: the same set, ties
    aside, in increasing position order; ``config`` tunes them); ``"xla"`` uses ``lax.top_k``; None: triton on a GPU.

    ``length`` (integers, broadcasting to ``[*B]``) must lie in [0, n]: a CheckError when concrete. A traced
    length (the decode step's) is checked in checkify mode only (:func:`fathom_jax.checks.checked`); by
    default it is clamped to [0, n], so a length past ``n`` selects as if it were ``n``.
    """
    implementation = backend.resolve_implementation(implementation)
    scores = jnp.asarray(scores)
    if scores.ndim < 2:
        raise CheckError(f"select_topk: scores must be [*B, G, n], got shape {list(scores.shape)}")
    if not jnp.issubdtype(scores.dtype, jnp.floating):
        raise TypeError(f"select_topk: scores must be floating point [*B, G, n], got dtype {scores.dtype}")
    n = scores.shape[-1]
    check_k(k, n, sink, local)
    length = _checked_length(length, scores.shape[:-2], n)
    if implementation == "triton":
        rows = scores.reshape(-1, n).astype(jnp.float32)
        lengths = jnp.broadcast_to(length[..., None], scores.shape[:-1]).reshape(-1)
        idx = topk_select(rows, lengths, k=k, sink=sink, local=local, implementation="triton", config=config)
        idx = idx.reshape(*scores.shape[:-1], k)
        return jnp.maximum(idx, 0), idx >= 0
    top, idx = jax.lax.top_k(selection_priority(scores, length, sink=sink, local=local), k)
    return idx.astype(jnp.int32), top > -jnp.inf


def _checked_length(length, batch: tuple[int, ...], n: int) -> Int[Array, "*B"]:
    """``length`` checked (integer dtype, shape ``[*B]`` or broadcasting to it, values in [0, n]) and clamped."""
    dtype = length.dtype if hasattr(length, "dtype") else np.asarray(length).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"select_topk: length must be integer token counts [*B], got dtype {dtype}")
    try:
        ok = np.broadcast_shapes(np.shape(length), batch) == batch
    except ValueError:
        ok = False
    if not ok:
        raise CheckError(f"select_topk: length must be a scalar or broadcast to the batch [*B] = {list(batch)} of "
                         f"scores [*B, G, n], got shape {list(np.shape(length))}")
    length = jnp.asarray(length, jnp.int32)
    fail_if((length < 0) | (length > n), lambda got: f"select_topk: length must lie in [0, {n}] (the scored "
            f"positions), got values in [{got.min()}, {got.max()}]", length, hot=True)
    return jnp.clip(length, 0, n)


def selection_priority(
    scores: Float[Array, "*B G n"], length: Int[Array, "*B"], *, sink: int = SINK_TOKENS, local: int = LOCAL_TOKENS
) -> Float[Array, "*B G n"]:
    """What the ``"xla"`` selection ranks: ``+inf`` for the forced positions (sink and local), ``-inf`` past
    ``length``, the score elsewhere (NaN as the lowest real score, so the result holds no NaN)."""
    length = jnp.asarray(length, jnp.int32)[..., None, None]  # broadcast over heads and positions
    pos = jnp.arange(scores.shape[-1], dtype=jnp.int32)
    valid = pos < length
    forced = valid & ((pos < sink) | (pos >= length - local))
    ranked = jnp.where(jnp.isnan(scores), -jnp.finfo(jnp.float32).max, scores.astype(jnp.float32))
    return jnp.where(forced, jnp.inf, jnp.where(valid, ranked, -jnp.inf))


def group_union(
    indices: Int[Array, "*B G k"], mask: Bool[Array, "*B G k"]
) -> tuple[Int[Array, "*B U"], Bool[Array, "*B U"], Bool[Array, "*B G U"]]:
    """The union of a group's selected tokens (U = G * k slots, duplicates masked out).

    Returns the union's indices, its mask, and per head which union slots belong to that head's set,
    so one fetch of the union rows serves every head of the group. A head's masked-in indices must be
    distinct (as :func:`select_topk` returns them): a token is then held by at most G sorted entries in a
    row, and its heads are read off that window (G shifted comparisons) instead of comparing every union
    slot with every selected index (U x k per head).

    The union is taken by one sort even though the Pallas top-k lists each head's tokens in order: a sort-free union
    of the sorted lists, faster alone, measured slower inside the pipelined decode step and was deleted
    (``results/union_h200.md``).
    """
    *batch, g, k = indices.shape
    big = jnp.iinfo(jnp.int32).max
    flat = jnp.where(mask, indices, big).reshape(*batch, g * k)
    head = jnp.broadcast_to(jnp.arange(g, dtype=jnp.int32)[:, None], (*batch, g, k)).reshape(*batch, g * k)
    flat, head = jax.lax.sort((flat, head), num_keys=1)
    first = jnp.concatenate([jnp.ones((*batch, 1), bool), flat[..., 1:] != flat[..., :-1]], axis=-1)
    union_mask = first & (flat != big)
    union = jnp.where(union_mask, flat, 0)
    # The entries sharing slot u's token sit at u, u + 1, ..., u + G - 1 (padded past the end with no head).
    u = g * k
    flat_p = jnp.concatenate([flat, jnp.full((*batch, g - 1), big, flat.dtype)], axis=-1)
    head_p = jnp.concatenate([head, jnp.full((*batch, g - 1), -1, head.dtype)], axis=-1)
    heads = jnp.arange(g, dtype=jnp.int32)[:, None]
    member = functools.reduce(jnp.logical_or, [
        (flat_p[..., None, s:s + u] == flat[..., None, :]) & (head_p[..., None, s:s + u] == heads) for s in range(g)])
    return union, union_mask, member & union_mask[..., None, :]


def attend(
    q: Float[Array, "*B G D"],
    keys: Float[Array, "*B m D"],
    values: Float[Array, "*B m D"],
    mask: Bool[Array, "*B G m"],
    *,
    scale: float | None = None,
) -> Float[Array, "*B G D"]:
    """Exact softmax attention of each head over the rows its mask admits (f32 accumulation)."""
    _check_attention_shapes("attend", q, keys, values)
    return attend_rows(q, keys[..., None, :, :], values[..., None, :, :], mask, scale=scale)


def _check_attention_shapes(name: str, q, keys, values, rows=None) -> None:
    """Static shape checks (they hold under jit): a value row per key row, q and keys of one head_dim,
    indices and mask per query head. Without them a short ``values`` is clamped by the gather and attention
    comes out NaN or silently wrong."""
    q, keys, values = (jnp.shape(x) for x in (q, keys, values))
    if len(q) < 2 or len(keys) < 2 or len(values) < 2:
        raise ValueError(f"{name}: q must be [..., G, D], keys and values [..., n, D]; got shapes {q}, {keys}, {values}")
    if keys[:-1] != values[:-1]:
        raise ValueError(f"{name}: values must have one row per key row: keys {keys} vs values {values}")
    if q[-1] != keys[-1]:
        raise ValueError(f"{name}: q and keys must share head_dim: q {q} vs keys {keys}")
    if rows is not None:
        (indices, mask), want = rows, (*q[:-1],)
        if jnp.shape(indices)[:-1] != want or jnp.shape(mask) != jnp.shape(indices):
            raise ValueError(f"{name}: indices and mask must be [..., G, k] with [..., G] = {want}; got "
                             f"{jnp.shape(indices)} and {jnp.shape(mask)}")


def attend_rows(
    q: Float[Array, "*B G D"],
    keys: Float[Array, "*B G m D"],
    values: Float[Array, "*B G m D"],
    mask: Bool[Array, "*B G m"],
    *,
    scale: float | None = None,
) -> Float[Array, "*B G D"]:
    """Per-head softmax attention, f32: q [*B, G, D] over its own key and value rows [*B, G, m, D] (or rows
    [*B, 1, m, D] shared by the G heads) where ``mask``."""
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    # full f32 products: on GPU the default precision would round the operands to TF32
    logits = jnp.einsum("...gd,...gmd->...gm", q.astype(jnp.float32), keys.astype(jnp.float32),
                        precision="highest") * scale
    weights = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1, where=mask)
    weights = jnp.where(mask, weights, 0.0)
    return jnp.einsum("...gm,...gmd->...gd", weights, values.astype(jnp.float32), precision="highest")


def sparse_attention(
    q: Float[Array, "*B G D"],
    keys: Float[Array, "*B n D"],
    values: Float[Array, "*B n D"],
    indices: Int[Array, "*B G k"],
    mask: Bool[Array, "*B G k"],
    *,
    scale: float | None = None,
) -> Float[Array, "*B G D"]:
    """Attention of each head over its own selected rows only (gathered from the full K/V).

    Where ``mask`` is set, ``indices`` must lie in [0, n): a CheckError when concrete. Traced indices (the
    decode step's) are checked in checkify mode only (:func:`fathom_jax.checks.checked`); by default a
    selected index outside [0, n) reads a NaN row, so that head's output is NaN (not a row read from the
    other end, as NumPy's negative indices would); unselected slots are never read.
    """
    _check_attention_shapes("sparse_attention", q, keys, values, (indices, mask))
    for name, x, kind in (("indices", indices, jnp.integer), ("mask", mask, jnp.bool_)):
        if not jnp.issubdtype(jnp.result_type(x), kind):
            raise TypeError(f"sparse_attention: {name} must be {'integer' if kind is jnp.integer else 'bool'} "
                            f"[..., G, k], got dtype {jnp.result_type(x)}")
    n = keys.shape[-2]
    outside = ((indices < 0) | (indices >= n)) & mask
    fail_if(outside, lambda idx, out: f"sparse_attention: indices must lie in [0, {n}) (rows of keys and values) "
            f"where mask is set, got {int(out.sum())} outside, in [{idx[out].min()}, {idx[out].max()}]",
            indices, outside, hot=True)
    # Row n is out of bounds: the gather fills it with NaN. Unselected slots read row 0 (weight 0).
    rows_k, rows_v = gather_rows(keys, values, jnp.where(mask, jnp.where(outside, n, indices), 0))
    return attend_rows(q, rows_k, rows_v, mask, scale=scale)


def gather_rows(
    keys: Float[Array, "*B n D"], values: Float[Array, "*B n D"], indices: Int[Array, "*B G k"]
) -> tuple[Float[Array, "*B G k D"], Float[Array, "*B G k D"]]:
    """Each head's selected key and value rows, in the order of ``indices``."""
    # Gather the G heads' rows from the one [*B, n, D] array (broadcasting it over G first would copy it).
    *batch, g, k = indices.shape
    flat = indices.reshape(*batch, g * k, 1)
    rows_k = jnp.take_along_axis(keys, flat, axis=-2).reshape(*batch, g, k, keys.shape[-1])
    rows_v = jnp.take_along_axis(values, flat, axis=-2).reshape(*batch, g, k, values.shape[-1])
    return rows_k, rows_v


def dense_attention(
    q: Float[Array, "*B G D"],
    keys: Float[Array, "*B n D"],
    values: Float[Array, "*B n D"],
    length: Int[Array, "*B"] | int,
    *,
    scale: float | None = None,
) -> Float[Array, "*B G D"]:
    """Attention over every valid position ``< length``."""
    _check_attention_shapes("dense_attention", q, keys, values)
    n = keys.shape[-2]
    length = jnp.asarray(length, jnp.int32)[..., None, None]
    mask = jnp.broadcast_to(jnp.arange(n) < length, (*q.shape[:-1], n))
    return attend(q, keys, values, mask, scale=scale)
