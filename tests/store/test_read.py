"""Reads of a store (fathom_jax/store/read.py): depth checks eagerly, under jit (the documented NaN) and in
checkify mode, with one message. The reads' values are tested in test_store.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import checks
from fathom_jax import store as S

MESSAGE = r"dequantize: depth must lie in \[0, 4\] planes per channel, got values in \[0, 7\]"


@pytest.fixture(scope="module")
def store():
    return S.build_store(np.linspace(-1, 1, 64 * 4, dtype=np.float32).reshape(64, 4))


def test_depth_outside_the_planes_eagerly_jitted_and_checked(store):
    """Issue 30: ``jax.jit(store.dequantize)`` with a depth of 7 gave all-NaN output and no error. Eagerly a
    CheckError; under plain jit the documented default (the channel reads NaN, the others their values); under
    checks.checked the same CheckError as eagerly."""
    depth = np.array([0, 2, 4, 7], np.int32)
    with pytest.raises(checks.CheckError, match=MESSAGE):
        S.dequantize(store, depth)
    read = np.asarray(jax.jit(S.dequantize)(store, jnp.asarray(depth)))
    assert np.all(np.isnan(read[:, 3])) and np.all(np.isfinite(read[:, :3]))
    np.testing.assert_array_equal(read[:, :3], np.asarray(S.dequantize(store, np.array([0, 2, 4, 4])))[:, :3])
    with pytest.raises(checks.CheckError, match=MESSAGE):
        checks.checked(jax.jit(S.dequantize))(store, jnp.asarray(depth))
    unpacked = S.unpack_store(store)
    for read_fn in (S.dequantize_block, S.read_codes):
        with pytest.raises(checks.CheckError, match=r"depth must lie in \[0, 4\]"):
            checks.checked(jax.jit(read_fn))(unpacked, jnp.asarray(depth))


def test_depth_dtype_and_shape_are_checked_at_trace_time(store):
    with pytest.raises(TypeError, match="depth must be whole planes .* got dtype float32"):
        jax.jit(S.dequantize)(store, jnp.full((4,), 2.0))
    with pytest.raises(checks.CheckError, match=r"depth must broadcast to \[\*batch, D\] = \[4\], got shape \[3\]"):
        jax.jit(S.dequantize)(store, jnp.full((3,), 2))
    with pytest.raises(checks.CheckError, match=r"got shape \[2, 4\]"):
        S.dequantize_channels(store, np.full((2, 4), 2))
