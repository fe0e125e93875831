"""Threshold rules for the thresholded scan, compared on real decodes: how often each leaves a head without a proof.

A step keeps, per query head, the stored middle tokens (``[sink, stop)``, ``stop = min(length - local, the newest
block's start)``) whose score key reaches the head's threshold ``T``; the newest block's middle tokens are always
candidates. With ``k' = k - sink - local`` the head fails (the second path runs) on ``overflow`` (more than
``capacity`` stored tokens passed) or ``too few`` (fewer than k' candidates reach ``T`` and not every stored middle
token passed): :func:`scripts.threshold_seeds.simulate`'s test, here :func:`outcome`. The rules set ``T``:

* ``seed`` (A, the library's :class:`~fathom_jax.decode.selection.ThresholdSelection`): the previous step's
  ``rank x k'``-th best candidate (never below the previous ``T`` on success); after a failure the ``rank x
  k'``-th best middle score. :func:`simulate_seeded` with ``gamma=None``.
* ``seed-lower`` (B): as A, but a success with fewer than ``rank x k'`` candidates reaching ``T`` lowers it in score
  space by the observed gap: ``T - gamma x (s_k' - T)`` (``s_k'`` the k'-th best middle score); ``+qnorm``: any
  seed is carried as a score over ``||q_h||`` and multiplied by the next step's ``||q_h||`` (A or B).
* ``sample`` (C): stateless, within the step: the ``m``-th largest score of a strided sample of the stored middle,
  ``m = ceil(c x k' / s)``: every ``s``-th position (``p % s == 0``) or every ``s``-th 32-token word (``(p // 32) %
  s == 0``). ``s`` is the largest in ``[1, 16]`` with ``m >= m_min``; where the middle holds at most ``capacity``
  tokens, no sample: ``T`` is the lowest key (every stored token a candidate, which proves the selection).
  :func:`sample_rule`.
* ``sample+retry`` (D): C, then each failing head scans once more with the ``(f x m)``-th (too few) or the
  ``ceil(m / f)``-th (overflow) sampled score; what still fails.

The share of heads failing is counted per head, per (step, layer, KV group) and per (step, layer) with any head
failing; for the stateful rules also with the failure shared (one ``lax.cond`` per group or per layer: every head
of the unit takes the second path and is reseeded). The first step is excluded (A and B start from the lowest key).

Protocol: :mod:`scripts.threshold_seeds`'s (one capture, the last ``--positions`` positions of the window as
consecutive decode steps, Fathom 48 scores as a decode loop's index holds them there); one capture per model and
context serves every rule.

    python -m scripts.threshold_rules --model smollm2 --context 4096
    python -m scripts.threshold_rules --model gemma3-270m --context 32768

writes ``results/threshold_rules_<model>_<context>.{json,md}``. Runs on CPU.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import methods
from fathom_jax.format import BLOCK_TOKENS
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS
from pallas_kernels.topk_radix import INT_MIN
from scripts import harness
from scripts.threshold_seeds import BUDGET, layer_keys

WORD = 32  # tokens per plane word
MAX_STRIDE = 16
RANK = 8  # the baseline seed rule's rank (slack 2: capacity next_pow2(16 k'))
GAMMAS = (0.5, 1.0, 2.0)
CS = (2, 4)
M_MINS = (16, 32)
RETRY_FACTORS = (2, 4)


def default_capacity(kp: int) -> int:
    return 1 << math.ceil(math.log2(16 * kp))


def key_of(score) -> np.ndarray:
    """float -> the order-preserving int32 key (:func:`~pallas_kernels.topk_radix.sortable_key` in numpy)."""
    b = np.asarray(score, np.float32).view(np.int32)
    return b ^ ((b >> 31) & np.int32(0x7FFFFFFF))


def score_of(key) -> np.ndarray:
    """The inverse of :func:`key_of` (the map is an involution)."""
    k = np.asarray(key, np.int32)
    return (k ^ ((k >> 31) & np.int32(0x7FFFFFFF))).view(np.float32)


def ranges(length: int, sink: int = SINK_TOKENS, local: int = LOCAL_TOKENS):
    """``(stored start, stop, extra start, extra stop)``: the stored middle ``[sink, stop)`` a scan reads and the newest
    block's middle tokens ``[extra start, extra stop)`` (always candidates)."""
    newest = (length - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    stop = max(sink, min(length - local, newest))
    return sink, stop, max(sink, newest), max(max(sink, newest), length - local)


def outcome(keys, lengths, threshold, kp: int, capacity: int, *, sink=SINK_TOKENS, local=LOCAL_TOKENS) -> dict:
    """Each head's test at thresholds ``threshold [P, H]`` (keys) over steps ``keys [P, H, n]`` of ``lengths [P]``:
    ``[P, H]`` arrays ``count`` (stored tokens passing), ``reached`` (candidates reaching ``T``, at most ``capacity``
    stored ones), ``overflow``, ``few`` and ``written`` (``min(count, capacity)``)."""
    n = keys.shape[-1]
    pos = np.arange(n)
    r = np.array([ranges(int(length), sink, local) for length in lengths]).reshape(-1, 4)
    stored = (pos >= r[:, :1]) & (pos < r[:, 1:2])
    extra = (pos >= r[:, 2:3]) & (pos < r[:, 3:4])
    passed = keys >= np.asarray(threshold)[..., None]
    count = np.sum(passed & stored[:, None], axis=-1)
    written = np.minimum(count, capacity)
    reached = written + np.sum(passed & extra[:, None], axis=-1)
    overflow = count > capacity
    few = (reached < kp) & (count != (r[:, 1] - r[:, 0])[:, None])
    return {"count": count, "reached": reached, "overflow": overflow, "few": few, "written": written}


def middle_sorted_kth(keys, lengths, ms, *, sink=SINK_TOKENS, local=LOCAL_TOKENS) -> dict:
    """``{m: [P, H]}``: the ``m``-th largest middle key (``[sink, length - local)``; INT_MIN where fewer)."""
    out = {m: np.full(keys.shape[:2], INT_MIN, np.int32) for m in ms}
    for t, length in enumerate(lengths):
        mid = -np.sort(-keys[t, :, sink:max(sink, int(length) - local)].astype(np.int64), axis=-1)
        for m in ms:
            if 0 < m <= mid.shape[-1]:
                out[m][t] = mid[:, m - 1]
    return out


def _shared(fail, unit):
    """Each head's unit failing (``unit`` consecutive heads share one decision)."""
    p, h = fail.shape
    return np.repeat(fail.reshape(p, h // unit, unit).any(-1), unit, axis=-1)


def simulate_seeded(keys, lengths, k, *, rank=RANK, capacity=None, gamma=None, qnorm=None, unit=1, kth=None,
                    sink=SINK_TOKENS, local=LOCAL_TOKENS) -> dict:
    """A (``gamma=None``) or B over consecutive steps of one layer. ``qnorm [P, H]``: carry the seeds as score /
    ``||q_h||``; ``unit``: consecutive heads sharing the decision (1: each head alone). ``kth``:
    :func:`middle_sorted_kth` at ``rank x k'`` and ``k'``. Returns ``[P, H]`` ``overflow``, ``few``, ``fail`` (the
    head's own), ``second`` (the path its unit took), ``written`` and ``threshold`` (the key used)."""
    kp = k - sink - local
    capacity = default_capacity(kp) if capacity is None else capacity
    hi_m = rank * kp
    if kth is None:
        kth = middle_sorted_kth(keys, lengths, (hi_m, kp), sink=sink, local=local)
    steps, heads = keys.shape[:2]
    out = {name: np.zeros((steps, heads), bool) for name in ("overflow", "few", "fail", "second")}
    out["written"] = np.zeros((steps, heads), np.int64)
    out["threshold"] = np.zeros((steps, heads), np.int32)
    threshold = np.full(heads, INT_MIN, np.int32)
    for t in range(steps):
        o = outcome(keys[t:t + 1], lengths[t:t + 1], threshold[None], kp, capacity, sink=sink, local=local)
        fail = (o["overflow"] | o["few"])[0]
        second = _shared(fail[None], unit)[0]
        out["threshold"][t] = threshold
        out["overflow"][t], out["few"][t] = o["overflow"][0], o["few"][0]
        out["fail"][t], out["second"][t] = fail, second
        out["written"][t] = o["written"][0]
        hi = kth[hi_m][t]
        if gamma is None:
            ok = np.maximum(hi, threshold)
        else:
            reached = o["reached"][0]
            s_t = score_of(threshold).astype(np.float64)
            s_k = score_of(kth[kp][t]).astype(np.float64)
            lower = (threshold != INT_MIN) & (reached >= kp) & (reached < hi_m)
            with np.errstate(invalid="ignore", over="ignore"):
                low = key_of(np.where(lower, s_t - gamma * (s_k - s_t), 0.0))
            ok = np.where(reached >= hi_m, hi, np.where(lower, low, threshold))
        nxt = np.where(second, hi, ok).astype(np.int32)
        if qnorm is not None and t + 1 < steps:
            with np.errstate(invalid="ignore", over="ignore"):
                scaled = key_of(score_of(nxt).astype(np.float64) / qnorm[t] * qnorm[t + 1])
            nxt = np.where(nxt == INT_MIN, INT_MIN, scaled).astype(np.int32)
        threshold = nxt
    return out


def stride_for(kp: int, c: float, m_min: int, max_stride: int = MAX_STRIDE) -> tuple[int, int]:
    """``(s, m)``: the largest stride ``s <= max_stride`` with ``m = ceil(c x k' / s) >= m_min`` (at least 1)."""
    s = max([s for s in range(1, max_stride + 1) if math.ceil(c * kp / s) >= m_min] or [1])
    return s, math.ceil(c * kp / s)


def sample_positions(start: int, stop: int, s: int, word: bool) -> np.ndarray:
    p = np.arange(start, stop)
    return p[(p // WORD) % s == 0] if word else p[p % s == 0]


def sampled_kth(keys, lengths, s, word, ms, *, sink=SINK_TOKENS, local=LOCAL_TOKENS) -> dict:
    """``{m: [P, H]}``: the ``m``-th largest key of each step's sample of the stored middle (INT_MIN where fewer)."""
    out = {m: np.full(keys.shape[:2], INT_MIN, np.int32) for m in ms}
    for t, length in enumerate(lengths):
        start, stop, _, _ = ranges(int(length), sink, local)
        sample = -np.sort(-keys[t][:, sample_positions(start, stop, s, word)].astype(np.int64), axis=-1)
        for m in ms:
            if 0 < m <= sample.shape[-1]:
                out[m][t] = sample[:, m - 1]
    return out


def sample_rule(keys, lengths, k, *, c, s, word, capacity=None, retry=None, full_below=True, kth=None,
                sink=SINK_TOKENS, local=LOCAL_TOKENS) -> dict:
    """C (``retry=None``) or D (``retry=f``) on each step of one layer. ``full_below``: where the middle holds at
    most ``capacity`` tokens, the lowest threshold instead of a sample. ``kth``: :func:`sampled_kth` at ``m`` (and
    ``f x m``, ``ceil(m / f)``). Returns ``[P, H]`` ``overflow`` / ``few`` / ``fail`` after the last scan,
    ``retried`` (the first scan failed), ``written`` (every scan's candidates) and ``threshold`` (the first)."""
    kp = k - sink - local
    capacity = default_capacity(kp) if capacity is None else capacity
    m = math.ceil(c * kp / s)
    ms = (m,) if retry is None else (m, retry * m, math.ceil(m / retry))
    if kth is None:
        kth = sampled_kth(keys, lengths, s, word, ms, sink=sink, local=local)
    full = (np.asarray(lengths) - local - sink <= capacity)[:, None] & full_below
    threshold = np.where(full, INT_MIN, kth[m]).astype(np.int32)
    o = outcome(keys, lengths, threshold, kp, capacity, sink=sink, local=local)
    fail = o["overflow"] | o["few"]
    res = {"overflow": o["overflow"], "few": o["few"], "fail": fail, "retried": fail, "written": o["written"],
           "threshold": threshold}
    if retry is not None:
        again = np.where(o["few"], kth[retry * m], np.where(o["overflow"], kth[ms[2]], threshold)).astype(np.int32)
        o2 = outcome(keys, lengths, again, kp, capacity, sink=sink, local=local)
        res.update(overflow=fail & o2["overflow"], few=fail & o2["few"], fail=fail & (o2["overflow"] | o2["few"]),
                   written=o["written"] + np.where(fail, o2["written"], 0))
    return res


def rules(kp: int, capacity: int, middle: int) -> list[dict]:
    """Every rule compared at one k': ``{"name", "family", ...parameters}``."""
    out = [{"family": "A", "name": f"seed rank {RANK}", "gamma": None, "qnorm": False},
           {"family": "A", "name": f"seed rank {RANK} +qnorm", "gamma": None, "qnorm": True}]
    for qn in (False, True):
        out += [{"family": "B", "name": f"seed-lower g={g}" + (" +qnorm" if qn else ""), "gamma": g, "qnorm": qn}
                for g in GAMMAS]
    samples = []
    for c in CS:
        for m_min in M_MINS:
            s, m = stride_for(kp, c, m_min)
            for word in (False, True):
                if not any(x["c"] == c and x["s"] == s and x["word"] == word for x in samples):
                    samples.append({"c": c, "s": s, "m": m, "m_min": m_min, "word": word})
    for full_below in (True, False) if middle <= capacity else (True,):
        for x in samples:
            tag = (f"sample c={x['c']} s={x['s']}{' words' if x['word'] else ''} m={x['m']}"
                   + ("" if full_below else " (sampled)"))
            out.append({"family": "C", "name": tag, **x, "full_below": full_below, "retry": None})
            out += [{"family": "D", "name": f"{tag} +retry f={f}", **x, "full_below": full_below, "retry": f}
                    for f in RETRY_FACTORS]
    return out


def summarize(res: dict, group: int, *, first: int = 1) -> dict:
    """Shares over steps ``first..``: per head, per (step, KV group) and per (step, layer) with any head failing."""
    fail = res["fail"][first:]
    p, h = fail.shape
    out = {"fail": float(fail.mean()), "overflow": float(res["overflow"][first:].mean()),
           "few": float(res["few"][first:].mean()),
           "group_any": float(fail.reshape(p, h // group, group).any(-1).mean()),
           "layer_any": float(fail.any(-1).mean()), "written": float(res["written"][first:].mean()),
           "fails": int(fail.sum()), "decisions": int(fail.size)}
    if "retried" in res:
        out["retried"] = float(res["retried"][first:].mean())
    return out


def layer_stats(keys, lengths, ks, group, qnorm) -> dict:
    """``{k: [row stats per rule]}`` of one layer."""
    stats = {}
    heads = keys.shape[1]
    for k in ks:
        kp = k - SINK_TOKENS - LOCAL_TOKENS
        capacity = default_capacity(kp)
        middle = int(lengths[-1]) - SINK_TOKENS - LOCAL_TOKENS
        table = rules(kp, capacity, middle)
        kth = middle_sorted_kth(keys, lengths, (RANK * kp, kp))
        samples = {}
        for x in table:
            if x["family"] in "CD":
                f = x["retry"] or 1
                samples.setdefault((x["s"], x["word"]), set()).update({x["m"], f * x["m"], math.ceil(x["m"] / f)})
        skth = {key: sampled_kth(keys, lengths, key[0], key[1], sorted(ms)) for key, ms in samples.items()}
        rows = []
        for x in table:
            if x["family"] in "AB":
                def run(unit, x=x):
                    return simulate_seeded(keys, lengths, k, gamma=x["gamma"], capacity=capacity, unit=unit,
                                           qnorm=qnorm if x["qnorm"] else None, kth=kth)

                row = summarize(run(1), group)
                row["group_coupled"] = float(run(group)["second"][1:, ::group].mean())
                row["layer_coupled"] = float(run(heads)["second"][1:, 0].mean())
            else:
                row = summarize(sample_rule(keys, lengths, k, c=x["c"], s=x["s"], word=x["word"], capacity=capacity,
                                            retry=x["retry"], full_below=x["full_below"],
                                            kth=skth[(x["s"], x["word"])]), group)
            row["candidates_per_kp"] = row.pop("written") / kp
            rows.append(row)
        stats[k] = (table, rows)
    return stats


def main(argv=None):
    from fathom_jax.eval import fidelity as fid
    from fathom_jax.eval import texts
    from fathom_jax.eval.sweeps import corpus_calibration
    from fathom_jax.models import capture_qkv
    from fathom_jax.models.hub import KNOWN_MODELS, known_model, load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", choices=KNOWN_MODELS)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--positions", type=int, default=256, help="consecutive decode positions at the window's end")
    ap.add_argument("--k", default="128,512", help="selection sizes (a list)")
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--cache", default=None, help="a folder keeping each layer's score keys (reruns skip scoring)")
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)
    ks = tuple(int(k) for k in args.k.split(","))
    if not 2 <= args.positions <= args.context - max(ks):
        ap.error("--positions must lie in [2, --context - max k]")
    t0 = time.time()
    spec_file = known_model(args.model)
    model, tok, cfg = load_model(args.model)
    eval_text, eval_info = texts.evaluation_text()
    qkv = capture_qkv(model, jnp.asarray(texts.token_window(tok.encode(eval_text), args.context,
                                                           name="evaluation text")))
    cap = fid.Capture(q=qkv["q"], k=qkv["k"], v=qkv["k"])  # the values are not read
    del qkv
    budget = BUDGET * cap.q.shape[-1] // 128
    method = methods.parse(f"fathom:{budget}")
    lengths = np.arange(args.context - args.positions, args.context, dtype=np.int32) + 1
    model_layers = [int(x) for x in getattr(cfg, "global_layers", range(cap.k.shape[0]))]
    name = f"{spec_file.slug}_{args.context // 1024}k_{args.positions}"
    paths = [os.path.join(args.cache, f"{name}_layer{layer}.npy") if args.cache else None
             for layer in range(cap.k.shape[0])]
    calib = None
    if not all(path and os.path.exists(path) for path in paths):
        calib, _, _ = corpus_calibration(model, tok, args.calibration_tokens)
    del model  # only the capture and the calibration from here
    print(f"captured: {time.time() - t0:.0f} s", flush=True)
    per_layer = []
    group = cap.group_size
    for layer, path in enumerate(paths):
        q = cap.layer_queries(layer, lengths - 1)  # [P, Hkv, G, D]
        qnorm = np.linalg.norm(np.asarray(q, np.float64), axis=-1).reshape(len(lengths), -1)
        if path and os.path.exists(path):
            keys = np.load(path)
        else:
            layer_calib = jax.tree.map(lambda x: x[layer], calib)
            keys = layer_keys(method, q, cap.k[layer], layer_calib, lengths)
            if path:
                os.makedirs(args.cache, exist_ok=True)
                np.save(path, keys)
        t1 = time.time()
        per_layer.append(layer_stats(keys, lengths, ks, group, qnorm))
        del keys
        print(f"layer {model_layers[layer]}: {time.time() - t0:.0f} s (rules {time.time() - t1:.0f} s)", flush=True)
    rows = []
    for k in ks:
        kp = k - SINK_TOKENS - LOCAL_TOKENS
        table = per_layer[0][k][0]
        for i, rule in enumerate(table):
            by_layer = [stats[k][1][i] for stats in per_layer]
            worst = int(np.argmax([s["fail"] for s in by_layer]))
            rows.append({"k": k, "kp": kp, "capacity": default_capacity(kp), **rule,
                         **{key: float(np.mean([s[key] for s in by_layer])) for key in by_layer[0]},
                         "fails": sum(s["fails"] for s in by_layer),
                         "decisions": sum(s["decisions"] for s in by_layer),
                         "worst_layer": model_layers[worst], "worst_fail": by_layer[worst]["fail"],
                         "layers": by_layer})
    res = {"meta": {"machine": harness.machine(), "command": harness.command("scripts.threshold_rules", argv),
                    "config": vars(args), "model": spec_file.title, "text": eval_info, "layers": model_layers,
                    "heads": int(cap.q.shape[1]), "group": int(group), "head_dim": int(cap.q.shape[-1]),
                    "scores": f"Fathom {BUDGET} (fathom:{budget})", "sink": SINK_TOKENS, "local": LOCAL_TOKENS,
                    "wall_seconds": round(time.time() - t0, 1)}, "rows": rows}
    prefix = os.path.join(args.out, f"threshold_rules_{spec_file.slug}_{args.context // 1024}k"
                          + ("" if args.positions == 256 else f"_{args.positions}pos"))
    print(harness.write_results(prefix, res, report))


def report(res: dict) -> str:
    meta, c = res["meta"], res["meta"]["config"]
    m = meta["machine"]
    lines = [f"# Threshold rules: how often a head's candidates fail ({meta['model'].split(' (')[0]}, "
             f"{c['context']} tokens)", "",
             f"{m['date']}, JAX {m['jax']}, commit {m['commit']}, {m['backend']}, {meta['wall_seconds']} s. Command: "
             f"`{meta['command']}`. {meta['model']}, layers {meta['layers']} x {meta['heads']} query heads in KV "
             f"groups of {meta['group']} (D = {meta['head_dim']}), {meta['scores']} scores; the evaluation text's "
             f"last {c['positions']} of {c['context']} positions as consecutive decode steps (the first excluded); "
             f"sink {meta['sink']}, local {meta['local']}, k' = k - {meta['sink']} - {meta['local']}, capacity = "
             "next_pow2(16 k'); the rules of `scripts/threshold_rules.py`.", "",
             "Rules: `seed rank 8` (A: the library's seed, rank 8 / slack 2); `seed-lower g` (B: a success with "
             "fewer than 8 k' candidates lowers T by g x (s_k' - T)); `+qnorm` (the seed scaled by the next step's "
             "query norm over this one's); `sample c s m` (C: T = the m-th largest score of every s-th stored middle "
             "position, or of every s-th 32-token word with `words`, m = ceil(c k' / s); no sample (the lowest T) "
             "where the middle holds at most `capacity` tokens, except in rows marked `(sampled)`); `+retry f` (D: a "
             "failing head scans again at the (f m)-th sampled score if too few, the ceil(m / f)-th if overflow).", "",
             "`fail`: share of (step, layer, query head) whose candidates cannot prove the selection (after the "
             "retry in D; `fails`: their number, of all), split into `overflow` and `too few`; `group any` / "
             "`layer any`: share of (step, layer, KV group) / (step, layer) with any head failing; `group cond` / "
             "`layer cond` (A, B): the second path's share with one decision per group / layer (every head of it "
             "reseeded); `retried`: share of heads scanning twice (D); `cand / k'`: candidates the scans write per "
             "head (both scans in D) over k'; "
             "`worst layer`: the largest per-layer `fail` (the layer; 0: no layer fails)."]
    for k in sorted({r["k"] for r in res["rows"]}):
        rows = [r for r in res["rows"] if r["k"] == k]
        r0 = rows[0]
        lines += ["", f"## k = {k} (k' = {r0['kp']}, capacity {r0['capacity']})", "",
                  "| rule | fail | fails | overflow | too few | group any | layer any | group cond | layer cond | "
                  "retried | cand / k' | worst layer |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            opt = [f"{r[x]:.5f}" if x in r else "" for x in ("group_coupled", "layer_coupled", "retried")]
            lines.append(f"| {r['name']} | {r['fail']:.5f} | {r['fails']} / {r['decisions']} | "
                         f"{r['overflow']:.5f} | {r['few']:.5f} | {r['group_any']:.5f} | {r['layer_any']:.5f} | "
                         f"{' | '.join(opt)} | {r['candidates_per_kp']:.2f} | "
                         + (f"{r['worst_fail']:.5f} ({r['worst_layer']}) |" if r["worst_fail"] else "0 |"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
