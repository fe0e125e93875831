"""Water line: the bisection kernel equals the planner's trace bit for bit, at breakpoints and ties too."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import planner as P
from kernel_test_base import KernelTestBase, assert_equal, assert_ran
from pallas_kernels import water_line as WL
from tests.support import lower_triton_text


def random_importance(rng, n, d):
    """Log-normal importances over 12 decades, with zeros, exact ties and powers of 4 (breakpoints)."""
    g = np.exp(rng.normal(0, 6, (n, d))).astype(np.float32)
    g[rng.random((n, d)) < 0.1] = 0.0
    g[:, : d // 4] = g[:, :1]  # ties: the bit sum jumps by several planes at one water line
    g[rng.random((n, d)) < 0.1] = 4.0 ** rng.integers(-6, 6)
    return g


def kernel_inputs(g, budget):
    g, budget, lo, hi = P._prepare(g, budget, None)
    thresholds = jnp.moveaxis(P.water_line_thresholds(g), -2, 0)
    return thresholds, budget, (lo, hi)


class TestWaterLine(KernelTestBase):
    @pytest.mark.parametrize("n,d,rows", [(13, 128, 8), (8, 7, 4), (1, 64, 1), (37, 33, 16)])
    def test_equals_the_bisection_trace(self, impl, rng, n, d, rows):
        g = random_importance(rng, n, d)
        budget = rng.integers(0, 4 * d + 1, n)
        depths, log_hi = WL.water_line(*kernel_inputs(g, budget), spec=WL.WaterLineSpec(P.BISECTION_STEPS),
                                       config=WL.WaterLineConfig(rows=rows), **impl.kw)
        plan, _, _ = P.bisection_trace(g, budget)
        assert_equal(depths, plan.depths)
        assert_equal(jnp.exp(log_hi), plan.theta)
        assert np.all(np.asarray(depths).sum(-1) <= budget)

    def test_plan_bisection_at_water_lines_on_breakpoints(self, impl):
        """Real SmolLM2 groups whose water line sits within float rounding of a breakpoint (tests/data)."""
        data = np.load(pathlib.Path(__file__).parents[1] / "data" / "bisection_water_line_groups.npz")
        g, budget = jnp.asarray(data["g"]), int(data["budget"])
        got = jax.jit(lambda g: P.plan_bisection(g, budget, implementation=impl.implementation))(g)
        want = P.bisection_trace(g, budget)[0]
        assert_equal(got.depths, want.depths)
        assert_equal(got.theta, want.theta)
        assert_equal(got.depths, P.plan_exact(g, budget).depths)

    def test_vmapped_and_traced_budgets(self, impl, rng):
        g = jnp.asarray(random_importance(rng, 24, 16).reshape(3, 2, 4, 16))
        budgets = jnp.array([8, 24, 40], jnp.int32)
        fn = jax.jit(jax.vmap(lambda g, b: P.plan_bisection(g, b, implementation=impl.implementation)))
        got = fn(g, budgets)
        want = P.bisection_trace(g, budgets[:, None, None])[0]
        assert_equal(got.depths, want.depths)
        assert_ran(lambda g, implementation, interpret: P.plan_bisection(g, 8, implementation=implementation), g,
                   name=WL.KERNEL_NAME, impl=impl)

    def test_plane_costs_count_bits_as_read(self, impl, rng):
        """Priced planes (the first 1.25 bits: its channel's scale) against the reference and the bit count."""
        g = random_importance(rng, 13, 40)
        thresholds, _, bracket = kernel_inputs(g, 0)
        budget = jnp.asarray(rng.uniform(0, 4.25 * 40, 13), jnp.float32)
        spec = WL.WaterLineSpec(steps=30, plane_cost=(1.25, 1.0, 1.0, 1.0))
        depths, log_hi = WL.water_line(thresholds, budget, bracket, spec=spec, **impl.kw)
        want = WL.water_line_reference(thresholds, budget, bracket, spec=spec)
        assert_equal(depths, want[0])
        assert_equal(log_hi, want[1])
        d = np.asarray(depths)
        assert np.all(d.sum(-1) + (d > 0).sum(-1) / 4 <= np.asarray(budget))

    def test_deterministic(self, impl, rng):
        inputs = kernel_inputs(random_importance(rng, 16, 128), rng.integers(0, 513, 16))
        first = WL.water_line(*inputs, spec=WL.WaterLineSpec(30), **impl.kw)
        assert_equal(WL.water_line(*inputs, spec=WL.WaterLineSpec(30), **impl.kw)[0], first[0])


def test_zero_importance_is_never_read():
    """A zero channel reads nothing, even where the water line falls below every other threshold."""
    g = jnp.array([[0.0, 1.0, 2.0]], jnp.float32)
    for implementation in ("xla", "triton"):
        plan = P.plan_bisection(g, 12, bracket=(1e-30, 10.0), implementation=implementation)
        assert int(plan.depths[0, 0]) == 0 and int(plan.code_bits[0]) == 8
    with pytest.raises(ValueError, match="bracket must be"):
        P.plan_bisection(g, 12, bracket=(0.0, 10.0))


def test_bad_arguments():
    z = jnp.zeros
    spec = WL.WaterLineSpec(30)
    with pytest.raises(ValueError, match=r"thresholds must be \[4, N, D\]"):
        WL.water_line(z((3, 2, 8)), z(2), (z(2), z(2)), spec=spec)
    with pytest.raises(TypeError, match="thresholds must have dtype"):
        WL.water_line(z((4, 2, 8), jnp.float16), z(2), (z(2), z(2)), spec=spec)
    with pytest.raises(ValueError, match=r"budget must be \[N\] = \[2\]"):
        WL.water_line(z((4, 2, 8)), z(3), (z(2), z(2)), spec=spec)
    with pytest.raises(ValueError, match=r"log_hi must be \[N\] = \[2\]"):
        WL.water_line(z((4, 2, 8)), z(2), (z(2), z(3)), spec=spec)
    with pytest.raises(ValueError, match="bracket must be"):
        WL.water_line(z((4, 2, 8)), z(2), z(2), spec=spec)
    with pytest.raises(ValueError, match="steps"):
        WL.WaterLineSpec(steps=-1)
    with pytest.raises(ValueError, match="plane_cost must be 4 positive multiples of 1/4"):
        WL.WaterLineSpec(steps=30, plane_cost=(1.1, 1, 1, 1))
    with pytest.raises(ValueError, match="rows must be a power of two"):
        WL.WaterLineConfig(rows=6)


def test_water_line_lowers_to_triton():
    z = jnp.zeros
    text = lower_triton_text(lambda t, b: WL.water_line(t, b, (b, b), spec=WL.WaterLineSpec(30),
                                                        implementation="triton", interpret=False),
                             z((4, 8, 128), jnp.float32), z((8,), jnp.float32))
    assert text.count(f'name = "{WL.KERNEL_NAME}"') == 1
