"""Budgets in bits as read: the exact allocation against brute force, its bisection form, the error models."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import allocation as A
from fathom_jax import format as fmt
from fathom_jax import planner as P
from fathom_jax import store as S

COST = A.depth_bits()


def random_table(rng, d, *, geometric):
    """Eq. 3's tables (geometric in t) or arbitrary non-increasing ones (observed errors), over 8 decades,
    with some exact ties between channels."""
    scale = np.exp(rng.normal(0, 2, d))
    scale[: d // 3] = scale[0]
    if geometric:
        return np.asarray(A.variance_errors(scale.astype(np.float32)))
    steps = rng.uniform(0.05, 1.0, (d, A.DEPTHS))
    steps[:, 0] = 1.0
    return (scale[:, None] * np.cumprod(steps, axis=1)).astype(np.float32)


def brute_force(table, budget):
    """Every depth vector: the least model error within the budget, and at each exact cost."""
    d = table.shape[0]
    depths = np.array(list(itertools.product(range(A.DEPTHS), repeat=d)))
    errors = table[np.arange(d), depths].sum(axis=1, dtype=np.float64)
    costs = COST[depths].sum(axis=1)
    return depths, errors, costs


@pytest.mark.parametrize("geometric", [True, False], ids=["eq3", "observed"])
def test_exact_and_bisection_against_brute_force(geometric):
    rng = np.random.default_rng(1 + geometric)
    d = 4
    tables = np.stack([random_table(rng, d, geometric=geometric) for _ in range(24)])
    budgets = rng.uniform(0, A.max_bits(d), 24).astype(np.float32)
    budgets[:4] = [0.0, 1.0, 1.25, A.max_bits(d)]
    exact = A.plan_bits_exact(tables, budgets)
    bisect = A.plan_bits_bisection(tables, budgets)
    for i in range(len(tables)):
        depths, errors, costs = brute_force(tables[i], budgets[i])
        best = errors[costs <= budgets[i]].min()
        de, db = np.asarray(exact.depths[i]), np.asarray(bisect.depths[i])
        assert COST[de].sum() <= budgets[i] and COST[db].sum() <= budgets[i]
        np.testing.assert_allclose(tables[i][np.arange(d), de].sum(), best, rtol=1e-5)
        # The Lagrangian plan is the best of every plan that costs no more than it does.
        spent = COST[db].sum()
        np.testing.assert_allclose(tables[i][np.arange(d), db].sum(), errors[costs <= spent + 1e-6].min(), rtol=1e-5)
        for plan, dep in ((exact, de), (bisect, db)):
            assert float(plan.bits_per_token[i]) == COST[dep].sum() == float(fmt.bits_per_token(dep))


def test_exact_spends_what_bisection_leaves():
    """At D = 64 the exact plan's model error is never above the water line's, and it spends within a quarter bit
    of the budget whenever a plane is left to buy."""
    rng = np.random.default_rng(5)
    tables = np.stack([random_table(rng, 64, geometric=g) for g in (True, False) * 4])
    budgets = np.asarray([20, 37, 55, 73, 90, 128, 200, 55], np.float32)
    exact, bisect = A.plan_bits_exact(tables, budgets), A.plan_bits_bisection(tables, budgets)
    e_err, b_err = A.plan_error(tables, exact.depths), A.plan_error(tables, bisect.depths)
    assert np.all(np.asarray(e_err) <= np.asarray(b_err) * (1 + 1e-6))
    assert np.all(np.asarray(exact.bits_per_token) > budgets - 1.25)
    assert np.all(np.asarray(exact.bits_per_token) <= budgets) and np.all(np.asarray(bisect.bits_per_token) <= budgets)


def test_hull_thresholds_are_the_papers_with_the_scale_priced():
    """Eq. 3's table: plane 1 at gain per bit 0.75 g / 1.25, plane t > 1 at 0.75 g 4^-(t-1), i.e. the paper's
    ``log g - (t + 1/2) log 4`` thresholds plus log 1.5, and log 1.5 / 1.25 for the first plane."""
    g = np.exp(np.random.default_rng(0).normal(0, 3, (5, 16))).astype(np.float32)
    got = np.asarray(A.hull_thresholds(A.variance_errors(g)))
    paper = np.asarray(P.water_line_thresholds(g))
    shift = np.log(1.5) + np.array([np.log(1 / 1.25), 0, 0, 0])[:, None]
    np.testing.assert_allclose(got, paper + shift, atol=2e-5)


def test_a_non_convex_channel_opens_at_its_hull():
    """A channel whose first plane removes nothing but whose second removes much is read to depth 2 at once."""
    table = np.array([[1.0, 1.0, 0.01, 0.005, 0.004], [0.5, 0.2, 0.1, 0.05, 0.04]], np.float32)
    thr = np.exp(np.asarray(A.hull_thresholds(table)))
    np.testing.assert_allclose(thr[0, 0], thr[1, 0])  # planes 1 and 2 share one threshold: (1 - 0.01) / 2.25
    np.testing.assert_allclose(thr[0, 0], 0.99 / 2.25, rtol=1e-6)
    plan = A.plan_bits_bisection(table, 2.25)
    np.testing.assert_array_equal(plan.depths, [2, 0])


def test_zero_errors_are_never_read_and_budgets_are_checked():
    table = np.zeros((3, 5), np.float32)
    table[1] = [1.0, 0.5, 0.2, 0.1, 0.05]
    for method in A.PLANNERS:
        plan = A.plan_bits(table, 12.75, method=method)
        np.testing.assert_array_equal(plan.depths, [0, 4, 0])
    with pytest.raises(ValueError, match=r"budget must lie in \[0, 12.75\] bits per token as read"):
        A.plan_bits_bisection(table, 13.0)
    with pytest.raises(ValueError, match="error table must be"):
        A.plan_bits_exact(table[:, :4], 3.0)
    with pytest.raises(ValueError, match="finite and non-negative"):
        A.plan_bits_exact(-table, 3.0)
    with pytest.raises(ValueError, match="method must be one of"):
        A.plan_bits(table, 3.0, method="greedy")


@pytest.mark.parametrize("method", A.PLANNERS)
def test_traced_budgets_under_jit_equal_eager(method):
    rng = np.random.default_rng(3)
    tables = np.stack([random_table(rng, 16, geometric=False) for _ in range(6)]).reshape(2, 3, 16, 5)
    budgets = np.asarray([[5.0, 20.5, 40.0], [0.0, 68.0, 12.25]], np.float32)
    fn = jax.jit(lambda t, b: A.plan_bits(t, b, method=method).depths)
    np.testing.assert_array_equal(fn(tables, budgets), A.plan_bits(tables, budgets, method=method).depths)


def test_bisection_kernel_equals_its_reference():
    rng = np.random.default_rng(4)
    tables = np.stack([random_table(rng, 33, geometric=g) for g in (True, False) * 5])
    budgets = rng.uniform(0, A.max_bits(33), 10).astype(np.float32)
    got = A.plan_bits_bisection(tables, budgets, implementation="triton")
    want = A.plan_bits_bisection(tables, budgets, implementation="xla")
    np.testing.assert_array_equal(got.depths, want.depths)
    np.testing.assert_array_equal(got.theta, want.theta)


def test_plane_errors_are_the_stores_quantization_errors():
    rng = np.random.default_rng(6)
    keys = (rng.normal(size=(2, 200, 8)) * np.exp(rng.normal(size=8)) + rng.normal(size=8) * 3).astype(np.float32)
    errors = np.asarray(A.plane_errors(keys, skip_tokens=16))
    st = S.build_store(jnp.asarray(keys))
    for t in range(A.DEPTHS):
        residual = keys - (np.asarray(S.dequantize(st, t))[:, :200] if t else 0.0)
        np.testing.assert_allclose(errors[..., t], residual[:, 16:].var(axis=1), rtol=1e-5)
    assert np.all(errors[..., 4] < errors[..., 0])
    # Offset channels (|mean| >> std): the absmax scale spends the first planes on the offset, not the spread.
    assert np.any(errors[..., 1] > 2 * errors[..., 0] / 4)
    with pytest.raises(ValueError, match="skip_tokens"):
        A.plane_errors(keys[:, :17])
