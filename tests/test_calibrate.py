"""Calibration statistics: against plain numpy, orderings, session fallback, save/load, bad inputs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fathom_jax import calibrate as C
from fathom_jax.store import KeyRotation, rotate_keys


def _capture(seed=0, layers=2, hkv=2, g=3, n=160, nq=48, d=8):
    rng = np.random.default_rng(seed)
    scales = np.geomspace(3.0, 0.05, d)
    mix = np.linalg.qr(rng.standard_normal((d, d)))[0]
    keys = (rng.standard_normal((layers, hkv, n, d)) * scales) @ mix + rng.standard_normal(d)
    queries = rng.standard_normal((layers, hkv * g, nq, d)) * np.linspace(0.5, 2.0, d)
    return keys.astype(np.float32), queries.astype(np.float32)


def test_statistics_match_numpy():
    keys, queries = _capture()
    calib = C.calibrate(keys, queries)
    skip = C.SKIP_TOKENS
    for layer in range(keys.shape[0]):
        for h in range(keys.shape[1]):
            k = keys[layer, h].astype(np.float64)
            fit = k[skip:]
            np.testing.assert_allclose(calib.mean[layer, h], fit.mean(0), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(calib.variance[layer, h], fit.var(0), rtol=1e-4, atol=1e-5)
            cov = np.cov(fit.T, ddof=0)
            v = np.asarray(calib.basis[layer, h], np.float64)
            lam = np.asarray(calib.eigenvalues[layer, h], np.float64)
            # Columns are orthonormal eigenvectors with the stored eigenvalues.
            np.testing.assert_allclose(v.T @ v, np.eye(v.shape[0]), atol=1e-5)
            np.testing.assert_allclose(cov @ v, v * lam, atol=2e-4 * lam.max())
            # Ordered by decreasing score variance E[(q.v)^2] lambda over the group's queries.
            g = queries.shape[1] // keys.shape[1]
            qg = queries[layer, h * g:(h + 1) * g].reshape(-1, k.shape[1]).astype(np.float64)
            w = np.mean((qg @ v) ** 2, axis=0) * lam
            assert np.all(np.diff(w) <= 1e-6 * w.max())
            # Double Sparsity: mean|q| (group) x mean|k| (every token), best first.
            ds = np.abs(qg).mean(0) * np.abs(k).mean(0)
            np.testing.assert_array_equal(calib.ds_order[layer, h], np.argsort(-ds, kind="stable"))
    # Loki uses the score-variance-ordered basis by default.
    np.testing.assert_array_equal(calib.loki_basis, calib.basis)


def test_eigenvalue_order_without_queries_and_session():
    keys, _ = _capture(seed=1)
    calib = C.calibrate(keys)
    assert np.all(np.diff(np.asarray(calib.eigenvalues), axis=-1) <= 1e-6)
    ds = np.abs(keys).mean(-2)
    np.testing.assert_array_equal(calib.ds_order, np.argsort(-ds, axis=-1, kind="stable"))
    session = C.calibrate_session(keys)
    for name in ("variance", "mean", "eigenvalues", "basis", "loki_basis"):
        np.testing.assert_allclose(getattr(session, name), getattr(calib, name), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(session.ds_order, calib.ds_order)


def test_loki_eigenvalue_order_option():
    keys, queries = _capture(seed=2)
    calib = C.calibrate(keys, queries, loki_order="eigenvalue")
    plain = C.calibrate(keys)
    np.testing.assert_allclose(calib.loki_basis, plain.basis, atol=1e-6)
    with pytest.raises(ValueError, match="loki_order"):
        C.calibrate(keys, queries, loki_order="bogus")


def test_session_length_masks_padding_and_jits():
    keys, _ = _capture(seed=3, layers=1, hkv=2, n=128)
    length = np.array([[100, 128]])
    padded = keys.copy()
    padded[0, 0, 100:] = 1e3  # garbage past the valid prefix must not matter
    got = jax.jit(C.calibrate_session)(padded, length=length)
    ref = C.calibrate_session(keys[0, 0, :100])
    np.testing.assert_allclose(got.mean[0, 0], ref.mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.eigenvalues[0, 0], ref.eigenvalues, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got.ds_order[0, 0], ref.ds_order)


def test_key_rotation_decorrelates_keys():
    keys, queries = _capture(seed=4, layers=1, hkv=1)
    calib = C.calibrate(keys, queries)
    rot = C.key_rotation(calib)
    assert isinstance(rot, KeyRotation)
    rotated = np.asarray(rotate_keys(jnp.asarray(keys[..., C.SKIP_TOKENS:, :]), rot))[0, 0].astype(np.float64)
    cov = np.cov(rotated.T, ddof=0)
    np.testing.assert_allclose(np.diag(cov), calib.eigenvalues[0, 0], rtol=1e-3, atol=1e-5)
    off = cov - np.diag(np.diag(cov))
    assert np.abs(off).max() < 1e-3 * cov.max()
    np.testing.assert_allclose(rotated.mean(0), 0.0, atol=1e-5)


def test_indexing():
    keys, queries = _capture(seed=5)
    calib = C.calibrate(keys, queries)
    one = calib[1, 0]
    assert one.batch_shape == () and one.head_dim == keys.shape[-1]
    np.testing.assert_array_equal(one.basis, calib.basis[1, 0])


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_save_load_round_trip_bit_for_bit(tmp_path_factory, seed):
    keys, queries = _capture(seed=seed, layers=1, hkv=2, n=64, nq=8, d=4)
    calib = C.calibrate(keys, queries)
    path = tmp_path_factory.mktemp("calib") / "ckpt"
    C.save_calibration(path, calib)
    back = C.load_calibration(path)
    for name in ("variance", "mean", "basis", "eigenvalues", "ds_order", "loki_basis"):
        a, b = np.asarray(getattr(calib, name)), np.asarray(getattr(back, name))
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.tobytes() == b.tobytes(), name


def test_tuned_calibration_round_trip_and_shapes(tmp_path):
    from fathom_jax import allocation as A

    keys, queries = _capture(seed=8, layers=2, hkv=2, n=80, nq=8, d=4)
    calib = C.calibrate(keys, queries)
    tuned = C.tuned(calib, plane_error=A.plane_errors(keys), budget=np.full((2, 2), 9.5, np.float32))
    assert isinstance(tuned[1], C.TunedCalibration) and tuned[1].budget.shape == (2,)
    C.save_calibration(tmp_path / "t", tuned)
    back = C.load_calibration(tmp_path / "t")
    assert isinstance(back, C.TunedCalibration)
    for name in ("variance", "ds_order", "plane_error", "budget"):
        assert np.asarray(getattr(back, name)).tobytes() == np.asarray(getattr(tuned, name)).tobytes(), name
    assert type(C.load_calibration(_saved(tmp_path / "plain", calib))) is C.Calibration
    with pytest.raises(ValueError, match=r"budget must have shape \(2, 2\)"):
        C.tuned(calib, budget=np.zeros(2))
    with pytest.raises(ValueError, match="plane_error must have shape"):
        C.tuned(calib, plane_error=np.zeros((2, 2, 4, 4)))


def _saved(path, calib):
    C.save_calibration(path, calib)
    return path


def test_save_refuses_overwrite_without_force(tmp_path):
    keys, _ = _capture(seed=6, layers=1, hkv=1, n=64, d=4)
    calib = C.calibrate(keys)
    C.save_calibration(tmp_path / "c", calib)
    with pytest.raises(Exception):
        C.save_calibration(tmp_path / "c", calib)
    C.save_calibration(tmp_path / "c", calib, force=True)
    with pytest.raises(FileNotFoundError, match="load_calibration"):
        C.load_calibration(tmp_path / "missing")


def test_truncated_checkpoint_names_itself(tmp_path):
    """A truncated checkpoint surfaced as a bare JSONDecodeError from inside orbax."""
    keys, _ = _capture(seed=7, layers=1, hkv=1, n=64, d=4)
    C.save_calibration(tmp_path / "c", C.calibrate(keys))
    meta = tmp_path / "c" / "_METADATA"
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"cannot read the checkpoint at {tmp_path / 'c'} .*save_calibration"):
        C.load_calibration(tmp_path / "c")


def test_bad_inputs():
    keys, queries = _capture(seed=7, layers=1, hkv=2, n=64, nq=8, d=4)
    bad = keys.copy()
    bad[0, 1, 5, 2] = np.nan
    with pytest.raises(ValueError, match="keys contains 1 NaN"):
        C.calibrate(bad, queries)
    with pytest.raises(ValueError, match="keys contains"):
        C.calibrate_session(bad)
    qbad = queries.copy()
    qbad[0, 0, 0, 0] = np.inf
    with pytest.raises(ValueError, match="queries contains"):
        C.calibrate(keys, qbad)
    with pytest.raises(ValueError, match="queries head_dim 3 does not match keys head_dim 4"):
        C.calibrate(keys, queries[..., :3])
    with pytest.raises(ValueError, match="not a multiple"):
        C.calibrate(keys, queries[:, :3])
    with pytest.raises(ValueError, match="same rank"):
        C.calibrate(keys, queries[0])
    with pytest.raises(TypeError, match="keys must be floating"):
        C.calibrate(keys.astype(np.int32))
    with pytest.raises(ValueError, match="calibration tokens"):
        C.calibrate(keys[..., :10, :])
    with pytest.raises(ValueError, match="length"):
        C.calibrate_session(keys, length=0)
    with pytest.raises(ValueError, match="basis must have shape"):
        C.from_arrays(variance=np.ones(4), mean=np.zeros(4), basis=np.eye(3), eigenvalues=np.ones(4),
                      ds_order=np.arange(4), loki_basis=np.eye(4))


def test_nan_keys_raise_eagerly_and_under_jit_with_one_message():
    """Issue 30: ``jax.jit(calibrate_session)`` on keys with a NaN returned NaN variances without a word. Statistics
    are computed once per session, off the decode hot path: a run-time check, which the library's entry points
    (and checks.reraise) report as the CheckError it is, and checks.checked as well."""
    from fathom_jax import checks

    keys = np.ones((2, 40, 4), np.float32)
    keys[1, 5, 2] = np.nan
    message = re.escape("keys contains 1 NaN or inf value(s); calibration needs finite values")
    with pytest.raises(checks.CheckError, match=message):
        C.calibrate_session(keys)
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        jax.block_until_ready(jax.jit(C.calibrate_session)(keys))
    with pytest.raises(checks.CheckError, match=f"^{message}$"), checks.reraise():
        jax.block_until_ready(jax.jit(C.calibrate_session)(keys))
    with pytest.raises(checks.CheckError, match=f"^{message}$"):
        checks.checked(jax.jit(C.calibrate_session))(keys)
    with pytest.raises(checks.CheckError, match=r"length must lie in \[1, 40\]"):
        checks.checked(jax.jit(C.calibrate_session))(np.ones((2, 40, 4), np.float32), length=jnp.array([40, 41]))
    with pytest.raises(TypeError, match="length must be integer token counts"):
        C.calibrate_session(np.ones((2, 40, 4), np.float32), length=np.array([4.0, 5.0]))
