"""The fidelity of selection shared across layers (issue 57), under the error study's protocol.

The capture, calibration, decode positions, dense references and metric are the study's (:mod:`~fathom_jax.eval.
fidelity`): at each of the window's last positions, every scanning layer and head, ``||o - o_dense|| / ||o_dense||``
with each layer's own captured queries. A selection layer's error is per-layer Fathom's (it attends its own top-k);
a sharing layer's is that of attending a selection layer's shared set (:mod:`~fathom_jax.eval.shared_selection`: all
of it, or with ``attending="topk"`` each head its exact top k).
Since a layer's error depends only on which layer's set it attends, one matrix answers every rule: ``pair[s, l]``,
layer l attending layer s's set (s < l), for every ranking and budget (one ranking per selection layer and position
serves every budget: a smaller budget's set is a prefix). A rule's per-layer errors are read off it
(:func:`rule_errors`), and :func:`choose_layers` picks the best ``m`` selection layers from a capture's matrix.

Against the rule, per-layer Fathom through :func:`~fathom_jax.eval.fidelity.attention_errors_many` (the study's own
numbers): at the same k, at k's with the same rows fetched per KV head, at budgets reading the same bits per step.
:mod:`~fathom_jax.eval.share_report` turns the results into tables and a figure; ``scripts/share_fidelity.py`` runs it
on a model. Decoding (step agreement, RULER) needs the decode step's option and is not measured here.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from fathom_jax.eval import fidelity as fid
from fathom_jax.eval import prefix_scan
from fathom_jax.eval.ranking import select_topk
from fathom_jax.eval.scoring import MethodScore
from fathom_jax.eval.shared_selection import shared_attention, shared_positions
from fathom_jax.index import build_index, unpack_index
from fathom_jax.methods import Fathom, ScanMethod, parse
from fathom_jax.methods.sharing import ATTENDING, RANKINGS, Attending, SharedSelection
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS


@dataclasses.dataclass(frozen=True)
class ShareConfig:
    """What one study of shared selection runs. ``rules``: ``share=`` values (:class:`SharedSelection`), resolved
    against the capture's scanning layers; ``chosen_counts``: how many selection layers :func:`choose_layers` picks
    on the calibration capture, each evaluated on the evaluation capture."""

    method: str = "fathom:48"
    k: int = 128
    budgets: tuple[int, ...] = (256, 512, 1024)
    rankings: tuple[str, ...] = RANKINGS
    rules: tuple[str, ...] = ("first,mid", "0,2,mid", "every8", "every4", "every2")
    chosen_counts: tuple[int, ...] = (2, 3, 4, 6, 8)
    positions: int = 128
    calib_positions: int = 64
    row_ks: tuple[int, ...] = (64, 96, 128, 192, 256, 384, 512, 768, 1024)  # per-layer k's measured for equal rows
    bits_fractions: tuple[float, ...] = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4)  # of the budget
    reference: str | None = "exact"  # the oracle's scores shared: what sharing costs with no scan error
    attending: Attending = "all"  # what a sharing layer's heads attend of the set (SharedSelection.attending)

    def __post_init__(self):
        method = parse(self.method)
        if not isinstance(method, Fathom) and self.bits_fractions:
            raise ValueError(f"ShareConfig: bits_fractions scales a Fathom budget; {self.method!r} has none")
        for budget in self.budgets:
            SharedSelection(("first",), budget).validate(self.k)
        if any(r not in RANKINGS for r in self.rankings) or not self.rankings:
            raise ValueError(f"ShareConfig: rankings must be among {RANKINGS}, got {self.rankings}")
        if self.attending not in ATTENDING:
            raise ValueError(f"ShareConfig: attending must be one of {ATTENDING}, got {self.attending!r}")
        if self.k not in self.row_ks:
            raise ValueError(f"ShareConfig: row_ks {self.row_ks} must hold k = {self.k}")

    def bits_budgets(self) -> tuple[int, ...]:
        budget = parse(self.method).budget
        return tuple(sorted({max(1, round(f * budget)) for f in self.bits_fractions} - {budget}))


@dataclasses.dataclass
class Selections:
    """What a capture's layers choose for one method, and the errors of every sharing pair: ``pair [R, B, L, L, P]``
    (ranking, budget, selection layer s, sharing layer l > s, position; mean over heads; NaN where l <= s)."""

    pair: np.ndarray
    topk: np.ndarray  # [L, P, Hkv, G, k] each head's own selection (rank order)
    union_rows: np.ndarray  # [len(row_ks), L, P, Hkv] rows one step fetches per KV head at each k, per layer
    shared: np.ndarray  # [R, L, P, Bmax] each layer's shared set in rank order (-1 past a mask)


@functools.partial(jax.jit, static_argnames=("score",))
def _scores(method_data, q, keys, calib, positions, score: MethodScore):
    """One layer's scores ``[P, Hkv, G, n]`` at every position, as the study's program computes them (the window's
    index built once and cut per position; the budget a traced datum)."""
    full = unpack_index(build_index(keys, calib, score.method.parts))
    method = score.with_data(method_data).method
    scores, _ = prefix_scan.prefix_scores(method, q, full, keys, positions + 1, calib,
                                          windows=prefix_scan.plane_windows(full))
    return scores


def layer_scores(method: ScanMethod, q: Float[Array, "P Hkv G D"], keys: Float[Array, "Hkv n D"], calib,
                 positions: Int[Array, "P"]) -> Float[Array, "P Hkv G n"]:
    """``method``'s scores at ``positions`` of one layer: the numbers :func:`~fathom_jax.eval.fidelity.
    attention_errors_many` selects from, bit for bit."""
    score = MethodScore(method)
    _, data = score.program()
    return _scores(data, q, keys, calib if method.needs_calibration else None, positions, score)


@functools.partial(jax.jit, static_argnames=("budgets", "k"))
def _pair_errors(q, keys, values, refs, shared, mask, positions, budgets, k):
    """``[P, B]``: layer errors (mean over heads) when it attends ``shared [P, Bmax]``'s first ``b`` positions (each
    head its exact top ``k`` of them where ``k`` is not None)."""

    def one(args):
        q_p, idx, m, ref, p = args
        ref_norm = jnp.maximum(jnp.linalg.norm(ref, axis=-1), 1e-30)
        topk = None if k is None else (k, p + 1)
        return jnp.stack([jnp.mean(jnp.linalg.norm(
            shared_attention(q_p, keys, values, idx[:b], m[:b], topk=topk) - ref, axis=-1) / ref_norm)
            for b in budgets])

    return jax.lax.map(one, (q, shared, mask, refs, positions))


_select = jax.jit(select_topk, static_argnums=2)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _shared_sets(scores, positions, budget, scale, ranking):
    """Each position's shared set ``[P, budget]`` (rank order) and its mask."""
    return jax.vmap(lambda sc, p: shared_positions(sc, p + 1, budget, scale=scale, ranking=ranking))(scores, positions)


def measure(method: ScanMethod, capture: fid.Capture, calib, positions: np.ndarray, refs: fid.References,
            config: ShareConfig, *, rankings: tuple[str, ...] | None = None, row_ks: tuple[int, ...] = (),
            log=print) -> Selections:
    """Every layer's selections under ``method`` and the errors of every (selection layer, later layer) pair."""
    rankings = rankings or config.rankings
    budgets = tuple(config.budgets)
    n_layers, _, n_tokens, d = capture.q.shape
    bmax = min(max(budgets), n_tokens)
    pos = jnp.asarray(positions)
    lengths = jnp.broadcast_to((pos + 1)[:, None], (len(positions), capture.k.shape[1]))
    k_top = max((config.k, *row_ks))
    queries = [capture.layer_queries(layer, positions) for layer in range(n_layers)]
    pair = np.full((len(rankings), len(budgets), n_layers, n_layers, len(positions)), np.nan, np.float32)
    topk = union = None
    shared = np.full((len(rankings), n_layers, len(positions), bmax), -1, np.int32)
    for s in range(n_layers):
        t0 = time.time()
        layer_calib = jax.tree.map(lambda x: x[s], calib) if calib is not None else None
        scores = layer_scores(method, queries[s], capture.k[s], layer_calib, pos)[..., :n_tokens]
        idx, mask = map(np.asarray, _select(scores, lengths, k_top))
        if topk is None:
            topk = np.zeros((n_layers, *idx.shape[:-1], config.k), np.int32)
            union = np.zeros((len(row_ks), n_layers, *idx.shape[:-2]), np.int32)
        topk[s] = np.where(mask[..., : config.k], idx[..., : config.k], -1)
        for i, k in enumerate(row_ks):
            union[i, s] = _distinct(np.where(mask[..., :k], idx[..., :k], -1))
        for r, ranking in enumerate(rankings):
            order, ok = _shared_sets(scores, pos, bmax, float(1 / np.sqrt(d)), ranking)
            shared[r, s] = np.where(ok, order, -1)
            for layer in range(s + 1, n_layers):
                errs = _pair_errors(queries[layer], capture.k[layer], capture.v[layer], refs.outputs[layer], order,
                                    ok, pos, budgets, config.k if config.attending == "topk" else None)
                pair[r, :, s, layer] = np.asarray(errs).T
        log(f"[share] {method.label}: layer {s} selected and shared with {n_layers - 1 - s} later layers "
            f"({time.time() - t0:.1f} s)")
    return Selections(pair, topk, union, shared)


def _distinct(idx: np.ndarray) -> np.ndarray:
    """Distinct positions (>= 0) over the last two axes (a KV group's heads and their slots)."""
    flat = np.sort(idx.reshape(*idx.shape[:-2], -1), axis=-1)
    fresh = np.concatenate([flat[..., :1] >= 0, (flat[..., 1:] != flat[..., :-1]) & (flat[..., 1:] >= 0)], axis=-1)
    return fresh.sum(axis=-1)


def rule_errors(selects: tuple[bool, ...], own: np.ndarray, pair: np.ndarray) -> np.ndarray:
    """``[L, P]`` errors of a rule: a selection layer's ``own [L, P]`` (per-layer selection), a sharing layer's
    ``pair [L, L, P]`` from the last selection layer before it."""
    out, source = np.empty_like(own), 0
    for layer, sel in enumerate(selects):
        source = layer if sel else source
        out[layer] = own[layer] if sel else pair[source, layer]
    return out


def choose_layers(own: np.ndarray, pair: np.ndarray, count: int) -> tuple[int, ...]:
    """The ``count`` selection layers (scanning-layer indices, the first among them) with the least total error,
    from per-layer errors ``own [L]`` and pair errors ``pair [L, L]`` (a dynamic program over where each layer's
    run of sharing layers starts)."""
    n = own.shape[0]
    if not 1 <= count <= n:
        raise ValueError(f"count must lie in [1, {n}], got {count}")
    run = np.full((n, n + 1), np.inf)  # run[s, e]: layer s selects, s + 1 .. e - 1 share its set
    for s in range(n):
        run[s, s + 1] = own[s]
        for e in range(s + 2, n + 1):
            run[s, e] = run[s, e - 1] + pair[s, e - 1]
    best = np.full((count + 1, n + 1), np.inf)  # best[c, e]: layers 0 .. e - 1 covered by c runs
    start = np.zeros((count + 1, n + 1), np.int64)
    best[0, 0] = 0.0
    for c in range(1, count + 1):
        for e in range(1, n + 1):
            totals = best[c - 1, :e] + run[:e, e]
            start[c, e] = int(np.argmin(totals))
            best[c, e] = totals[start[c, e]]
    chosen, e = [], n
    for c in range(count, 0, -1):
        chosen.append(int(start[c, e]))
        e = chosen[-1]
    return tuple(sorted(chosen))


def overlaps(sel: Selections, exact_topk: np.ndarray | None, positions: np.ndarray, budget: int
             ) -> dict[str, list]:
    """Per layer l >= 1, how much of what it selects layer l - 1 already chose (middle tokens: past the sink, before
    the local window): ``same_head`` a head's own top-k inside the same-numbered head's top-k of layer l - 1;
    ``union`` the layer's union of every head's top-k inside layer l - 1's union; ``in_shared[r]`` each head's exact
    top-k (``exact_topk``, the tokens it needs) inside layer l - 1's shared set of ``budget`` positions under the
    r-th ranking."""
    n_layers, n_pos = sel.topk.shape[:2]
    out = {"same_head": [], "union": [], "in_shared": [[] for _ in range(sel.shared.shape[0])]}
    middle = [_middle(sel.topk[layer], positions) for layer in range(n_layers)]
    for layer in range(1, n_layers):
        prev, cur = sel.topk[layer - 1], sel.topk[layer]
        hits = (cur[..., :, None] == prev[..., None, :]).any(-1) & middle[layer]
        out["same_head"].append(float(hits.sum() / max(middle[layer].sum(), 1)))
        a = [set(cur[p][middle[layer][p]].tolist()) for p in range(n_pos)]
        b = [set(prev[p][middle[layer - 1][p]].tolist()) for p in range(n_pos)]
        out["union"].append(float(sum(len(x & y) for x, y in zip(a, b)) / max(sum(len(x) for x in a), 1)))
        if exact_topk is None:
            continue
        need = exact_topk[layer]
        need_mid = _middle(need, positions)
        for r, in_shared in enumerate(out["in_shared"]):
            shared = sel.shared[r, layer - 1, :, :budget]
            member = np.zeros((n_pos, int(positions.max()) + 1), bool)
            np.put_along_axis(member, np.maximum(shared, 0), shared >= 0, axis=1)
            got = np.take_along_axis(member, np.maximum(need, 0).reshape(n_pos, -1), axis=1).reshape(need.shape)
            in_shared.append(float((got & need_mid).sum() / max(need_mid.sum(), 1)))
    return out


def _middle(top: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Which of ``top [P, ...]``'s selected positions lie past the sink and before the local window."""
    last = (positions + 1 - LOCAL_TOKENS).reshape(-1, *[1] * (top.ndim - 1))
    return (top >= SINK_TOKENS) & (top < last)
