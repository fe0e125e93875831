"""The error K/V row formats add: every method's selection, attention over rows decoded from each format.

The protocol of the error-versus-bits study (:mod:`fathom_jax.eval.study`, ``fathom sweep``): calibrate on the
pydoc prose, evaluate on standard-library code, the last ``positions`` decode positions of the window, every
layer and head; each method selects sink 4 + local 32 + top-(k - 36) by its scores on the keys as captured,
exactly as in the study (the same programs). Then attention runs over the selected rows as each row format
gives them back, against dense attention over the exact keys and values: ``||o_sel - o_dense|| / ||o_dense||``.

The rows at position ``p`` are those of a cache holding tokens ``0..p``: encoded once for the whole window,
except the block holding ``p``, encoded again with only its first tokens (a format with per-block K scales
requantizes its open block; :meth:`~fathom_jax.rows.formats.RowFormat.encode` with a length gives exactly the
rows appending would). The pseudo-format ``f32`` is the capture as it is: its numbers are the study's.

    res = run_row_study(eval_capture, calib_capture, RowStudyConfig(context=4096))
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import platform
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import calibrate as cal
from fathom_jax import format as fmt
from fathom_jax import methods as methods_lib
from fathom_jax.eval import fidelity as fid
from fathom_jax.eval import fidelity_run as fid_run
from fathom_jax.eval import study
from fathom_jax.rows import formats as row_formats

F32 = "f32"  # the captured rows themselves (the study's numbers)
OPEN = fmt.BLOCK_TOKENS  # every format's blocks divide it: the rows that differ at a position lie in its 64-block


@dataclasses.dataclass(frozen=True)
class RowStudyConfig:
    context: int = 4096
    ks: tuple[int, ...] = ()  # default: the study's (128, 256, 2% of the context)
    positions: int = 128
    formats: tuple[str, ...] = row_formats.STUDY_FORMATS
    methods: tuple[str, ...] = ()  # method specs (corpus calibration); default: every flat row of the study

    def selection_sizes(self) -> tuple[int, ...]:
        return study.StudyConfig(context=self.context, ks=self.ks).selection_sizes()


def check_config(config: RowStudyConfig, head_dim: int) -> None:
    """Every argument checked (ValueError, one line) before a model loads."""
    if config.context % OPEN or config.context < OPEN:
        raise ValueError(f"context must be a positive multiple of {OPEN} tokens, got {config.context}")
    if not 1 <= config.positions <= config.context - cal.SKIP_TOKENS - 2:
        raise ValueError(f"positions must lie in [1, context - {cal.SKIP_TOKENS + 2}], got {config.positions}")
    for k in config.selection_sizes():
        if not 1 <= k <= config.context:
            raise ValueError(f"k={k} must lie in [1, context = {config.context}]")
    if not config.formats:
        raise ValueError("formats: give at least one row format")
    for spec in config.formats:
        row_formats.parse(spec).validate(head_dim)
    for spec in config.methods:
        methods_lib.parse(spec).validate(head_dim)


def study_rows(config: RowStudyConfig, head_dim: int) -> list[study.Row]:
    """The methods whose selections are measured: the study's flat rows, or ``config.methods``."""
    if not config.methods:
        cfg = study.StudyConfig(context=config.context, ks=config.ks, positions=config.positions)
        return study.fathom_rows(head_dim, cfg) + study.baseline_rows(head_dim)
    parsed = [methods_lib.parse(s) for s in config.methods]
    return [study.Row(m.label, m.name, m, "corpus" if m.needs_calibration else "none") for m in parsed]


# ----------------------------------------------------------------------------------------------
# Decoded rows of one layer, for every format


@functools.partial(jax.jit, static_argnums=0)
def _decoded(f: row_formats.RowFormat, keys, values, positions):
    """One format's rows of one layer as it gives them back: the window encoded at once ``[Hkv, T, D]``, and
    ``[P, Hkv, 64, D]`` the 64-token block holding each position ``p`` as the cache of tokens ``0..p`` holds it
    (the block encoded with its first ``p + 1 - start`` tokens)."""

    def one(p):
        start = p // OPEN * OPEN
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, start, OPEN, axis=-2)  # noqa: E731
        return f.decode(f.encode(cut(keys), cut(values), length=p + 1 - start, check=False))

    return f.decode(f.encode(keys, values, check=False)), jax.vmap(one)(positions)


