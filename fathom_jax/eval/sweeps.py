"""The downstream sweeps on a real model: RULER-style tasks and step agreement on code sessions.

    res = run_ruler(RulerConfig(context=4096, ks=(64, 128), per_task=8), model, tokenizer)
    res = run_agreement(AgreementConfig(context=4096, sessions=40), model, tokenizer)

Both follow the paper's protocol through :mod:`fathom_jax.eval.downstream`: one dense prefill per batch of
samples, then greedy decoding branched per method from the same KV cache (one compiled program per method,
k and shape), sparse attention on every generated token, the same k for every method. The results are
plain JSON (every sample's score and generation, the configuration and the run's provenance);
:mod:`fathom_jax.eval.downstream_report` rebuilds the tables and figures from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import calibrate as cal
from fathom_jax import methods as methods_lib
from fathom_jax.checks import reraise
from fathom_jax.eval import agreement as agreement_lib
from fathom_jax.eval import downstream as ds
from fathom_jax.eval import ruler as ruler_lib
from fathom_jax.eval.progress import Progress
from fathom_jax.eval.resume import UnitLog
from fathom_jax.methods.sharing import SharedMethod

SMOLLM2 = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to f32)"  # the model unless the run's meta names another
RESERVED = 64  # cache slots past the prompt: the longest generation (40 RULER tokens, 64 agreement tokens)
CALIBRATIONS = ("corpus", "session")


@dataclasses.dataclass(frozen=True)
class RulerConfig:
    """A RULER-style sweep: ``per_task`` samples of every task at one context (prompt + generation)."""

    context: int = 4096
    ks: tuple[int, ...] = (64, 128)
    tasks: tuple[str, ...] = ruler_lib.TASKS
    per_task: int = 8
    methods: tuple[str, ...] = ds.DEFAULT_METHODS
    batch: int = 2
    seed: int = 0
    calibration: str = "corpus"  # corpus: statistics of the pydoc prose; session: the prompt's own keys
    calib_tokens: int = 4096
    rows: tuple[str, ...] = (ds.MODEL_ROWS,)  # the K/V row formats every scan decodes with

    @property
    def prompt_tokens(self) -> int:
        return self.context - RESERVED

    @property
    def steps(self) -> int:
        return ruler_lib.max_gen_tokens(self.tasks)


@dataclasses.dataclass(frozen=True)
class AgreementConfig:
    """Step agreement: ``sessions`` code sessions of ``context - steps`` tokens, ``steps`` decoded tokens,
    k as fractions of the context."""

    context: int = 4096
    sessions: int = 40
    k_fractions: tuple[float, ...] = (0.02, 0.005)
    steps: int = 64
    methods: tuple[str, ...] = ds.DEFAULT_METHODS
    baseline: str = "sparq:16"  # paired differences against SparQ r = D/4
    batch: int = 2
    calibration: str = "corpus"
    calib_tokens: int = 4096
    rows: tuple[str, ...] = (ds.MODEL_ROWS,)

    @property
    def prompt_tokens(self) -> int:
        return self.context - self.steps

    @property
    def ks(self) -> tuple[int, ...]:
        return tuple(max(1, round(f * self.context)) for f in self.k_fractions)


def check_common(config, max_context: int, head_dim: int) -> None:
    """The checks both sweeps share (raise ValueError with one clear line)."""
    if config.context > max_context:
        raise ValueError(f"context {config.context} is longer than the model can hold ({max_context} positions)")
    if config.context < 512 or config.context % 64:
        raise ValueError(f"context must be a multiple of 64 and at least 512 tokens, got {config.context}")
    for k in config.ks:
        if k < 1 or k > config.context:
            raise ValueError(f"k={k} must lie in [1, context = {config.context}]")
    if len(set(config.ks)) != len(config.ks):
        raise ValueError(f"selection sizes repeat: k = {list(config.ks)} at context {config.context}; give each once")
    if config.batch < 1:
        raise ValueError(f"batch must be >= 1, got {config.batch}")
    if config.calibration not in CALIBRATIONS:
        raise ValueError(f"calibration must be one of {CALIBRATIONS}, got {config.calibration!r}")
    methods = ds.parse_methods(config.methods)
    for m in methods:
        m.validate(head_dim)
        needs = methods_lib.needs_tuned_calibration(m.method if isinstance(m, SharedMethod) else m)
        if needs:  # it failed after the model loaded and calibrated: 34-59 s later on the CPU
            raise ValueError(f"{m.spec} reads {needs}; the sweeps calibrate with corpus or session statistics, which "
                             "hold none")
    if not any(m.name == "exact" for m in methods):
        raise ValueError("the methods must include exact (the top-k oracle every scan is compared with)")
    from fathom_jax.rows.layout import row_format

    if not config.rows or len(set(config.rows)) != len(config.rows):
        raise ValueError(f"rows: give each K/V row format once, at least one, got {list(config.rows)}")
    for rows in config.rows:
        fmt = row_format(rows)  # a clear error for an unknown format or one without per-token scales
        if fmt is not None:
            fmt.validate(head_dim)
            if rows != fmt.spec:
                raise ValueError(f"rows: write {rows!r} as {fmt.spec!r}")


def check_ruler(config: RulerConfig, max_context: int = 8192, head_dim: int = 64) -> None:
    ruler_lib.check_tasks(config.tasks)
    check_common(config, max_context, head_dim)
    if not any(m.name == "dense" for m in ds.parse_methods(config.methods)):
        raise ValueError("the methods must include dense (the accuracy every method is read against)")
    if config.per_task < 1:
        raise ValueError(f"samples per task must be >= 1, got {config.per_task}")
    if config.steps > RESERVED:
        raise ValueError(f"generations of {config.steps} tokens do not fit the {RESERVED} reserved slots")


def check_agreement(config: AgreementConfig, max_context: int = 8192, head_dim: int = 64) -> None:
    for f in config.k_fractions:
        if not 0 < f <= 1:
            raise ValueError(f"k fractions must lie in (0, 1], got {f}")
    check_common(config, max_context, head_dim)
    if config.sessions < 2:
        raise ValueError(f"sessions must be >= 2 (a standard error needs two), got {config.sessions}")
    if not 1 <= config.steps <= config.context // 2:
        raise ValueError(f"steps must lie in [1, context / 2], got {config.steps}")
    if config.baseline not in config.methods:
        raise ValueError(f"the baseline {config.baseline!r} is not among the methods")


# ----------------------------------------------------------------------------------------------
# Shared set-up: corpus calibration and the bits each method reads


def corpus_calibration(model, tokenizer, tokens: int) -> tuple[cal.Calibration, Any, dict]:
    """Statistics of ``tokens`` tokens of the pydoc prose (the study's calibration text) and its capture."""
    from fathom_jax.eval import texts
    from fathom_jax.eval.fidelity import Capture
    from fathom_jax.models import capture_qkv

    text, info = texts.calibration_text()
    ids = texts.token_window(tokenizer.encode(text), tokens, name="calibration text")
    capture = Capture(**capture_qkv(model, jnp.asarray(ids)))
    return cal.calibrate(capture.k, capture.q), capture, {**info, "tokens": tokens}


def session_calibration(prefill: ds.Prefill, model) -> cal.Calibration:
    """Each prompt's own prefill statistics, ``[L, B x Hkv]`` (paper B5), computed once for every branch."""
    kv = prefill.kv
    n_layers, b, hkv, capacity, d = kv.k.shape
    lengths = jnp.repeat(prefill.lengths, hkv)
    per_layer = [cal.calibrate_session(kv.k[layer].reshape(b * hkv, capacity, d).astype(jnp.float32), length=lengths)
                 for layer in range(n_layers)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)


def method_bits(methods, capture, calib, model_config=None) -> dict[str, float]:
    return {m.spec: ds.read_bits(m, capture, calib, model_config=model_config) for m in methods}


def _setup(config, model, tokenizer, progress: bool):
    """What both sweeps start from: the methods, the corpus calibration and its provenance, and the bits
    each method reads on the calibration text (each step said as it starts, with ``progress``: half a minute on the
    CPU before the first decode, which ran silent)."""
    kind = "ruler" if isinstance(config, RulerConfig) else "agreement"
    say = (lambda text: print(f"[{kind}] {text}", flush=True)) if progress else (lambda text: None)
    methods = ds.parse_methods(config.methods)
    say(f"capturing q/k/v over {config.calib_tokens} tokens of the pydoc prose (the corpus statistics and every "
        "method's bits per token)")
    calib, capture, calib_info = corpus_calibration(model, tokenizer, config.calib_tokens)
    say(f"measuring the bits per token of {len(methods)} methods on it; then the prompts")
    return methods, calib, calib_info, method_bits(methods, capture, calib, model.config)


def _meta(config, extra: dict | None) -> dict:
    return {
        **(extra or {}),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} ({platform.machine()}, {jax.devices()[0].platform}: "
                   f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores)",
        "jax": jax.__version__,
        "config": dataclasses.asdict(config),
    }


