"""The offload benchmark's synthetic inputs (``scripts/bench_offload.py``): how its keys' channel scales are drawn
(:class:`KeyModel`), how its queries move from step to step (:func:`drifting_queries`), and the named input sets a run
measures side by side (``--inputs``): ``today`` (the keys and queries of every committed run before issue 45) and
``honest`` (keys whose plane shares and queries whose row reselection match what real decodes measured); what the
drift is fitted by (:func:`reselected_share`; the fit: results/offload_inputs_cpu.md), and the report's table of the
two side by side."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pallas_kernels.topk import LOCAL_TOKENS, SINK_TOKENS


@dataclasses.dataclass(frozen=True)
class KeyModel:
    """How the synthetic keys' channel scales are drawn: ``exp(logvar_std / 2 * N(0, 1))`` per (layer, KV head,
    channel), then ``outlier_channels`` channels of each group (chosen at random) times ``outlier_scale``. The
    channel variances are all Fathom's planner sees of the keys, so they set where its read bits come from."""

    name: str
    logvar_std: float
    outlier_channels: int = 0
    outlier_scale: float = 1.0

    def draw(self, rng: np.random.Generator, shape: tuple[int, ...], head_dim: int) -> np.ndarray:
        """Channel scales ``shape + (head_dim,)``, float32."""
        scale = np.exp(0.5 * self.logvar_std * rng.standard_normal(shape + (head_dim,)))
        if self.outlier_channels:
            picked = np.argsort(rng.random(shape + (head_dim,)), axis=-1)[..., :self.outlier_channels]
            np.put_along_axis(scale, picked, np.take_along_axis(scale, picked, -1) * self.outlier_scale, -1)
        return scale.astype(np.float32)


# The benchmark's keys since issue 33 (log-variance std 1.25: ~39 active channels at a budget of 48): Fathom 32 / 48 /
# 64 read 84.5 / 80.6 / 77.1% of their code bits from plane 0 (results/plane_shares.md).
TODAY_KEYS = KeyModel("today", 1.25)
# Fitted by a grid over the three fields (Qwen3-8B shapes, Gaussian queries, tests/scripts/test_offload_inputs.py) so
# that Fathom 32 / 48 / 64 read ~66.7 / 64.6 / 62.6% of their code bits from plane 0, as on SmolLM2's real keys at 8k
# (results/plane_shares.md): real keys spread their variance wider, with a few outlier channels read to every plane
# at any budget (the wider spread alone lowers plane 0's share too steeply with the budget).
HONEST_KEYS = KeyModel("honest", 2.0, outlier_channels=2, outlier_scale=16.0)
# The AR(1) drift under which a step at 1M tokens (k = 512, G = 4, HONEST_KEYS) reselects ~63% of the rows of the
# step before, as exact top-k did on SmolLM2 (0.374 new at 4k, results/row_reuse_smollm2_4k.md; Gemma 3's global
# layers 0.43, results/row_reuse_gemma3_4k.md). :func:`reselected_share` at 1M (results/offload_inputs_cpu.md, 12
# groups): 0.95 -> 0.62, 0.96 -> 0.65, 0.965 -> 0.67; 18 other groups gave 0.60 / 0.63 at 0.95 / 0.96: groups differ
# by a few points. The share falls with the context at a given drift (at 128k, 0.96 -> 0.72).
HONEST_DRIFT = 0.96


@dataclasses.dataclass(frozen=True)
class InputSet:
    """A run's synthetic keys and how its queries move: ``drift`` an AR(1) coefficient, or None for the run's
    ``--query-drift`` (None there too: one query set repeated every step)."""

    name: str
    keys: KeyModel
    drift: float | None


INPUTS = {"today": InputSet("today", TODAY_KEYS, None), "honest": InputSet("honest", HONEST_KEYS, HONEST_DRIFT)}


def parse_inputs(text: str) -> list[InputSet]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in INPUTS]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"--inputs takes distinct names from {list(INPUTS)}, got {text!r}")
    return [INPUTS[n] for n in names]


def drifting_queries(q, rho: float, count: int = 64, seed: int = 2) -> list:
    """``count`` query sets, each ``rho`` times the one before plus ``sqrt(1 - rho^2)`` fresh noise (an AR(1) drift,
    stationary: every set has ``q``'s distribution). Real decode steps reselect most rows of the step before; one
    repeated set would let a row cache hit every row, and the row fetch find every page translation cached."""
    rng = np.random.default_rng(seed)
    out, cur = [], np.asarray(q, np.float32)
    for _ in range(count):
        cur = rho * cur + np.sqrt(1 - rho * rho) * rng.standard_normal(cur.shape).astype(np.float32)
        out.append(jnp.asarray(cur))
    return out


