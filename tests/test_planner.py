import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from fathom_jax import planner as P


_BISECTION = jax.jit(P.plan_bisection)
_EXACT = jax.jit(P.plan_exact)


@pytest.fixture
def appendix_importance(appendix):
    return P.importance(appendix.q, appendix.var)


def test_appendix_importance(appendix_importance):
    np.testing.assert_allclose(np.asarray(appendix_importance), [12.22, 3.775, 0.635, 0.00005], rtol=1e-5)


def test_appendix_bisection_trace_b8(appendix_importance):
    plan, trials, sums = P.bisection_trace(appendix_importance, 8, bracket=(0.001, 10.0))
    # The table of Appendix A: trial theta and the bit sum of its depths, step by step.
    np.testing.assert_allclose(np.asarray(trials[:8]), [0.1, 0.01, 0.0316, 0.0562, 0.075, 0.0866, 0.0806, 0.0777],
                               rtol=2e-3)
    np.testing.assert_array_equal(np.asarray(sums[:8]), [7, 11, 9, 9, 9, 8, 8, 9])
    np.testing.assert_array_equal(np.asarray(plan.depths), [4, 3, 1, 0])
    assert abs(float(plan.theta) - 0.079) < 5e-4
    # The water line sits where channel 2's second plane would overflow: 0.63 / 4^1.5 < theta.
    assert 0.635 / 4**1.5 < float(plan.theta) <= 0.635 / 4**0.5
    assert int(plan.code_bits) == 8 and float(plan.bits_per_token) == 8 + 3 * 0.25


def test_appendix_bisection_b6(appendix_importance):
    plan = P.plan_bisection(appendix_importance, 6, bracket=(0.001, 10.0))
    np.testing.assert_array_equal(np.asarray(plan.depths), [3, 2, 1, 0])
    assert abs(float(plan.theta) - 0.118) < 5e-4
    # The paper prints (3.35, 2.50, 1.21, -5.3); its -5.3 for the negligible channel 3 is rounded loosely.
    log4 = np.log(np.asarray(appendix_importance) / float(plan.theta)) / np.log(4)
    np.testing.assert_allclose(log4[:3], [3.35, 2.50, 1.21], atol=0.006)
    assert log4[3] < -5


@pytest.mark.parametrize("method", ["bisection", "exact"])
@pytest.mark.parametrize("budget,depths", [(8, [4, 3, 1, 0]), (6, [3, 2, 1, 0]), (0, [0, 0, 0, 0]), (16, [4, 4, 4, 4])])
def test_default_bracket_and_exact_agree_on_appendix(method, budget, depths, appendix_importance):
    plan = P.plan(appendix_importance, budget, method=method)
    np.testing.assert_array_equal(np.asarray(plan.depths), depths)


@settings(max_examples=30, deadline=None)
# A few channel counts (each compiles its own plan), every value drawn fresh.
@given(g=hnp.arrays(np.float32, st.sampled_from([1, 2, 3, 7, 16, 33, 48]),
                   elements=st.one_of(st.just(0.0), st.floats(2.0**-20, 1e4, width=32))),
       frac=st.floats(0, 1))
def test_bisection_fits_budget_and_matches_exact(g, frac):
    budget = int(round(frac * 4 * g.size))
    bis = _BISECTION(g, jnp.int32(budget))  # jitted with a traced budget: one compilation per channel count
    ex = _EXACT(g, jnp.int32(budget))
    assert int(bis.code_bits) <= budget and int(ex.code_bits) <= budget
    d_b, d_e = np.asarray(bis.depths), np.asarray(ex.depths)
    assert np.all((d_b >= 0) & (d_b <= 4)) and np.all(d_b[g == 0] == 0)
    # The exact allocation is optimal for sum g 4^-t; bisection matches it unless marginal gains tie.
    cost = lambda d: float(np.sum(g.astype(np.float64) * 4.0 ** -d))
    assert cost(d_e) <= cost(d_b) * (1 + 1e-5) + 1e-12
    # The exact allocation spends the whole budget (up to channels with g > 0 at full depth).
    assert int(ex.code_bits) == min(budget, 4 * int(np.sum(g > 0)))


