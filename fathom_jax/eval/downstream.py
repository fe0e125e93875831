"""The downstream protocol shared by the RULER-style tasks and the step-agreement sweep (paper 5.5, 5.6).

One dense prefill per batch of samples, then greedy decoding branched per method from the same KV cache,
with sparse attention on every generated token and the same k for every method:

    prefill = dense_prefill(model, prompts, capacity)          # one compiled program, right-padded batch
    for branch in branches(methods, ks):
        tokens = decode_branch(model, prefill, branch, steps, calibration=calib)   # [B, steps]

:func:`decode_branch` builds the method's sparse cache from the dense K/V rows
(:func:`fathom_jax.decode.cache_from_dense`, jitted) and runs the compiled greedy loop
(:func:`fathom_jax.models.generation.decode_loop`): one program per (method, k, shape), no Python per token.
The first generated token comes from the dense prefill (it is the same for every method); every later
token is decoded with the method's attention. The dense row is the sparse path's ``dense`` method
(attention over every cached token), which reproduces transformers' greedy tokens (tests/eval).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import decode
from fathom_jax import format as fmt
from fathom_jax import methods as methods_lib
from fathom_jax.calibrate import Calibration
from fathom_jax.index import build_index
from fathom_jax.methods import ScanMethod
from fathom_jax.methods.sharing import SharedMethod
from fathom_jax.methods.sharing import parse_method
from fathom_jax.models import generation
from fathom_jax.models.attention import DenseCache
from fathom_jax.models.cache import KVCache
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS


def default_methods(head_dim: int) -> tuple[str, ...]:
    """The paper's method set at ``head_dim``: Fathom at 48 / 64 / 96 code bits at D = 128 (D = 64: 24 / 32 / 48,
    ~28 / 37 / 56 bits per token with scales) in raw planes (the basis the rule picks for SmolLM2:
    results/fidelity_smollm2_*.md), SparQ r = D/8 and D/4, Double Sparsity c = D/4,
    Loki r = D/4, the 2-bit thumbnail and the 8-token landmark, with the exact top-k oracle and dense attention."""
    fathoms = tuple(f"fathom:{b}" for b in methods_lib.fathom_budgets(head_dim, (48, 64, 96)))
    return ("dense", "exact", *fathoms, *(methods_lib.at_head_dim(spec, head_dim) for spec in (
        "sparq:D/8", "sparq:D/4", "double_sparsity:D/4", "loki:D/4", "thumbnail:2", "landmark")))


DEFAULT_METHODS = default_methods(64)  # SmolLM2's


# The smallest selection the downstream sweeps take: below 128 tokens a selection keeps k/8 sinks and a k/4 local
# window (forced_tokens), so at 16 the scan still chooses 10 of its 16 tokens; k = 4 left it 2 (and ran for hours).
MIN_K = 16
SMALL_K = "below 128 a selection keeps k/8 sinks and a k/4 local window"  # why k may be that small, for messages


def forced_tokens(k: int) -> tuple[int, int]:
    """(sink, local) for selection size ``k``: the paper's 4 + 32 from k = 128 up; below, a quarter of k
    for the local window and at most k/8 sinks, so that most of a small k is still chosen by the scan."""
    if k >= 128:
        return SINK_TOKENS, LOCAL_TOKENS
    return min(SINK_TOKENS, max(1, k // 8)), max(1, k // 4)


MODEL_ROWS = "model"  # the cache's K/V rows in the model's dtype (the default; every sweep's reference)


def branch_key(spec: str, k: int | str | None, rows: str | None = None) -> str:
    """A branch's stable id in results files, e.g. ``fathom:48@128``, ``fathom:48@128+k8v8``, ``dense``."""
    key = spec if k is None else f"{spec}@{k}"
    return key if not rows else f"{key}+{rows}"


