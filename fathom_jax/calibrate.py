"""Calibration statistics per (layer, KV head): what Fathom, Fathom KLT, Double Sparsity and Loki need.

A :class:`Calibration` holds, for every leading index (typically ``[L, Hkv]``):

* ``variance [.., D]`` and ``mean [.., D]`` of the keys in the raw (post-RoPE) basis - Eq. 3's ``Var(k_j)``;
* ``basis [.., D, D]`` (columns = eigenvectors of the key covariance) and ``eigenvalues [.., D]`` in the
  same order - the KLT of section 3.5. With calibration queries the columns are ordered by decreasing
  *score variance* ``w_j = E[(q . v_j)^2] lambda_j`` (the paper's "score-variance-ordered eigenbasis");
  without queries (:func:`calibrate_session`) by decreasing eigenvalue ``lambda_j``. The water-filling
  plan itself does not depend on the column order (it reads every coordinate's own importance), so the
  order matters only for truncating methods (Loki) and for readability of plans;
* ``ds_order [.., D]`` - Double Sparsity's offline channel order, channels sorted by
  ``mean|q_j| x mean|k_j|`` over the calibration tokens (mean|q| pooled over the G query heads of the KV
  head). Without queries it falls back to ``mean|k_j|`` alone (documented fallback, not in the paper);
* ``loki_basis [.., D, D]`` - Loki's PCA basis of the (centred) keys, ordered "by calibration score
  variance rather than by eigenvalue, which favours Loki" (paper section 4); Loki scores the first r
  columns. By default it equals ``basis`` (as in the authors' prototype); ``loki_order="eigenvalue"``
  gives Loki's own eigenvalue order.

Where our choices follow the authors' prototype (``vivekkalyanarangan30/fathom``, ``scripts/sketch.py``
and ``scripts/l4_final_alloc.py``; read, not copied):

* statistics are taken on the raw post-RoPE keys (not on dequantized keys), and the mean, variance and
  covariance skip the first ``skip_tokens = 16`` tokens (four times the 4 attention-sink tokens), whose
  keys are outliers; the Double Sparsity statistic uses every token, as theirs does;
* the covariance is ``(K - mu)^T (K - mu) / n``; ``variance`` is its diagonal (ddof = 0; the authors use
  ddof = 1 for the raw variance, a common factor that leaves every plan unchanged);
* the score variance of direction j pools every calibration query of the G heads of the KV head
  (query head ``h`` belongs to KV head ``h // G``, the usual GQA grouping);
* session calibration (paper B5) uses the session's own prefill keys: mean, eigenbasis and eigenvalues
  (clamped at 0) per KV head, no queries.

We additionally fix the sign of every eigenvector (its largest-magnitude component is positive) so
that bases are reproducible across backends; a sign flip changes no score.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from fathom_jax.checks import CheckError, fail_if, is_traced
from fathom_jax.store import KeyRotation

SKIP_TOKENS = 16  # leading tokens left out of mean / variance / covariance (4 sinks x 4, as the authors)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Calibration:
    """Per-(layer, KV head) key statistics; every field has the same leading axes ``[..]``."""

    variance: Float[Array, "*B D"]  # Var(k_j), raw basis
    mean: Float[Array, "*B D"]  # E[k], raw basis
    basis: Float[Array, "*B D D"]  # KLT eigenvectors as columns, score-variance (or eigenvalue) order
    eigenvalues: Float[Array, "*B D"]  # lambda_j in the column order of ``basis``
    ds_order: Int[Array, "*B D"]  # Double Sparsity channel order (best first)
    loki_basis: Float[Array, "*B D D"]  # Loki's PCA basis, columns in Loki's order

    @property
    def head_dim(self) -> int:
        return self.variance.shape[-1]

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self.variance.shape[:-1]

    def __getitem__(self, index) -> "Calibration":
        """Index the leading axes (e.g. ``calib[layer]`` or ``calib[layer, kv_head]``)."""
        return jax.tree.map(lambda x: x[index], self)

    @staticmethod
    def from_arrays(**arrays: Any) -> "Calibration":
        """:func:`from_arrays`: a calibration from arrays set by hand, its shapes checked."""
        return from_arrays(**arrays)


_FIELDS = tuple(f.name for f in dataclasses.fields(Calibration))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TunedCalibration(Calibration):
    """A :class:`Calibration` with what the allocations of :mod:`fathom_jax.allocation` read besides it.

    * ``plane_error [.., D, 5]``: the variance of ``k_j - k_hat_j(t)`` the store's quantizer leaves at
      depths t = 0..4 on the calibration keys (:func:`fathom_jax.allocation.plane_errors`), the error model
      of ``fathom_bits:B:observed``;
    * ``budget [..]``: bits per token as read (code + scale) of every (layer, KV head), tuned on a
      calibration capture (:mod:`fathom_jax.eval.tuning`), the budgets of ``fathom_tuned``.

    Either may be None (not computed). Saved and loaded with the rest by :func:`save_calibration`.
    """

    plane_error: Float[Array, "*B D 5"] | None = None
    budget: Float[Array, "*B"] | None = None


_TUNED_FIELDS = ("plane_error", "budget")


def tuned(calib: Calibration, *, plane_error=None, budget=None) -> TunedCalibration:
    """``calib`` with plane errors and/or per-group budgets (kept from ``calib`` where not given)."""
    fields = {name: getattr(calib, name) for name in _FIELDS}
    for name, value in (("plane_error", plane_error), ("budget", budget)):
        value = getattr(calib, name, None) if value is None else jnp.asarray(value, jnp.float32)
        fields[name] = value
    batch, d = calib.batch_shape, calib.head_dim
    if fields["plane_error"] is not None and fields["plane_error"].shape != (*batch, d, 5):
        raise ValueError(f"plane_error must have shape {(*batch, d, 5)}, got {fields['plane_error'].shape}")
    if fields["budget"] is not None and fields["budget"].shape != batch:
        raise ValueError(f"budget must have shape {batch} (one per group), got {fields['budget'].shape}")
    return TunedCalibration(**fields)


# ----------------------------------------------------------------------------------------------
# Checks


def _check_floating(name: str, x, min_ndim: int, what: str) -> jax.Array:
    """Floating point, at least ``min_ndim`` axes (trace time), and finite: a CheckError eagerly, and under jit at
    run time (statistics are computed once per session, off the decode hot path: :mod:`fathom_jax.checks`)."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
    if x.ndim < min_ndim:
        raise CheckError(f"{name} must be {what}, got shape {x.shape}")
    if x.size:
        nonfinite = jnp.sum(~jnp.isfinite(x)) if is_traced(x) else np.size(x) - np.count_nonzero(np.isfinite(x))
        fail_if(nonfinite > 0, lambda bad: f"{name} contains {int(bad)} NaN or inf value(s); calibration needs "
                                           "finite values", nonfinite)
    return x