def test_exact_beats_bisection_only_on_ties():
    """Three equal importances: the bit sum jumps 6 -> 9 at one water line, so bisection stops at 6."""
    g = np.array([0.0, 1.0, 1.0, 1.0], np.float32)
    assert int(P.plan_bisection(g, 8).code_bits) == 6
    assert int(P.plan_exact(g, 8).code_bits) == 8
    g_untied = np.array([0.0, 1.0, 1.1, 1.2], np.float32)
    np.testing.assert_array_equal(np.asarray(P.plan_bisection(g_untied, 8).depths),
                                  np.asarray(P.plan_exact(g_untied, 8).depths))


def test_vmapped_over_layers_heads_batch_and_traced_budgets(rng):
    q = rng.standard_normal((3, 2, 4, 5, 16)).astype(np.float32)  # layers, batch, kv heads, G, D
    var = np.exp(rng.normal(size=(3, 1, 4, 16))).astype(np.float32)
    budgets = jnp.array([8, 24, 40])[:, None, None]  # per-layer budgets
    fn = jax.jit(lambda q, v, b: P.plan_bisection(P.importance(q, v), b))
    plan = fn(q, var, budgets)
    assert plan.depths.shape == (3, 2, 4, 16)
    np.testing.assert_array_equal(np.asarray(plan.code_bits).max(axis=(1, 2)) <= [8, 24, 40], True)
    one = P.plan_bisection(P.importance(q[1, 1, 2], var[1, 0, 2]), 24)
    np.testing.assert_array_equal(np.asarray(plan.depths[1, 1, 2]), np.asarray(one.depths))


def test_klt_importance_is_raw_importance_of_rotated_queries(rng):
    q = rng.standard_normal((4, 8)).astype(np.float32)
    basis = np.linalg.qr(rng.standard_normal((8, 8)))[0].astype(np.float32)
    lam = np.sort(np.exp(rng.normal(size=8)))[::-1].astype(np.float32)
    want = np.sum((q @ basis) ** 2, axis=0) * lam
    np.testing.assert_allclose(np.asarray(P.importance_klt(q, basis, lam)), want, rtol=1e-5)


@pytest.mark.parametrize("budget", [-1, 17, np.nan])
def test_budget_out_of_range(budget, appendix_importance):
    with pytest.raises(ValueError, match="budget"):
        P.plan_bisection(appendix_importance, budget)
    with pytest.raises(ValueError, match="budget"):
        P.plan_exact(appendix_importance, budget)


def test_bad_importance_and_method(appendix_importance):
    with pytest.raises(ValueError, match="importance"):
        P.plan_bisection(np.array([1.0, -2.0]), 2)
    with pytest.raises(ValueError, match="importance"):
        P.plan_bisection(np.array([1.0, np.nan]), 2)
    with pytest.raises(ValueError, match="method"):
        P.plan(appendix_importance, 4, method="greedy")


def test_greedy_layer_budgets():
    grid = np.arange(24, 129, 8)
    # Layer 0 gains a lot from bits, layer 2 nothing: the plan moves bits from 2 to 0.
    errors = np.stack([np.exp(-grid / 16.0), np.exp(-grid / 64.0), np.full(grid.shape, 0.5)])
    budgets = P.greedy_layer_budgets(errors, grid, 48)
    assert budgets.mean() <= 48 and budgets[2] == 24 and budgets[0] > budgets[2]
    assert set(budgets) <= set(grid)
    with pytest.raises(ValueError, match="target_mean"):
        P.greedy_layer_budgets(errors, grid, 200)


def test_depths_at_rounds_exact_halves_up():
    """log4(g / theta) = 0.5, 1.5, 2.5, 3.5: Appendix A and the docstring round half up (jnp.round gave 0, 2, 2, 4)."""
    np.testing.assert_array_equal(np.asarray(P.depths_at(jnp.array([2.0, 8.0, 32.0, 128.0]), 1.0)), [1, 2, 3, 4])
    np.testing.assert_array_equal(np.asarray(jax.jit(P.depths_at)(jnp.array([2.0, 8.0]), 1.0)), [1, 2])


@pytest.mark.parametrize("budget", [-1, 17, np.nan])
def test_budget_out_of_range_under_jit(budget, appendix_importance):
    """A traced budget of 9999 was clamped to reading everything without a word."""
    for plan in (P.plan_bisection, P.plan_exact):
        with pytest.raises(jax.errors.JaxRuntimeError, match=r"budget must lie in \[0, 16\]"):
            jax.block_until_ready(jax.jit(plan)(appendix_importance, jnp.float32(budget)))
    ok = jax.jit(P.plan_bisection)(appendix_importance, jnp.int32(16))
    assert int(ok.code_bits) == 16