@dataclasses.dataclass(frozen=True)
class Branch:
    """One decoding branch: a method at a selection size (``k = None`` for dense attention), its cache's K/V rows
    in ``rows`` (a row format spec such as ``k8v8``; None: the model's dtype)."""

    method: ScanMethod
    k: int | None
    rows: str | None = None

    @property
    def label(self) -> str:
        return self.method.label if self.rows is None else f"{self.method.label} ({self.rows} rows)"

    @property
    def name(self) -> str:
        return self.label if self.k is None else f"{self.label}, k={self.k}"

    @property
    def key(self) -> str:
        return branch_key(self.method.spec, self.k, self.rows)


def parse_methods(specs: Sequence[str]) -> tuple[ScanMethod, ...]:
    """Methods from spec strings (``fathom:48``, ``sparq:16``, ``dense``...), with a clear error."""
    out = []
    for spec in specs:  # each raises ValueError naming the spec and the accepted forms
        out.append(parse_method(spec))
    if len(set(out)) != len(out):
        raise ValueError(f"methods are listed twice: {list(specs)}")
    return tuple(out)


def branches(methods: Sequence[ScanMethod], ks: Sequence[int], rows: Sequence[str] = (MODEL_ROWS,)) -> list[Branch]:
    """Dense once (it selects nothing), every other method at every k with every row format of ``rows``; the
    exact top-k oracle always with rows in the model's dtype too (the step every branch is compared with)."""
    formats = [None if r == MODEL_ROWS else r for r in rows]
    out = []
    for m in methods:
        if isinstance(m, methods_lib.Dense):
            out.append(Branch(m, None))
            continue
        mine = ([None] + [f for f in formats if f is not None]) if isinstance(m, methods_lib.Exact) else formats
        out += [Branch(m, int(k), f) for k in ks for f in mine]
    return out


@dataclasses.dataclass(frozen=True)
class Prefill:
    """The dense prefill every branch starts from: K/V rows (of the layers that cache the whole context), prompt
    lengths, the first generated token, and what the model keeps of its own between steps (Gemma 3: its windows)."""

    kv: KVCache
    lengths: jax.Array  # [B]
    first: jax.Array  # [B] argmax of the logits at each prompt's last token
    own: Any = None

    @property
    def capacity(self) -> int:
        return self.kv.capacity