# ----------------------------------------------------------------------------------------------
# Core statistics


def _fit_weights(n: int, length, skip: int) -> tuple[jax.Array, jax.Array]:
    """Token weights (1 for tokens used in the fit) and the all-valid-token mask, ``[*B, n]``."""
    pos = jnp.arange(n)
    valid = pos < jnp.asarray(length)[..., None]
    fit = valid & (pos >= skip)
    return fit.astype(jnp.float32), valid


def _fix_signs(vectors: jax.Array) -> jax.Array:
    """Make the largest-magnitude component of every column positive."""
    idx = jnp.argmax(jnp.abs(vectors), axis=-2)  # [*B, D]
    pivot = jnp.take_along_axis(vectors, idx[..., None, :], axis=-2)[..., 0, :]
    return vectors * jnp.where(pivot < 0, -1.0, 1.0)[..., None, :]


def _klt(keys: jax.Array, weights: jax.Array):
    """Mean, covariance eigenbasis (descending eigenvalue) and eigenvalues of weighted keys."""
    count = jnp.maximum(jnp.sum(weights, axis=-1), 1.0)  # [*B]
    mean = jnp.einsum("...n,...nd->...d", weights, keys) / count[..., None]
    centred = (keys - mean[..., None, :]) * weights[..., None]
    cov = jnp.einsum("...nd,...ne->...de", centred, centred) / count[..., None, None]
    cov = 0.5 * (cov + jnp.swapaxes(cov, -1, -2))
    lam, vec = jnp.linalg.eigh(cov)  # ascending
    lam, vec = lam[..., ::-1], vec[..., ::-1]
    lam = jnp.maximum(lam, 0.0)
    vec = _fix_signs(vec)
    variance = jnp.diagonal(cov, axis1=-2, axis2=-1)
    return mean, variance, vec, lam


