"""Row fetch: exact equality with a numpy oracle, one or two sources, stacked layers, pinned-host sources."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_base import KernelTestBase, assert_equal, assert_ran, host
from oracles import row_fetch as np_row_fetch
from pallas_kernels import row_fetch as RF
from tests.support import lower_triton_text

D = 16


class TestRowFetch(KernelTestBase):
    @pytest.mark.parametrize("n,s,rows,programs", [(50, 37, 8, 0), (64, 1, 4, 0), (300, 128, 32, 0),
                                                    (300, 128, 32, 3), (50, 37, 8, 7), (64, 1, 4, 64)])
    def test_exact(self, impl, rng, n, s, rows, programs):
        """One program per work item, or persistent programs (more than, fewer than, not dividing the items); an
        ``after`` operand (never read) changes nothing."""
        k = jnp.asarray(rng.standard_normal((2, 6, n, D)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((2, 6, n, D)), jnp.bfloat16)
        idx = jnp.asarray(rng.integers(-5, n + 5, (6, s)), jnp.int32)  # includes padding (-ve, >= n)
        config = RF.RowFetchConfig(rows=rows, programs=programs)
        fetch = jax.jit(lambda a, b, layer, after: RF.row_fetch(RF.StoredRows(a, b, layer), idx, after=after,
                                                                config=config, **impl.kw))
        after = (jnp.ones((2, 5)), jnp.int32(0)) if programs else None  # orders the kernel, changes nothing
        got_k, got_v, mask = fetch(host(k, impl), host(v, impl), jnp.int32(1), after)
        assert_equal(got_k, np_row_fetch(k[1], idx))
        assert_equal(got_v, np_row_fetch(v[1], idx))
        assert_equal(mask, (idx >= 0) & (idx < n))
        alone, none, _ = RF.row_fetch(RF.StoredRows(k[0]), idx, config=config, **impl.kw)  # one source (staging)
        assert none is None
        assert_equal(alone, np_row_fetch(k[0], idx))
        assert_ran(RF.row_fetch, RF.StoredRows(k[0], v[0]), idx, name=RF.KERNEL_NAME, impl=impl)

    @pytest.mark.parametrize("start,width", [(0, D), (D, D), (0, 2 * D), (D // 2, D // 2)])
    def test_column_window_of_interleaved_rows(self, impl, rng, start, width):
        """A cache that keeps K and V side by side (``[n, 2 Dh]``) reads both in one run, or the keys alone."""
        n, s = 70, 45
        kv = jnp.asarray(rng.standard_normal((3, 4, n, 2 * D)), jnp.bfloat16)
        idx = jnp.asarray(rng.integers(-3, n + 3, (4, s)), jnp.int32)
        fetch = jax.jit(lambda a, layer: RF.row_fetch(RF.StoredRows(a, layer=layer, columns=(start, width)), idx,
                                                      **impl.kw))
        got, none, mask = fetch(host(kv, impl), jnp.int32(2))
        assert none is None and got.shape == (4, s, width)
        assert_equal(got, np_row_fetch(kv[2, ..., start:start + width], idx))
        assert_equal(mask, (idx >= 0) & (idx < n))

    @pytest.mark.parametrize("width,rows", [(33, 8), (65, 32), (20, 4)])
    def test_rows_of_any_width(self, impl, rng, width, rows):
        """Compressed row formats store ``uint32`` rows of any width (33 words: k8v8 at Dh = 64)."""
        n, s = 70, 45
        kv = jnp.asarray(rng.integers(0, 2**32, (3, 4, n, width), dtype=np.uint32))
        idx = jnp.asarray(rng.integers(-3, n + 3, (4, s)), jnp.int32)
        fetch = jax.jit(lambda a, layer: RF.row_fetch(RF.StoredRows(a, layer=layer), idx,
                                                      config=RF.RowFetchConfig(rows=rows), **impl.kw))
        got, _, mask = fetch(host(kv, impl), jnp.int32(1))
        assert got.dtype == jnp.uint32 and got.shape == (4, s, width)
        assert_equal(got, np_row_fetch(kv[1], idx))
        assert_equal(mask, (idx >= 0) & (idx < n))

    @pytest.mark.parametrize("group_start,groups", [(0, 3), (1, 2), (3, 1)])
    def test_group_window_of_stacked_cache(self, impl, rng, group_start, groups):
        """An index over Rc groups reads groups group_start.. of a stacked cache (one GPU stream's share)."""
        n, s = 70, 45
        kv = jnp.asarray(rng.standard_normal((3, 4, n, 2 * D)), jnp.bfloat16)
        idx = jnp.asarray(rng.integers(-3, n + 3, (groups, s)), jnp.int32)
        fetch = jax.jit(lambda a, layer: RF.row_fetch(RF.StoredRows(a, layer=layer, group_start=group_start), idx,
                                                      **impl.kw))
        got, _, mask = fetch(host(kv, impl), jnp.int32(2))
        assert_equal(got, np_row_fetch(kv[2, group_start:group_start + groups], idx))
        assert_equal(mask, (idx >= 0) & (idx < n))


def test_row_fetch_lowers_to_triton_and_validates():
    z = jnp.zeros
    text = lower_triton_text(lambda a, b, layer: RF.row_fetch(RF.StoredRows(a, b, layer), z((2, 9), jnp.int32),
                                                               implementation="triton", interpret=False),
                             z((3, 2, 64, D), jnp.bfloat16), z((3, 2, 64, D), jnp.bfloat16), jnp.int32(2))
    assert text.count(f'name = "{RF.KERNEL_NAME}"') == 1
    ordered = lower_triton_text(lambda a, layer, after: RF.row_fetch(RF.StoredRows(a, layer=layer),
                                                                     z((2, 9), jnp.int32), after=after,
                                                                     implementation="triton", interpret=False),
                                z((3, 2, 64, D), jnp.bfloat16), jnp.int32(2), z((7,), jnp.float32))
    assert "gpu.triton(%arg2, %arg1, %arg0, %arg3)" in ordered  # index, layer, cache, then the `after` operand
    with pytest.raises(ValueError, match="values"):
        RF.row_fetch(RF.StoredRows(z((2, 64, D), jnp.bfloat16), z((2, 64, D), jnp.float32)), z((2, 9), jnp.int32))
    with pytest.raises(ValueError, match="at least one feature"):
        RF.row_fetch(RF.StoredRows(z((2, 64, 12), jnp.bfloat16), columns=(0, 0)), z((2, 9), jnp.int32))
    odd = lower_triton_text(lambda a: RF.row_fetch(RF.StoredRows(a), z((2, 9), jnp.int32), implementation="triton",
                                                   interpret=False), z((2, 64, 33), jnp.uint32))
    assert odd.count(f'name = "{RF.KERNEL_NAME}"') == 1  # rows of any width lower (blocks padded and masked)
    with pytest.raises(ValueError, match=r"1 <= Rc <= 1 \(groups 1\.\. of the store's 2\)"):
        RF.row_fetch(RF.StoredRows(z((3, 2, 64, D), jnp.bfloat16), layer=0, group_start=1), z((2, 9), jnp.int32))
    with pytest.raises(ValueError, match="programs must be an int >= 0"):
        RF.RowFetchConfig(programs=-1)
    with pytest.raises(ValueError, match="columns must be"):
        RF.row_fetch(RF.StoredRows(z((2, 64, 2 * D), jnp.bfloat16), columns=(D + 1, D)), z((2, 9), jnp.int32))
