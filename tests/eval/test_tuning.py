"""Budgets tuned with optax: the mean is held, the optimum of the interpolated error is found, bad targets named."""

import numpy as np
import pytest

from fathom_jax.eval import tuning as T

GRID = (8.0, 16.0, 32.0, 64.0, 128.0)


def convex_tables(seed=0, layers=6, heads=3):
    """Errors ``floor + a exp(-b x)`` per group: convex in the budget, with slopes that differ 30x between groups."""
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.05, 1.0, (layers, heads, 1))
    b = rng.uniform(0.01, 0.3, (layers, heads, 1))
    grid = np.asarray(GRID)
    errors = 0.05 + a * np.exp(-b * grid)
    return T.Tables(GRID, errors.astype(np.float32), np.broadcast_to(grid - 0.5, errors.shape).copy(), 128)


def greedy_optimum(tables, target):
    """The optimum over quarter-bit budgets of a separable convex piecewise-linear objective: from the floor, each
    quarter to the group whose interpolated error falls most (exact for convex pieces)."""
    grid = np.asarray(tables.grid)
    budgets = np.full(tables.errors.shape[:2], grid[0])
    interp = np.vectorize(lambda x, l, h: np.interp(x, grid, tables.errors[l, h]))
    ls, hs = np.indices(budgets.shape)
    for _ in range(int(round((target - grid[0]) * budgets.size / 0.25))):
        drop = interp(budgets, ls, hs) - interp(budgets + 0.25, ls, hs)
        budgets[np.unravel_index(np.argmax(drop), budgets.shape)] += 0.25
    return interp(budgets, ls, hs).sum()


def test_optimize_holds_the_mean_and_finds_the_optimum():
    tables = convex_tables()
    budgets, info = T.optimize_budgets(tables, 40.0, steps=600)
    assert budgets.mean() <= 40.0 and budgets.mean() > 40.0 - 0.25 / budgets.size - 1e-9
    assert np.all(budgets >= GRID[0]) and np.all(budgets * 4 == np.round(budgets * 4))
    got = float(np.asarray(T.surrogate(budgets, tables.grid, tables.errors)).sum())
    uniform = float(np.asarray(T.surrogate(np.full(budgets.shape, 40.0), tables.grid, tables.errors)).sum())
    best = greedy_optimum(tables, 40.0)
    assert got <= best * 1.005 and got < uniform * 0.97
    assert info["objective_end"] < info["objective_start"] == pytest.approx(1.0)


def test_surrogate_interpolates_and_check_correlates():
    tables = convex_tables(1)
    at_grid = np.asarray(T.surrogate(np.full((6, 3), 32.0), tables.grid, tables.errors))
    np.testing.assert_allclose(at_grid, tables.errors[..., 2], rtol=1e-6)
    mid = np.asarray(T.surrogate(np.full((6, 3), 48.0), tables.grid, tables.errors))
    np.testing.assert_allclose(mid, (tables.errors[..., 2] + tables.errors[..., 3]) / 2, rtol=1e-5)
    budgets = np.full((6, 3), 48.0)
    predicted = np.asarray(T.surrogate(budgets, tables.grid, tables.errors))
    uniform = np.asarray(T.surrogate(np.full((6, 3), 40.0), tables.grid, tables.errors))
    check = T.surrogate_check(tables, budgets, 40.0, predicted * 1.1, uniform * 1.1)
    assert check["pearson"] == pytest.approx(1.0) and check["pearson_change"] == pytest.approx(1.0)
    assert check["measured_change"] == pytest.approx(1.1 * check["predicted_change"], rel=1e-5)


def test_bad_targets_are_named():
    tables = convex_tables()
    for target in (8.0, 200.0):
        with pytest.raises(ValueError, match="target must lie in"):
            T.optimize_budgets(tables, target)


@pytest.fixture
def tiny_model(monkeypatch):
    """A random two-layer model at SmolLM2's head_dim with a one-token-per-character tokenizer, served by the hub
    for whatever --model names."""
    from flax import nnx

    from fathom_jax.models import hub
    from fathom_jax.models.config import LlamaConfig
    from fathom_jax.models.llama import LlamaForCausalLM

    class Chars:
        def encode(self, text):
            return [ord(c) % 97 for c in text]

    config = LlamaConfig(vocab=97, hidden=64, intermediate=96, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=64,
                         rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    monkeypatch.setattr(hub, "model_config", lambda source=None: config)
    monkeypatch.setattr(hub, "load_tokenizer", lambda source=None: Chars())
    monkeypatch.setattr(hub, "load_model", lambda source=None, **kw: (model, Chars(), config))
    return model


def test_tune_command_saves_tuned_calibrations(capsys, tmp_path, tiny_model):
    from fathom_jax import calibrate as C
    from fathom_jax import cli

    code = cli.main(["tune", "--context", "512", "--mean", "20", "--positions", "8", "--k", "48",
                     "--out", str(tmp_path), "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0, err
    calib = C.load_calibration(tmp_path / "tuned_smollm2_512_mean20")
    assert isinstance(calib, C.TunedCalibration) and calib.budget.shape == (2, 1) and calib.plane_error.shape == (2, 1, 64, 5)
    assert float(np.mean(calib.budget)) <= 20 and "mean 20: budgets" in out
    assert cli.main(["tune", "--mean", "500", "--out", str(tmp_path)]) == 2
    assert "argument --mean: [500] outside (8, 120]" in capsys.readouterr().err


def test_tune_command_takes_a_model_and_names_its_checkpoints_after_it(capsys, tmp_path, tiny_model):
    """``fathom tune --model`` (the README: every command takes one): the hub's model, checkpoints named after it."""
    from fathom_jax import calibrate as cal
    from fathom_jax import cli

    argv = ["tune", "--model", str(tmp_path / "Tiny-Model"), "--context", "512", "--positions", "8", "--k", "48",
            "--mean", "37", "--out", str(tmp_path / "out"), "--quiet"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    calib = cal.load_calibration(tmp_path / "out" / "tuned_tiny_model_512_mean37")
    assert calib.budget.shape == (2, 1) and float(np.mean(calib.budget)) <= 37