def _bos(tokenizer) -> list[int]:
    """What every prompt starts with: BOS where the model asks for one (Gemma 3), else nothing."""
    from fathom_jax.models.tokenizer import encode_prompt

    return encode_prompt(tokenizer, "")


def _batches(items: Sequence, size: int):
    for i in range(0, len(items), size):
        yield items[i: i + size]


@dataclasses.dataclass
class _Units:
    """What the batches of one sweep share: the corpus statistics, the progress bar, the seconds spent, and the
    log of finished (batch, branch) units (None: nothing saved)."""

    config: Any
    corpus: cal.Calibration
    bar: Progress
    log: UnitLog | None
    timing: dict = dataclasses.field(default_factory=lambda: {"prefill_s": 0.0, "decode_s": 0.0})
    resumed: int = 0  # units an earlier, interrupted run saved
    earlier_s: float = 0.0  # ... and the seconds they took

    def close(self) -> None:
        self.bar.close()


def _start(config, n_samples: int, branches, progress: bool, log: UnitLog | None, corpus) -> _Units:
    n_batches = -(-n_samples // config.batch)
    done = [(i, b.key) for i in range(n_batches) for b in branches if log and log.get(f"{i}:{b.key}")]
    kind = "RULER" if isinstance(config, RulerConfig) else "agreement"
    bar = Progress(n_batches * len(branches), f"{kind} @ {config.context}", unit="decode", done=len(done),
                   keys=len(branches), enabled=progress)
    units = _Units(config, corpus, bar, log, resumed=len(done))
    for i, key in done:  # the time the saved units took, so that the totals are the whole run's
        for name in units.timing:
            units.timing[name] += log.get(f"{i}:{key}").get(name, 0.0)
    units.earlier_s = sum(units.timing.values())
    return units


def _decode_all(model, index: int, prompts, branches, steps: int, units: _Units) -> dict:
    """Every branch's greedy tokens for batch ``index`` of the prompts: ``{branch key: [B, steps] array}``; units
    the log holds are read back, the others decoded (after one prefill) and logged as each finishes."""
    out, todo = {}, []
    for branch in branches:
        saved = units.log and units.log.get(f"{index}:{branch.key}")
        if saved:
            out[branch.key] = np.asarray(saved["tokens"], np.int32)
        else:
            todo.append(branch)
    if not todo:
        return out
    t0 = time.time()
    units.bar.phase(f"prefill of batch {index + 1}")
    prefill = ds.dense_prefill(model, prompts, units.config.context)
    jax.block_until_ready(prefill.first)
    prefill_s = time.time() - t0
    units.timing["prefill_s"] += prefill_s
    calib = units.corpus if units.config.calibration == "corpus" else session_calibration(prefill, model)
    for branch in todo:
        t0 = time.time()
        units.bar.phase(f"decoding {branch.name}")  # a branch's first decode compiles its program
        tokens = np.asarray(ds.decode_branch(model, prefill, branch, steps, calib))
        decode_s = time.time() - t0
        units.timing["decode_s"] += decode_s
        out[branch.key] = tokens
        if units.log is not None:
            units.log.add(f"{index}:{branch.key}", {"tokens": tokens.tolist(), "decode_s": round(decode_s, 3),
                                                    "prefill_s": round(prefill_s, 3)})
            prefill_s = 0.0  # counted once per batch
        units.bar.update(1, key=branch.key)
    return out


# ----------------------------------------------------------------------------------------------
# The sweeps


def _timing(t_start: float, units: _Units) -> dict:
    """Seconds of the whole run: this process's, plus the prefill and decoding of the units an earlier,
    interrupted run saved (``resumed_units`` of them; its set-up time is not known)."""
    out = {"wall_s": round(time.time() - t_start + units.earlier_s, 1),
           **{k: round(v, 1) for k, v in units.timing.items()}}
    if units.resumed:
        out["resumed_units"] = units.resumed
    return out


@reraise()  # a run-time check that fires reads as its CheckError
def run_ruler(config: RulerConfig, model, tokenizer, *, progress: bool = True, meta: dict | None = None,
              log: UnitLog | None = None) -> dict:
    """RULER-style tasks at one context: every sample's score for every branch, plus provenance.

    ``log``: where finished (batch, branch) units are written as they finish and read back from (an interrupted
    run resumed with the same log gives the results an uninterrupted one would)."""
    from fathom_jax.eval import texts

    check_ruler(config, model.config.max_position_embeddings, model.config.head_dim)
    t_start = time.time()
    methods, calib, calib_info, bits = _setup(config, model, tokenizer, progress)
    sentences, hay_info = texts.prose_sentences()
    hay_info = {**hay_info, "tokens": ruler_lib.haystack_tokens(tokenizer, sentences)}
    start = _bos(tokenizer)
    samples = ruler_lib.make_samples(tokenizer, config.tasks, config.per_task, config.prompt_tokens - len(start),
                                     config.seed, sentences=sentences)
    branches = ds.branches(methods, config.ks, config.rows)
    scores = {b.key: [] for b in branches}
    generations = {b.key: [] for b in branches}
    with contextlib.closing(_start(config, len(samples), branches, progress, log, calib)) as units:
        for i, batch in enumerate(_batches(samples, config.batch)):
            tokens = _decode_all(model, i, [[*start, *s.prompt] for s in batch], branches, config.steps, units)
            for key in (b.key for b in branches):
                for s, t in zip(batch, tokens[key]):
                    text = tokenizer.decode(t[: s.gen_tokens].tolist())
                    scores[key].append(ruler_lib.score(text, s.gold))
                    generations[key].append(text)
    return {
        "kind": "ruler",
        "meta": {"model": SMOLLM2, **_meta(config, meta), "calib_text": calib_info, "haystack": hay_info,
                 **_timing(t_start, units), "compile_s": round(units.bar.compile_s, 1),
                 "head_dim": model.config.head_dim, "bos": bool(start),
                 "forced_tokens": {str(k): list(ds.forced_tokens(k)) for k in config.ks}},
        "samples": [{"task": s.task, "gold": list(s.gold), "depths": [round(d, 4) for d in s.depths]} for s in samples],
        "branches": [_branch_entry(b, bits, scores[b.key], generations[b.key]) for b in branches],
    }


@reraise()
def run_agreement(config: AgreementConfig, model, tokenizer, *, progress: bool = True,
                  meta: dict | None = None, log: UnitLog | None = None) -> dict:
    """Step agreement: every method's next ``steps`` tokens on every session, scored against the exact
    top-k step at the same k (and, for reference, against the real next span of code). ``log``: as
    :func:`run_ruler`'s."""
    check_agreement(config, model.config.max_position_embeddings, model.config.head_dim)
    t_start = time.time()
    methods, calib, calib_info, bits = _setup(config, model, tokenizer, progress)
    start = _bos(tokenizer)
    sessions, session_info = agreement_lib.make_sessions(tokenizer, config.sessions, config.prompt_tokens - len(start),
                                                         config.steps)
    branches = ds.branches(methods, config.ks, config.rows)
    texts_out = {b.key: [] for b in branches}
    with contextlib.closing(_start(config, len(sessions), branches, progress, log, calib)) as units:
        for i, batch in enumerate(_batches(sessions, config.batch)):
            tokens = _decode_all(model, i, [[*start, *s.prompt] for s in batch], branches, config.steps, units)
            for key in (b.key for b in branches):
                texts_out[key] += [tokenizer.decode(t.tolist()) for t in tokens[key]]
    targets = [tokenizer.decode(list(s.target)) for s in sessions]
    entries = []
    for b in branches:
        ks = config.ks if b.k is None else (b.k,)
        agree = {str(k): [agreement_lib.step_agreement(t, o)
                          for t, o in zip(texts_out[b.key], texts_out[f"exact@{k}"])] for k in ks}
        real = [agreement_lib.step_agreement(t, r) for t, r in zip(texts_out[b.key], targets)]
        entry = _branch_entry(b, bits, None, texts_out[b.key])
        entry.update(agreement=agree, real=real)
        entries.append(entry)
    return {
        "kind": "agreement",
        "meta": {"model": SMOLLM2, **_meta(config, meta), "calib_text": calib_info, "sessions": session_info,
                 **_timing(t_start, units), "compile_s": round(units.bar.compile_s, 1),
                 "head_dim": model.config.head_dim, "bos": bool(start),
                 "ks": list(config.ks), "forced_tokens": {str(k): list(ds.forced_tokens(k)) for k in config.ks}},
        "samples": [{"package": s.package, "start": s.start, "target": t} for s, t in zip(sessions, targets)],
        "branches": entries,
    }


def _branch_entry(branch: ds.Branch, bits: dict, scores, generations) -> dict:
    m = branch.method
    entry = {"key": branch.key, "spec": m.spec, "label": branch.label, "kind": m.name, "k": branch.k,
             "rows": branch.rows, "bits": bits[m.spec], "generations": generations}
    if scores is not None:
        entry["scores"] = scores
    return entry