def _reorder(vec: jax.Array, lam: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    order = jnp.argsort(-key, axis=-1, stable=True)
    return jnp.take_along_axis(vec, order[..., None, :], axis=-1), jnp.take_along_axis(lam, order, axis=-1)


def calibrate(
    keys: Float[Array, "*L Hkv n D"],
    queries: Float[Array, "*L H nq D"] | None = None,
    *,
    skip_tokens: int = SKIP_TOKENS,
    loki_order: str = "score_variance",
) -> Calibration:
    """Calibration from a corpus capture: post-RoPE ``keys [.., Hkv, n, D]`` and ``queries [.., H, nq, D]``.

    Query head ``h`` belongs to KV head ``h // (H // Hkv)``. Without queries the KLT is ordered by
    eigenvalue and Double Sparsity falls back to ``mean|k|`` (as :func:`calibrate_session`).
    ``loki_order`` is ``"score_variance"`` (the paper's choice, default) or ``"eigenvalue"``.
    """
    if loki_order not in ("score_variance", "eigenvalue"):
        raise ValueError(f"loki_order must be 'score_variance' or 'eigenvalue', got {loki_order!r}")
    keys = _check_floating("keys", keys, 2, "[..., Hkv, n, D]")
    if skip_tokens < 0:
        raise ValueError(f"skip_tokens must be >= 0, got {skip_tokens}")
    *batch, n, d = keys.shape
    if n - skip_tokens < 2:
        raise ValueError(
            f"keys: need at least skip_tokens + 2 = {skip_tokens + 2} calibration tokens, got n = {n}"
        )
    keys = keys.astype(jnp.float32)
    weights, _ = _fit_weights(n, jnp.full(batch, n), skip_tokens)
    mean, variance, vec, lam = _klt(keys, weights)
    mean_abs_k = jnp.mean(jnp.abs(keys), axis=-2)  # every token, as the authors

    if queries is None:
        ds_score = mean_abs_k
        basis, eigenvalues = vec, lam
    else:
        queries = _check_floating("queries", queries, 3, "[..., H, nq, D]")
        if keys.ndim < 3:
            raise ValueError(f"keys must be [..., Hkv, n, D] when queries are given, got shape {keys.shape}")
        if queries.ndim != keys.ndim:
            raise ValueError(
                f"queries must have the same rank as keys ([..., H, nq, D] vs [..., Hkv, n, D]), "
                f"got queries {queries.shape} and keys {keys.shape}"
            )
        if queries.shape[-1] != d:
            raise ValueError(f"queries head_dim {queries.shape[-1]} does not match keys head_dim {d}")
        if queries.shape[:-3] != keys.shape[:-3]:
            raise ValueError(f"queries leading axes {queries.shape[:-3]} do not match keys' {keys.shape[:-3]}")
        hq, hkv = queries.shape[-3], keys.shape[-3]
        if hq % hkv:
            raise ValueError(f"queries: {hq} query heads are not a multiple of the {hkv} KV heads")
        g = hq // hkv
        q = queries.astype(jnp.float32).reshape(*queries.shape[:-3], hkv, g * queries.shape[-2], d)
        mean_abs_q = jnp.mean(jnp.abs(q), axis=-2)
        ds_score = mean_abs_q * mean_abs_k
        proj = jnp.einsum("...nd,...de->...ne", q, vec)
        score_var = jnp.mean(proj * proj, axis=-2) * lam
        basis, eigenvalues = _reorder(vec, lam, score_var)

    loki_basis = basis if loki_order == "score_variance" else vec
    return Calibration(
        variance=variance,
        mean=mean,
        basis=basis,
        eigenvalues=eigenvalues,
        ds_order=jnp.argsort(-ds_score, axis=-1, stable=True).astype(jnp.int32),
        loki_basis=loki_basis,
    )


def calibrate_session(
    keys: Float[Array, "*B n D"],
    *,
    length: Int[Array, "*B"] | int | None = None,
    skip_tokens: int = SKIP_TOKENS,
) -> Calibration:
    """Calibration from a session's own prefill keys (paper B5): no offline data, no queries.

    The KLT is ordered by eigenvalue (there are no queries to measure score variance) and Loki uses the
    same basis; Double Sparsity falls back to ordering channels by ``mean|k_j|``. ``length`` marks the
    valid prefix of each sequence (traced lengths are fine: this function is jit-friendly; outside [1, n] they
    raise eagerly, and traced in checkify mode). If a sequence holds fewer than ``skip_tokens + 2`` valid
    tokens, its statistics use all of them. NaN or inf keys raise a CheckError, under ``jit`` at run time.
    """
    keys = _check_floating("keys", keys, 2, "[..., n, D]")
    if skip_tokens < 0:
        raise ValueError(f"skip_tokens must be >= 0, got {skip_tokens}")
    *batch, n, _ = keys.shape
    if length is None:
        length = jnp.full(batch, n, jnp.int32)
    else:
        got = length if is_traced(length) else np.asarray(length)
        if not jnp.issubdtype(got.dtype, jnp.integer):
            raise TypeError(f"length must be integer token counts [*B] = {list(batch)}, got dtype {got.dtype}")
        # Traced lengths are a prefill's (checked where they enter): checked here in checkify mode only.
        fail_if((got < 1) | (got > n), lambda bad: f"length must lie in [1, {n}], got {bad}", got, hot=True)
        length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), batch)
    return _session_statistics(keys, length, skip_tokens=skip_tokens)


