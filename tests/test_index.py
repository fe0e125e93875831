"""The key index: appending token by token equals building from all keys, bit for bit; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import calibrate as C
from fathom_jax import index as I
from fathom_jax import methods as M
from tests.support import assert_trees_bitwise_equal
from tests.support import build_index_jit as build


@pytest.mark.parametrize("split", [0, 63])
def test_append_index_equals_build_index(split, random_keys):
    keys = random_keys(np.random.default_rng(split), (2, 2, 140, 16))
    calib = C.calibrate_session(jnp.asarray(keys))
    methods = (M.Fathom(24), M.FathomKLT(24), M.Loki(4), M.Landmark(), M.Exact())
    append = jax.jit(I.append_index)
    index = build(jnp.asarray(keys[:, :, :split]), calib, methods, capacity=192)
    i = split
    for m in (1, 1, 7, 1, 130 - split):  # one by one and in chunks, across 8- and 64-token blocks
        index = append(index, jnp.asarray(keys[:, :, i:i + m]))
        i += m
    assert i == 140
    assert_trees_bitwise_equal(index, build(jnp.asarray(keys), calib, methods, capacity=192))


def test_parts_follow_the_methods(random_keys):
    keys = random_keys(np.random.default_rng(1), (2, 70, 8))
    calib = C.calibrate_session(jnp.asarray(keys))
    index = I.build_index(keys, calib, [M.SparQ(2), M.Landmark()])
    assert index.raw is not None and index.landmarks is not None
    assert index.klt is None and index.loki is None and index.keys is None
    assert I.parts_of([M.Fathom(8), M.Loki(2), M.Exact()]) == {"raw", "loki", "keys"}
    no_keys = I.build_index(keys, calib, [M.Exact(), M.Fathom(8)], parts=frozenset({"raw"}))
    assert no_keys.keys is None and no_keys.raw is not None
    assert index.capacity == 128 and index.head_dim == 8 and index.batch_shape == (2,)


def test_append_index_errors(random_keys):
    index = I.build_index(random_keys(np.random.default_rng(0), (2, 60, 8)), None, [M.Landmark()], capacity=64)
    with pytest.raises(ValueError, match="past capacity"):
        I.append_index(index, jnp.zeros((2, 5, 8)))
    with pytest.raises(ValueError, match=r"\[\*batch, m, D\]"):
        I.append_index(index, jnp.zeros((2, 8)))
    with pytest.raises(Exception, match="past capacity"):  # under jit: raised through a host callback
        jax.block_until_ready(jax.jit(I.append_index)(index, jnp.zeros((2, 5, 8))))
    with pytest.raises(TypeError, match="ScanMethod"):
        I.build_index(jnp.zeros((2, 8, 8)), None, ["fathom:8"])