def decoded_layer(formats: Sequence[row_formats.RowFormat | None], keys, values, positions):
    """Every format's rows of one layer, formats on the next-to-last axis (a row gather reads every format's copy
    of a token at once): window keys and values ``[Hkv, T, F, D]``, open blocks ``[P, Hkv, 64, F, D]``. ``None``
    is the captured rows as they are."""
    pos = jnp.asarray(positions)
    idx = (pos // OPEN * OPEN)[:, None] + jnp.arange(OPEN)  # [P, 64]
    parts = [((keys, values), tuple(jnp.moveaxis(x[:, idx], 1, 0) for x in (keys, values))) if f is None
             else _decoded(f, keys, values, pos) for f in formats]
    stack = lambda which, i: jnp.stack([part[which][i] for part in parts], axis=-2)  # noqa: E731
    return (stack(0, 0), stack(0, 1)), (stack(1, 0), stack(1, 1))


# ----------------------------------------------------------------------------------------------
# Selection and errors


def _errors_program(k_sel: tuple[int, ...]):
    """Errors ``[P, K, Hkv, G, F]`` of one (method, layer) for every format, from the method's scores: one
    selection (the study's ranking), attention over each format's rows."""
    k_max = max(k_sel)

    def run(q, refs, positions, scores, window, opened):
        n = window[0].shape[-3]
        lengths = jnp.broadcast_to((positions + 1)[:, None], scores.shape[:2])
        idx, mask = fid_run._select(scores[..., :n], lengths, k_max)  # noqa: SLF001  [P, Hkv, G, k]

        def position(a):
            q_p, idx_p, mask_p, ref_p, ok_p, p = a  # ok_p [Hkv, 64, F, D]
            start = p // OPEN * OPEN
            inside = (idx_p >= start)[..., None, None]
            take = lambda x, i: jax.vmap(lambda xh, ih: xh[ih])(x, i)  # noqa: E731  [Hkv, G, k, F, D]
            rows_k = jnp.where(inside, take(ok_p, jnp.clip(idx_p - start, 0, OPEN - 1)), take(window[0], idx_p))
            rows_v = take(window[1], idx_p)  # values are per token in every format: the open block's are the same
            ref_norm = jnp.maximum(jnp.linalg.norm(ref_p, axis=-1), 1e-30)[..., None]  # [Hkv, G, 1]
            scale = 1.0 / np.sqrt(q_p.shape[-1])
            logits = jnp.einsum("hgd,hgkfd->hgfk", q_p, rows_k) * scale
            errs = []
            for k in k_sel:
                m = mask_p[..., None, :k]
                w = jax.nn.softmax(jnp.where(m, logits[..., :k], -jnp.inf), axis=-1, where=m)
                out = jnp.einsum("hgfk,hgkfd->hgfd", jnp.where(m, w, 0.0), rows_v[:, :, :k])
                errs.append(jnp.linalg.norm(out - ref_p[:, :, None], axis=-1) / ref_norm)
            return jnp.stack(errs)

        return jax.lax.map(position, (q, idx, mask, refs, opened[0], positions))

    return run


class _Scorer:
    """Each method's scores of one layer at every position, from the study's own compiled programs (one per
    method whatever its budget; one window index per layer and index parts, shared)."""

    def __init__(self, capture: fid.Capture, positions: np.ndarray):
        n_layers = capture.q.shape[0]
        self.queries = jnp.stack([capture.layer_queries(layer, positions) for layer in range(n_layers)])
        self.keys, self.positions = jnp.asarray(capture.k), jnp.asarray(positions)
        self.indexes: dict[Any, Any] = {}

    def scores(self, fn: fid.MethodScore, calib, layer: int):
        parts = fn.method.parts
        rotated = any(p.needs_calibration for p in parts)  # rotated stores are built with the calibration
        key = (layer, parts, id(calib) if rotated else None)
        if key not in self.indexes:
            args = (self.keys, calib if rotated else None, np.int32(layer))
            build = fid_run.compile_program(("index", parts), fid_run._window_index(parts), args)  # noqa: SLF001
            self.indexes = {k: v for k, v in self.indexes.items() if k[0] == layer}  # free earlier layers'
            self.indexes[key] = build.result()(*args)
        program, data = fn.program()
        args = (self.queries, self.keys, self.positions, calib, np.int32(layer), self.indexes[key], data)
        key = (program, True, fid_run._signature(calib))  # noqa: SLF001
        run = fid_run.compile_program(key, fid_run._score_program(fn, True), args)  # noqa: SLF001
        return run.result()(*args)[0]


def run_row_study(eval_capture: fid.Capture, calib_capture: fid.Capture, config: RowStudyConfig = RowStudyConfig(),
                  *, progress: bool = True) -> dict[str, Any]:
    """Mean error of every (method, format, k) on ``eval_capture`` (calibrated on ``calib_capture``)."""
    n_layers, _, n_tokens, d = eval_capture.q.shape
    if n_tokens != config.context:
        raise ValueError(f"the capture holds {n_tokens} tokens, the config asks for context {config.context}")
    check_config(config, d)
    ks = config.selection_sizes()
    positions = fid.default_positions(n_tokens, config.positions)
    rows = study_rows(config, d)
    formats = [None] + [row_formats.parse(s) for s in config.formats]
    names = [F32] + [f.spec for f in formats[1:]]
    t0 = time.time()
    calibs = {"corpus": cal.calibrate(calib_capture.k, calib_capture.q),
              "session": cal.calibrate_session(eval_capture.k[:, :, : int(positions[0])]), "none": None}
    refs = fid.dense_references(eval_capture, positions).outputs
    scorer = _Scorer(eval_capture, positions)
    errors_fn = jax.jit(_errors_program(ks))
    sums = np.zeros((len(rows), len(formats), len(ks), n_layers))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n_layers * len(rows), desc=f"row formats @ {n_tokens}", unit="method-layer", smoothing=0.05)
    for layer in range(n_layers):
        window, opened = decoded_layer(formats, eval_capture.k[layer], eval_capture.v[layer], positions)
        for r, row in enumerate(rows):
            calib = calibs[row.calibration]
            scores = scorer.scores(fid.method_score_fn(row.method), calib, layer)
            err = np.asarray(errors_fn(scorer.queries[layer], refs[layer], scorer.positions, scores, window, opened))
            sums[r, :, :, layer] = err.mean(axis=(0, 2, 3), dtype=np.float64).T  # [P, K, Hkv, G, F] -> [F, K]
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    error = sums.mean(axis=-1)  # [R, F, K]: mean over layers of per-layer means (equal counts per layer)
    return {
        "context": n_tokens,
        "ks": list(ks),
        "positions": config.positions,
        "layers": n_layers,
        "head_dim": d,
        "wall_seconds": round(time.time() - t0, 1),
        "methods": [{"name": row.name, "family": row.family, "calibration": row.calibration} for row in rows],
        "formats": {name: format_entry(f, d) for name, f in zip(names, formats)},
        "error": {row.name: {name: {str(k): float(error[r, f, i]) for i, k in enumerate(ks)}
                             for f, name in enumerate(names)} for r, row in enumerate(rows)},
    }


def format_entry(f: row_formats.RowFormat | None, head_dim: int) -> dict[str, Any]:
    """Bytes per token per layer and KV head (index included) at the model's head_dim and at Dh = 128."""
    if f is None:
        return {"row_bytes": None, "bytes_per_token": None, "bytes_per_token_dh128": None}
    return {"row_bytes": f.row_bytes(head_dim), "block_scale_bytes": f.block_scale_bytes(head_dim),
            "bytes_per_token": f.bytes_per_token(head_dim), "bytes_per_token_dh128": f.bytes_per_token(128)}


def run_meta(meta: dict | None) -> dict[str, Any]:
    return {
        **(meta or {}),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()} ({platform.machine()}, {jax.devices()[0].platform})",
        "jax": jax.__version__,
    }