@pytest.mark.parametrize("jit", [False, True])
def test_bisection_never_exceeds_the_budget_at_the_water_line(jit):
    """Seven real SmolLM2 groups (tests/data, from the protocol of scripts/planner_smollm2.py, at d270401) where the
    final water line sits within float rounding of a breakpoint: re-evaluating the depths there read 33 code bits at a
    budget of 32. The plan is the last accepted trial's, so it fits the budget, and it is the exact allocation."""
    import pathlib

    data = np.load(pathlib.Path(__file__).parent / "data" / "bisection_water_line_groups.npz")
    g, budget = jnp.asarray(data["g"]), int(data["budget"])
    plan = (jax.jit(P.plan_bisection, static_argnums=1) if jit else P.plan_bisection)(g, budget)
    assert np.all(np.asarray(plan.code_bits) <= budget)
    np.testing.assert_array_equal(np.asarray(plan.depths), np.asarray(P.plan_exact(g, budget).depths))
    np.testing.assert_array_equal(np.asarray(P.depths_at(g, plan.theta)).sum(-1) <= budget + 1, True)


# ----------------------------------------------------------------------------------------------
# Issue 30: bad importances and budgets, eagerly, under jit and in checkify mode


def test_nan_importance_eagerly_jitted_and_checked(appendix_importance):
    """A NaN importance under jit silently planned the channel at depth 0. It is the documented default on the decode
    hot path (the other channels are planned as if it were 0); eagerly and under checks.checked a CheckError."""
    from fathom_jax import checks

    g = appendix_importance.at[2].set(jnp.nan)
    message = r"importance must be finite and non-negative .* got 1 NaN or inf and 0 negative value\(s\)"
    with pytest.raises(checks.CheckError, match=message):
        P.plan_bisection(g, 8)
    plan = _BISECTION(g, 8)
    np.testing.assert_array_equal(plan.depths, _BISECTION(appendix_importance.at[2].set(0.0), 8).depths)
    assert int(plan.depths[2]) == 0
    with pytest.raises(checks.CheckError, match=message):
        checks.checked(_BISECTION)(g, 8)
    with pytest.raises(checks.CheckError, match=r"got 0 NaN or inf and 1 negative"):
        P.plan_exact(appendix_importance.at[0].set(-1.0), 8)


def test_fractional_budget_is_refused_not_floored(appendix_importance):
    """``plan_bisection(g, 48.7)`` planned 48 bits without a word."""
    from fathom_jax import checks

    message = r"budget must lie in \[0, 16\] code bits .* and be a whole number, got \[8.5\]"
    with pytest.raises(checks.CheckError, match=message):
        P.plan_bisection(appendix_importance, 8.5)
    with pytest.raises(checks.CheckError, match=message), checks.reraise():
        jax.block_until_ready(_BISECTION(appendix_importance, jnp.float32(8.5)))
    with pytest.raises(checks.CheckError, match=message):
        checks.checked(_BISECTION)(appendix_importance, jnp.float32(8.5))
    assert int(_BISECTION(appendix_importance, jnp.float32(8.0)).code_bits) == 8


def test_importance_shapes_and_dtypes_are_checked_at_trace_time():
    from fathom_jax import checks

    q = jnp.ones((2, 4, 8))
    with pytest.raises(checks.CheckError, match=r"q must be \[\*G, H, D\] and variance \[\*G, D\]; got q \[2, 4, 8\] "
                                                r"and variance \[2, 7\] \(expected variance \[..., 8\]\)"):
        jax.jit(P.importance)(q, jnp.ones((2, 7)))
    with pytest.raises(checks.CheckError, match=r"variance \[3, 8\]"):
        P.importance(q, jnp.ones((3, 8)))
    with pytest.raises(TypeError, match=r"importance: q must be real numbers \[\*G, H, D\], got dtype complex64"):
        P.importance(q.astype(jnp.complex64), jnp.ones(8))
    with pytest.raises(checks.CheckError, match=r"basis must be \[\*G, D, D\], got shape \[2, 8, 7\]"):
        P.importance_klt(q, jnp.ones((2, 8, 7)), jnp.ones((2, 8)))
    with pytest.raises(checks.CheckError, match=r"budget must be a scalar or broadcast to the query groups \[\*G\] = \[2\]"):
        P.plan_bisection(jnp.ones((2, 8)), jnp.array([4, 4, 4]))
    assert P.importance(q, jnp.ones(8)).shape == (2, 8)