@functools.partial(jax.jit, static_argnames="skip_tokens")
def _session_statistics(keys, length, *, skip_tokens: int) -> Calibration:
    # One program per shape: op by op, a first call at a new shape compiled each of its ~30 ops on its own.
    n = keys.shape[-2]
    keys = keys.astype(jnp.float32)
    skip = jnp.where(length - skip_tokens >= 2, skip_tokens, 0)
    pos = jnp.arange(n)
    valid = pos < length[..., None]
    weights = (valid & (pos >= skip[..., None])).astype(jnp.float32)
    mean, variance, vec, lam = _klt(keys, weights)
    vcount = jnp.maximum(jnp.sum(valid, axis=-1), 1)[..., None]
    mean_abs_k = jnp.sum(jnp.where(valid[..., None], jnp.abs(keys), 0.0), axis=-2) / vcount
    return Calibration(
        variance=variance,
        mean=mean,
        basis=vec,
        eigenvalues=lam,
        ds_order=jnp.argsort(-mean_abs_k, axis=-1, stable=True).astype(jnp.int32),
        loki_basis=vec,
    )


def key_rotation(calib: Calibration) -> KeyRotation:
    """The KLT store's rotation ``k -> (k - mean) @ basis``."""
    return KeyRotation(mean=calib.mean, basis=calib.basis)


def loki_rotation(calib: Calibration) -> KeyRotation:
    """Loki's rotation ``k -> (k - mean) @ loki_basis`` (Loki scores the first r coordinates)."""
    return KeyRotation(mean=calib.mean, basis=calib.loki_basis)


def from_arrays(**arrays: Any) -> Calibration:
    """Build a Calibration from arrays (e.g. statistics set by hand), checking shapes."""
    missing = [f for f in _FIELDS if f not in arrays]
    extra = [k for k in arrays if k not in _FIELDS]
    if missing or extra:
        raise ValueError(f"Calibration fields: missing {missing}, unexpected {extra}")
    vals = {k: jnp.asarray(v) for k, v in arrays.items()}
    d = vals["variance"].shape[-1]
    batch = vals["variance"].shape[:-1]
    for name in ("mean", "eigenvalues", "ds_order"):
        if vals[name].shape != (*batch, d):
            raise ValueError(f"{name} must have shape {(*batch, d)}, got {vals[name].shape}")
    for name in ("basis", "loki_basis"):
        if vals[name].shape != (*batch, d, d):
            raise ValueError(f"{name} must have shape {(*batch, d, d)}, got {vals[name].shape}")
    vals = {k: (v.astype(jnp.int32) if k == "ds_order" else v.astype(jnp.float32)) for k, v in vals.items()}
    return Calibration(**vals)


# ----------------------------------------------------------------------------------------------
# Save / load (orbax-checkpoint)


def save_calibration(path: str | os.PathLike, calib: Calibration, *, force: bool = False) -> None:
    """Write ``calib`` (a :class:`TunedCalibration` with the fields it has) as an orbax checkpoint directory at
    ``path`` (``force`` overwrites)."""
    import orbax.checkpoint as ocp

    names = _FIELDS + tuple(n for n in _TUNED_FIELDS if getattr(calib, n, None) is not None)
    state = {name: np.asarray(getattr(calib, name)) for name in names}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(os.fspath(path)), state, force=force)
        ckpt.wait_until_finished()


def load_calibration(path: str | os.PathLike) -> Calibration:
    """Read a Calibration written by :func:`save_calibration` (bit for bit; a :class:`TunedCalibration` where
    it was saved with plane errors or budgets)."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_calibration: no checkpoint directory at {path}")
    try:
        with ocp.StandardCheckpointer() as ckpt:
            state = ckpt.restore(path)
    except Exception as err:  # orbax surfaces damage as JSON, tensorstore or OS errors from deep inside
        raise ValueError(
            f"load_calibration: cannot read the checkpoint at {path} ({type(err).__name__}: {err}); it is "
            "truncated or damaged: write it again with save_calibration"
        ) from err
    missing = [f for f in _FIELDS if f not in state]
    if missing:
        raise ValueError(f"load_calibration: checkpoint at {path} lacks fields {missing}")
    calib = Calibration(**{name: jnp.asarray(state[name]) for name in _FIELDS})
    extra = {name: state[name] for name in _TUNED_FIELDS if name in state}
    return tuned(calib, **extra) if extra else calib