def reselected_share(scale, rho: float | None, *, tokens: int, k: int, group_size: int, steps: int = 6,
                     seed: int = 0) -> float:
    """The share of a decode step's rows (each KV group's union of its heads' exact top-k, sink and local window
    included, as the step selects) that the step before selected too, pooled over ``steps`` steps and the groups of
    ``scale [groups, D]``: Gaussian keys of those channel scales, Gaussian queries drifting by
    :func:`drifting_queries` (``rho`` None: fresh queries every step)."""
    rng = np.random.default_rng(seed)
    scale = np.asarray(scale, np.float32).reshape(-1, np.shape(scale)[-1])
    top = k - SINK_TOKENS - LOCAL_TOKENS
    window = set(range(SINK_TOKENS)) | set(range(tokens - LOCAL_TOKENS, tokens))
    again = total = 0
    for g, s in enumerate(scale):
        keys = rng.standard_normal((tokens - SINK_TOKENS - LOCAL_TOKENS, s.size), np.float32) * s
        q = rng.standard_normal((group_size, s.size)).astype(np.float32)
        sets = (drifting_queries(q, rho, steps + 1, seed=seed + 1 + g) if rho is not None else
                [rng.standard_normal(q.shape).astype(np.float32) for _ in range(steps + 1)])
        unions = []
        for q_t in sets:
            picked = np.argpartition(-(np.asarray(q_t) @ keys.T), top, axis=1)[:, :top] + SINK_TOKENS
            unions.append(set(picked.ravel().tolist()) | window)
        for before, now in zip(unions, unions[1:]):
            again += len(now & before)
            total += len(now)
    return again / total


def inputs_lines(att: list[dict]) -> list[str]:
    """Attention-only rows of several ``--inputs`` side by side: each input set's step beside the link floor and
    the same input set's all-in-HBM control (the HBM row of the same method, batch and inputs)."""
    named = [r for r in att if "inputs" in r]
    if len({r["inputs"] for r in named}) < 2:
        return []

    def group(r):
        return (r["method"], r["context"], r["batch"], r.get("resident_planes", 0), r.get("warm_planes", 0),
                r.get("rows", "model"))

    control = {(r["method"], r["batch"], r["inputs"]): r for r in named if r["memory"] != "pinned_host"}
    lines = ["## Today's inputs against honest ones", "",
             "`today`: the keys every earlier run drew (log-variance std 1.25) and one query set repeated every step "
             "(or `--query-drift`); `honest`: keys whose plane-0 shares match SmolLM2's real keys (log-variance std "
             f"{HONEST_KEYS.logvar_std}, {HONEST_KEYS.outlier_channels} outlier channels x{HONEST_KEYS.outlier_scale:g} "
             "per group) and queries drifting so that a step reselects ~63% of the last step's rows, as real decodes "
             "do. `plane 0`: the share of the planned code bits from plane 0. Control: the same inputs with the index "
             "and K/V in HBM.", "",
             "| method | context | batch | resident planes | inputs | drift | plane 0 | ms | link floor ms | ms / floor | "
             "HBM control ms (its context) | vs today |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    offloaded = sorted((r for r in named if r["memory"] == "pinned_host"), key=lambda r: group(r) + (r["inputs"] != "today",))
    today = {group(r): r for r in offloaded if r["inputs"] == "today"}
    for r in offloaded:
        base, ctl = today.get(group(r)), control.get((r["method"], r["batch"], r["inputs"]))
        ctl_text = f"{ctl['median_ms']:.2f} ({ctl['context']})" if ctl else ""
        ratio = f"{r['median_ms'] / base['median_ms']:.2f}x" if base and base is not r else ""
        share = r.get("plane0_share")
        warm = f" + {r['warm_planes']} warm" if r.get("warm_planes") else ""
        lines.append(f"| {r['method']} | {r['context']} | {r['batch']} | {r.get('resident_planes', 0)}{warm} | {r['inputs']} | "
                     f"{r.get('query_drift') or 'none'} | {'' if share is None else f'{100 * share:.1f}%'} | "
                     f"{r['median_ms']:.2f} [{r['min_ms']:.2f}, {r['max_ms']:.2f}] | {r['link_floor_ms']:.1f} | "
                     f"{r['median_ms'] / r['link_floor_ms']:.2f} | {ctl_text} | {ratio} |")
    return lines + [""]
