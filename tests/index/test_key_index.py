"""The key index: appending token by token equals building from all keys, bit for bit; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import calibrate as C
from fathom_jax import index as I
from fathom_jax import methods as M
from fathom_jax.index import parts as P
from tests.support import assert_trees_bitwise_equal
from tests.support import build_index_jit as build


@pytest.mark.parametrize("split", [0, 63])
def test_append_index_equals_build_index(split, random_keys):
    keys = random_keys(np.random.default_rng(split), (2, 2, 140, 16))
    calib = C.calibrate_session(jnp.asarray(keys))
    methods = (M.Fathom(24), M.FathomKLT(24), M.Loki(4), M.Landmark(), M.Quest(), M.Quest(8), M.Exact())
    append = jax.jit(I.append_index)
    index = build(jnp.asarray(keys[:, :, :split]), calib, methods, capacity=192)
    i = split
    for m in (1, 1, 7, 1, 130 - split):  # one by one and in chunks, across 8-, 16- and 64-token blocks
        index = append(index, jnp.asarray(keys[:, :, i:i + m]))
        i += m
    assert i == 140
    assert_trees_bitwise_equal(index, build(jnp.asarray(keys), calib, methods, capacity=192))


def test_parts_follow_the_methods(random_keys):
    keys = random_keys(np.random.default_rng(1), (2, 70, 8))
    calib = C.calibrate_session(jnp.asarray(keys))
    index = I.build_index(keys, calib, M.parts_of([M.SparQ(2), M.Landmark()]))
    assert index.get("raw") is not None and index.get("landmarks") is not None
    assert index.get("klt") is None and index.get("loki") is None and index.get("keys") is None
    assert M.parts_of([M.Fathom(8), M.Loki(2), M.Exact()]) == {P.RAW, P.LOKI, P.KEYS}
    no_keys = I.build_index(keys, calib, {P.RAW})
    assert no_keys.get("keys") is None and no_keys.get("raw") is not None
    assert index.capacity == 128 and index.head_dim == 8 and index.batch_shape == (2,)


def test_append_index_errors(random_keys):
    index = I.build_index(random_keys(np.random.default_rng(0), (2, 60, 8)), None, M.Landmark().parts, capacity=64)
    with pytest.raises(ValueError, match="past capacity"):
        I.append_index(index, jnp.zeros((2, 5, 8)))
    with pytest.raises(ValueError, match=r"\[\*batch, m, D\]"):
        I.append_index(index, jnp.zeros((2, 8)))
    with pytest.raises(Exception, match="past capacity"):  # under jit: raised through a host callback
        jax.block_until_ready(jax.jit(I.append_index)(index, jnp.zeros((2, 5, 8))))
    with pytest.raises(TypeError, match="IndexPart"):
        I.build_index(jnp.zeros((2, 8, 8)), None, ["fathom:8"])


def test_prefix_index_equals_build_index_with_that_length(random_keys):
    """Cutting a window's index to a length (the fidelity sweep's per-position index) equals building it with
    that length, bit for bit, at block boundaries and inside blocks, for every part; so does the unpacked view."""
    from fathom_jax import store as S

    keys = jnp.asarray(random_keys(np.random.default_rng(5), (2, 2, 150, 16)))
    calib = C.calibrate_session(keys)
    methods = (M.Fathom(24), M.FathomKLT(24), M.Loki(4), M.Landmark(), M.Quest(), M.Quest(8), M.Exact())
    full = build(keys, calib, methods)
    cut = jax.jit(I.prefix_index)
    unpacked = I.unpack_index(full)
    depths = jnp.asarray(np.random.default_rng(6).integers(0, 5, (2, 2, 16)), jnp.int32)
    for length in ([1, 1], [63, 64], [64, 65], [128, 100], [149, 150], [150, 150], [16, 17], [0, 8]):
        length = jnp.asarray(length, jnp.int32)
        want = build(keys, calib, methods, length=length)
        assert_trees_bitwise_equal(cut(full, keys, length), want)
        got = cut(unpacked, keys, length)
        for part in ("raw", "klt", "loki"):
            a, b = want[part], got[part]
            assert isinstance(b, S.UnpackedStore)
            for depth in (0, 2, 4, depths):
                np.testing.assert_array_equal(np.asarray(S.dequantize(a, depth)), np.asarray(S.dequantize(b, depth)))
                np.testing.assert_array_equal(np.asarray(S.read_codes(a, depth)), np.asarray(S.read_codes(b, depth)))
                # the block holding token `length` alone (the sweep scores it apart from the shared blocks)
                every, block = np.asarray(S.dequantize(a, depth)), np.asarray(S.dequantize_block(b, depth))
                for i, j in np.ndindex(*b.batch_shape):
                    start = int(b.length[i, j]) // 64 * 64
                    rows = every[i, j, start:start + 64]  # none past the capacity
                    np.testing.assert_array_equal(block[i, j], np.pad(rows, ((0, 64 - len(rows)), (0, 0))))
            np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))
            np.testing.assert_array_equal(np.asarray(a.tail), np.asarray(b.tail))


@pytest.mark.parametrize("page", [16, 8, 4])
def test_page_bounds_are_the_fp16_min_and_max_of_each_pages_valid_keys(page, random_keys):
    """Quest's pages: ``[min | max]`` over each page's valid keys, rounded to the nearest fp16 (not outward), zeros
    where a page holds none; the tail is the raw keys of the partial last page. A Quest-only index knows its
    capacity and head_dim from its pages."""
    keys = random_keys(np.random.default_rng(page), (3, 70, 8))
    length = np.array([70, 37, 0], np.int32)
    index = I.build_index(keys, None, M.Quest(page).parts, capacity=128, length=length)
    data = index[f"quest{page}"]
    assert isinstance(data, P.Pages) and data.bounds.dtype == jnp.float16 and data.bounds.shape == (3, 128 // page, 16)
    assert index.capacity == 128 and index.head_dim == 8
    bounds, tail = np.asarray(data.bounds), np.asarray(data.tail)
    for b, n in enumerate(length):
        for i in range(128 // page):
            rows = keys[b, i * page:min((i + 1) * page, n)]
            want = np.concatenate([rows.min(0), rows.max(0)]).astype(np.float16) if len(rows) else np.zeros(16)
            np.testing.assert_array_equal(bounds[b, i], want)
        start = n // page * page
        np.testing.assert_array_equal(tail[b, :n - start], keys[b, start:n])
        np.testing.assert_array_equal(tail[b, n - start:], 0)
    assert np.all(bounds[..., :8] <= bounds[..., 8:])
    with pytest.raises(ValueError, match="page must be an int dividing 64"):
        P.PageBounds(24)
