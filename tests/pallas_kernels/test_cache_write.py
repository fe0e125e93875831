"""Cache write: in-place writes into stacked caches == a numpy oracle; donation keeps the buffer in place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_base import KernelTestBase, assert_equal, assert_ran, host
from oracles import cache_write as np_cache_write
from pallas_kernels import cache_write as CW
from tests.support import lower_triton_text

CASES = {  # name: (dst shape, src shape, axis)
    "kv_rows": ((3, 4, 50, 16), (3, 4, 1, 16), 2),
    "planes": ((3, 4, 8, 4, 10), (3, 4, 8, 4, 2), 4),
    "planes_ragged": ((2, 3, 40, 4, 10), (2, 3, 40, 4, 2), 4),  # 160 (channel, plane) rows: 64 per program, the last part-full
    "scales": ((3, 4, 8, 5), (3, 4, 8, 1), 3),
    "prefill_layer": ((3, 4, 300, 16), (1, 4, 257, 16), 2),
    "word_rows": ((3, 4, 50, 33), (3, 4, 1, 33), 2),  # a compressed row format's uint32 rows (k8v8, Dh = 64)
    "word_rows_prefill": ((3, 4, 300, 20), (1, 4, 257, 20), 2),
}


def _arrays(rng, name):
    dst_shape, src_shape, axis = CASES[name]
    dtype = {"scales": np.float16}.get(name, np.uint32 if "planes" in name or "word" in name else jnp.bfloat16)
    if dtype == np.uint32:
        return (rng.integers(0, 2**32, dst_shape, dtype=np.uint32), rng.integers(0, 2**32, src_shape, dtype=np.uint32),
                axis)
    make = lambda shape: np.asarray(jnp.asarray(rng.standard_normal(shape), dtype))  # noqa: E731
    return make(dst_shape), make(src_shape), axis


class TestCacheWrite(KernelTestBase):
    @pytest.mark.parametrize("name", list(CASES))
    def test_matches_numpy_oracle(self, impl, rng, name):
        dst, src, axis = _arrays(rng, name)
        n, m = dst.shape[axis], src.shape[axis]
        start = rng.integers(0, n - m + 1, dst.shape[1]).astype(np.int32)
        start[-1] = n - 1  # past the end: rows beyond N are dropped, nothing else is touched
        layer = 2 if src.shape[0] == 1 else 0
        want = np_cache_write(dst, src, start, axis, layer)
        write = jax.jit(lambda d, s, st, lay: CW.cache_write(d, s, st, axis=axis, layer=lay, **impl.kw),
                        donate_argnums=0, out_shardings=host(jnp.zeros(()), impl).sharding if impl.on_gpu else None)
        got = write(host(jnp.asarray(dst), impl), jnp.asarray(src), jnp.asarray(start), jnp.int32(layer))
        assert_equal(got, want)
        if impl.on_gpu:
            assert got.sharding.memory_kind == "pinned_host"  # still host memory, written in place

    def test_donated_buffer_is_consumed(self, impl, rng):
        dst, src, axis = _arrays(rng, "kv_rows")
        d = jnp.asarray(dst)
        write = jax.jit(lambda d, s: CW.cache_write(d, s, jnp.zeros(4, jnp.int32), axis=axis, **impl.kw),
                        donate_argnums=0)
        out = write(d, jnp.asarray(src))
        assert_equal(out, np_cache_write(dst, src, np.zeros(4), axis, 0))
        assert_ran(CW.cache_write, jnp.asarray(dst), jnp.asarray(src), jnp.zeros(4, jnp.int32),
                   name=CW.KERNEL_NAME, impl=impl, axis=axis)


def test_cache_write_lowers_to_triton_and_validates():
    z = jnp.zeros
    for dst, src, axis in ((z((3, 2, 64, 16), jnp.bfloat16), z((3, 2, 1, 16), jnp.bfloat16), 2),
                           (z((3, 2, 8, 4, 20), jnp.uint32), z((3, 2, 8, 4, 2), jnp.uint32), 4),
                           (z((3, 2, 64, 33), jnp.uint32), z((3, 2, 1, 33), jnp.uint32), 2)):
        text = lower_triton_text(lambda d, s, st: CW.cache_write(d, s, st, axis=axis, implementation="triton",
                                                                 interpret=False), dst, src, z((2,), jnp.int32))
        assert text.count(f'name = "{CW.KERNEL_NAME}"') == 1
    with pytest.raises(ValueError, match="does not fit"):
        CW.cache_write(z((3, 2, 8, 16)), z((3, 2, 9, 16)), z((2,), jnp.int32), axis=2)
    with pytest.raises(TypeError, match="dtype"):
        CW.cache_write(z((3, 2, 8, 16)), z((3, 2, 1, 16), jnp.bfloat16), z((2,), jnp.int32), axis=2)
    with pytest.raises(ValueError, match="start must be >= 0"):
        CW.cache_write(z((3, 2, 8, 16)), z((3, 2, 1, 16)), jnp.array([0, -1], jnp.int32), axis=2)
    with pytest.raises(ValueError, match="axis"):
        CW.cache_write(z((3, 2, 8, 16)), z((3, 2, 8, 16)), z((2,), jnp.int32), axis=1)
