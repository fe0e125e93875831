"""The check machinery: one message eagerly, through a host callback under jit, and in checkify mode.

The rows of issue 30's table are tested beside their modules (test_store_read, test_calibrate, test_planner,
test_select); this file tests what they all lean on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from fathom_jax import checks


def _positive(x, *, hot=False):
    checks.fail_if(x <= 0, lambda got: f"x must be positive, got {got[got <= 0].tolist()}", x, hot=hot)
    return x * 2


def test_eager_failure_is_a_check_error_naming_the_values():
    with pytest.raises(checks.CheckError, match=r"x must be positive, got \[-1.0\]"):
        _positive(np.array([1.0, -1.0]))
    assert issubclass(checks.CheckError, ValueError)
    np.testing.assert_array_equal(_positive(np.array([1.0])), [2.0])


def test_callback_error_under_jit_reraises_as_the_check_error():
    """Under a user's own jit JAX reports the callback's exception as an INTERNAL runtime error with the message
    on its last line; reraise (which the library's entry points use) gives the CheckError back, message first."""
    f = jax.jit(_positive)
    with pytest.raises(jax.errors.JaxRuntimeError) as raw:
        jax.block_until_ready(f(jnp.array([1.0, -3.0])))
    assert str(raw.value).rstrip().endswith("ValueError: x must be positive, got [-3.0]")
    with pytest.raises(checks.CheckError) as err, checks.reraise():
        jax.block_until_ready(f(jnp.array([-4.0])))
    assert str(err.value) == "x must be positive, got [-4.0]" and err.value.__suppress_context__


def test_reraise_passes_other_runtime_errors_through():
    def other(x):
        jax.debug.callback(lambda _: (_ for _ in ()).throw(RuntimeError("not ours")), x)
        return x

    with pytest.raises(jax.errors.JaxRuntimeError, match="not ours"), checks.reraise():
        jax.block_until_ready(jax.jit(other)(jnp.ones(2)))


def test_hot_checks_are_off_by_default_and_on_in_checkify_mode():
    """A hot check costs nothing under plain jit; checked() runs it as a checkify check with the eager message,
    and checking() retraces the same jitted function (the mode is part of JAX's cache key)."""
    f = jax.jit(lambda x: _positive(x, hot=True))
    np.testing.assert_array_equal(f(jnp.array([-1.0])), [-2.0])  # unchecked: the documented default applies
    with pytest.raises(checks.CheckError, match=r"^x must be positive, got \[-1.0\]$"):
        checks.checked(f)(jnp.array([-1.0]))
    np.testing.assert_array_equal(checks.checked(f)(jnp.array([3.0])), [6.0])
    with checks.checking():
        err, _ = jax.jit(checkify.checkify(f, errors=checkify.user_checks))(jnp.array([-2.0]))
    with pytest.raises(checks.CheckError, match=r"got \[-2.0\]"):
        checks.throw(err)
    np.testing.assert_array_equal(f(jnp.array([-1.0])), [-2.0])  # back to the default trace


def test_checkify_mode_under_vmap_reports_the_failing_element():
    f = jax.vmap(lambda x: _positive(x, hot=True))
    with pytest.raises(checks.CheckError, match=r"got \[-5.0\]"):
        checks.checked(jax.jit(f))(jnp.array([[1.0], [-5.0], [2.0]]))
    # the callback mode under vmap fires only for the failing element too
    with pytest.raises(checks.CheckError, match=r"got \[-6.0\]"), checks.reraise():
        jax.block_until_ready(jax.jit(jax.vmap(_positive))(jnp.array([[1.0], [-6.0]])))


def test_checked_without_jit_raises_eagerly():
    with pytest.raises(checks.CheckError, match="x must be positive"):
        checks.checked(_positive)(np.array([0.0]))


def test_hot_checks_fall_back_to_the_readmes_defaults_under_a_plain_jit():
    """The README's table, row by row: under a plain jit each hot check is off and its documented default applies;
    checks.checked turns the check on with the eager message."""
    from fathom_jax import calibrate, planner, select, store

    rng = np.random.default_rng(0)
    keys = jnp.asarray(rng.standard_normal((70, 4)), jnp.float32)
    st = store.build_store(keys)
    depth = jnp.array([4, 7, 2, 0], jnp.int32)
    values = np.asarray(jax.jit(store.dequantize)(st, depth))[:70]
    assert np.isnan(values[:, 1]).all() and np.isfinite(np.delete(values, 1, axis=1)).all()
    with pytest.raises(checks.CheckError, match="depth"):
        checks.checked(jax.jit(store.dequantize))(st, depth)

    g = jnp.array([[3.0, jnp.nan, 2.0, -1.0]])
    plan = jax.jit(lambda g: planner.plan(g, 8, implementation="xla"))(g)
    assert int(plan.depths[0, 1]) == 0 and int(plan.depths[0, 3]) == 0
    with pytest.raises(checks.CheckError, match="importance must be finite and non-negative"):
        checks.checked(jax.jit(lambda g: planner.plan(g, 8, implementation="xla")))(g)

    scores = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    topk = jax.jit(lambda length: select.select_topk(scores, length, 40, sink=2, local=4, implementation="xla"))
    for got, want in zip(topk(jnp.int32(99)), topk(jnp.int32(64))):
        np.testing.assert_array_equal(got, want)  # a length past n is clipped to n
    with pytest.raises(checks.CheckError, match="length must lie in"):
        checks.checked(topk)(jnp.int32(99))

    q = jnp.ones((1, 4), jnp.float32)
    indices, mask = jnp.array([[0, 99]], jnp.int32), jnp.array([[True, True]])
    attend = jax.jit(lambda i: select.sparse_attention(q, keys, keys, i, mask))
    assert np.isnan(np.asarray(attend(indices))).all()  # the row past the keys reads NaN
    with pytest.raises(checks.CheckError, match="indices must lie in"):
        checks.checked(attend)(indices)

    session = jax.jit(lambda length: calibrate.calibrate_session(keys[None], length=length))
    session(jnp.array([99], jnp.int32))  # taken as given: no error, no host callback
    with pytest.raises(checks.CheckError, match="length must lie in"):
        checks.checked(session)(jnp.array([99], jnp.int32))