def dense_prefill(model, prompts: Sequence[Sequence[int]], capacity: int) -> Prefill:
    """Dense causal prefill of right-padded ``prompts`` into a :class:`KVCache` of ``capacity`` tokens.

    Causal attention never lets a real token see the padding after it, so every prompt's K/V rows and
    last-token logits are those of its own prefill.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("dense_prefill: every prompt needs at least one token")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if lengths.max() > capacity:
        raise ValueError(f"dense_prefill: a prompt of {lengths.max()} tokens does not fit a cache of {capacity}")
    tokens = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    if not model.ragged and lengths.min() != lengths.max():
        raise ValueError(f"dense_prefill: {type(model).__name__} prefills equal-length prompts, got lengths "
                         f"{lengths.tolist()}")
    logits, state, _ = generation.prefill(model, tokens, lengths, DenseCache(), capacity)
    own, kv = model.split_state(state)
    return Prefill(kv=kv, lengths=jnp.asarray(lengths), first=generation.first_token(logits), own=own)


_cache_from_dense = jax.jit(decode.cache_from_dense, static_argnames=("layer_ids", "model_layers"))


def attention_for(branch: Branch, capacity: int, calibration: Calibration | str | None) -> decode.SparseAttention:
    """The decode attention of ``branch`` (jnp reference scan: the same numbers on every machine)."""
    k = capacity if branch.k is None else branch.k
    sink, local = forced_tokens(k)
    return decode.from_spec(branch.method, k=k, calibration=calibration, sink=sink, local=local, rows=branch.rows,
                            implementation="xla")


def decode_branch(model, prefill: Prefill, branch: Branch, steps: int,
                  calibration: Calibration | str | None = "session") -> np.ndarray:
    """Greedy tokens ``[B, steps]`` of one branch from the shared prefill (the first is the prefill's)."""
    attn = attention_for(branch, prefill.capacity, calibration)
    shape = model.cache_shape(prefill.first.shape[0], prefill.capacity)  # the model layers the cache's are
    cache, attn = _cache_from_dense(prefill.kv, prefill.lengths, attn, layer_ids=shape.layer_ids,
                                    model_layers=shape.model_layers)
    own = jax.tree.map(jnp.copy, prefill.own)  # the loop donates its state; every branch starts from the prefill's
    tokens, _ = generation.decode_loop(model, prefill.first, model.join_state(own, cache), attn, steps)
    return np.asarray(tokens)


# ----------------------------------------------------------------------------------------------
# Bits per token and statistics


def read_bits(method: ScanMethod | SharedMethod, capture, calib: Calibration | None, positions: int = 8,
              model_config=None) -> float:
    """Bits per token (per KV head per layer) the method reads, averaged over layers, heads and the last
    ``positions`` queries of a capture (``fathom_jax.eval.fidelity.Capture``); query-dependent for Fathom. A selection
    shared across layers reads at its selection layers only (its plan for ``model_config``), none elsewhere."""
    n_layers = capture.k.shape[0]
    layers = range(n_layers)
    scan = method
    if isinstance(method, SharedMethod):
        if model_config is None:
            raise ValueError(f"read_bits: {method.spec} needs the model's config (which layers select)")
        selects = method.sharing.plan(model_config).selects
        if len(selects) != n_layers:
            raise ValueError(f"read_bits: the plan covers {len(selects)} layers, the capture {n_layers}")
        layers, scan = np.flatnonzero(selects), method.method
    d = capture.k.shape[-1]
    fixed = scan.fixed_bits_per_token(d)
    if fixed is None and isinstance(scan, methods_lib.Exact):  # exact and dense read the keys
        fixed = fmt.key_bits_per_token(d)
    if fixed is not None:
        return float(fixed) if scan is method else float(fixed) * len(layers) / n_layers
    out = _layer_bits(scan, capture, calib, positions, layers)
    if scan is method:
        return float(np.mean(out))
    return float(np.sum([np.mean(b) for b in out]) / n_layers)


def _layer_bits(method: ScanMethod, capture, calib, positions: int, layers) -> list[np.ndarray]:
    """The bits per token a plan reads at each of ``layers`` (an array over the capture's last queries and heads)."""
    d = capture.k.shape[-1]
    _, n_heads, n_tokens, _ = capture.q.shape
    n_kv = capture.k.shape[1]
    window = min(n_tokens, fmt.BLOCK_TOKENS)

    @jax.jit
    def layer_bits(q, keys, c):
        index = build_index(keys, c, method.parts)
        return jax.vmap(lambda q_p: method.read(q_p, index, c).bits)(q)

    out = []
    for layer in layers:
        q = jnp.asarray(capture.q[layer][:, n_tokens - positions:])  # [H, P, D]
        q = jnp.moveaxis(q.reshape(n_kv, n_heads // n_kv, positions, d), 2, 0)
        c = None if calib is None else jax.tree.map(lambda a, layer=layer: a[layer], calib)
        out.append(np.asarray(layer_bits(q, jnp.asarray(capture.k[layer][:, :window]), c)))
    return out


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error (ddof = 1; 0 for a single value)."""
    v = np.asarray(values, np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    se = float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else 0.0
    return float(v.mean()), se


def paired(values, baseline) -> dict:
    """Paired difference ``values - baseline`` per sample: mean, standard error, and wins / ties / losses."""
    a, b = np.asarray(values, np.float64), np.asarray(baseline, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired: {a.shape} values against a baseline of {b.shape}")
    diff = a - b
    mean, se = mean_se(diff)
    return {"mean": mean, "se": se, "wins": int(np.sum(diff > 0)), "ties": int(np.sum(diff == 0)),
            "losses": int(np.sum(diff < 0)), "n": int(diff.size)}
