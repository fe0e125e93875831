"""Slot copy: a slot's groups read out of and written into a stacked array == numpy slicing, bit for bit, for every
dtype a cache holds; the rest of the store untouched; the write in place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_base import HAS_GPU, Impl, KernelTestBase, assert_equal, assert_ran, host
from pallas_kernels import slot_copy as SC
from tests.support import lower_triton_text

CASES = {  # name: (store shape [L, R, *trail], dtype, heads)
    "kv_rows_bf16": ((2, 6, 5, 3), jnp.bfloat16, 2),  # trail of 15: one part-full chunk
    "planes_u32": ((2, 4, 3, 4, 5), jnp.uint32, 2),  # three trailing axes
    "scales_f16": ((3, 4, 7), jnp.float16, 1),
    "codes_u8": ((2, 6, 9), jnp.uint8, 3),
    "lengths_i32": ((2, 4, 1), jnp.int32, 2),
}


def _random(rng, shape, dtype):
    """Random bits of ``dtype`` (every pattern, NaNs included: the copy must move bits, not values)."""
    width = jnp.dtype(dtype).itemsize
    bits = rng.integers(0, 2 ** (8 * width), shape, dtype=np.uint64).astype(f"u{width}")
    return np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype))


def _case(rng, name):
    shape, dtype, heads = CASES[name]
    store = _random(rng, shape, dtype)
    part = _random(rng, (shape[0], heads, *shape[2:]), dtype)
    return store, part, heads


class TestSlotCopy(KernelTestBase):
    @pytest.mark.parametrize("name", list(CASES))
    def test_read_and_write_match_numpy_slicing(self, impl, rng, name):
        store, part, heads = _case(rng, name)
        groups = store.shape[1]
        read = jax.jit(lambda s, st: SC.slot_read(s, st, heads, **impl.kw))
        write = jax.jit(lambda s, p, st: SC.slot_write(s, p, st, **impl.kw), donate_argnums=0,
                        out_shardings=host(jnp.zeros(()), impl).sharding if impl.on_gpu else None)
        for start in sorted({0, groups - heads, (groups - heads) // 2}):
            assert_equal(read(host(jnp.asarray(store), impl), jnp.int32(start)), store[:, start:start + heads])
            want = store.copy()
            want[:, start:start + heads] = part
            got = write(host(jnp.asarray(store), impl), jnp.asarray(part), jnp.int32(start))
            assert_equal(got, want)  # the slot written, every other group untouched
            if impl.on_gpu:
                assert got.sharding.memory_kind == "pinned_host"

    def test_a_start_past_the_end_clamps_like_xla(self, impl, rng):
        store, part, heads = _case(rng, "codes_u8")
        last = store.shape[1] - heads
        traced = jax.jit(lambda s, p, st: (SC.slot_read(s, st, heads, **impl.kw), SC.slot_write(s, p, st, **impl.kw)))
        got_read, got_write = traced(jnp.asarray(store), jnp.asarray(part), jnp.int32(last + 2))
        assert_equal(got_read, store[:, last:])
        want = store.copy()
        want[:, last:] = part
        assert_equal(got_write, want)

    def test_the_kernels_ran(self, impl, rng):
        store, part, heads = _case(rng, "kv_rows_bf16")
        assert_ran(SC.slot_read, jnp.asarray(store), jnp.int32(2), name=SC.READ_NAME, impl=impl, heads=heads)
        assert_ran(SC.slot_write, jnp.asarray(store), jnp.asarray(part), jnp.int32(2), name=SC.WRITE_NAME, impl=impl)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_the_in_place_write_changes_the_host_store_and_returns_only_a_token(rng):
    store, part, heads = _case(rng, "planes_u32")
    pinned = host(jnp.asarray(store), Impl("triton", False))
    token = jax.jit(lambda s, p, st: SC.slot_write_in_place(s, p, st))
    compiled = token.lower(pinned, jnp.asarray(part), jnp.int32(1)).compile()
    assert "pinned_host" not in str(compiled.output_shardings)
    jax.block_until_ready(compiled(pinned, jnp.asarray(part), jnp.int32(1)))
    want = store.copy()
    want[:, 1:1 + heads] = part
    assert_equal(jax.device_get(pinned), want)


def test_slot_copy_lowers_to_triton_and_validates():
    z = jnp.zeros
    for shape, dtype in (((2, 6, 5, 3), jnp.bfloat16), ((2, 4, 3, 4, 5), jnp.uint32), ((2, 6, 9), jnp.uint8)):
        store = z(shape, dtype)
        text = lower_triton_text(lambda s, st: SC.slot_read(s, st, 2, implementation="triton", interpret=False),
                                 store, jnp.int32(0))
        assert text.count(f'name = "{SC.READ_NAME}"') == 1
        text = lower_triton_text(lambda s, p, st: SC.slot_write(s, p, st, implementation="triton", interpret=False),
                                 store, store[:, :2], jnp.int32(0))
        assert text.count(f'name = "{SC.WRITE_NAME}"') == 1
        text = lower_triton_text(lambda s, p, st: SC._write_pallas(s, p, st, config=SC.SlotCopyConfig(),
                                                                   interpret=False, in_place=True),
                                 store, store[:, :2], jnp.int32(0))  # what slot_write_in_place runs on a GPU
        assert text.count(f'name = "{SC.WRITE_NAME}"') == 1
    with pytest.raises(ValueError, match="store must be .* at least one axis after the group axis"):
        SC.slot_read(z((2, 4)), 0, 2)
    with pytest.raises(ValueError, match="heads must be an int in"):
        SC.slot_read(z((2, 4, 3)), 0, 5)
    with pytest.raises(ValueError, match=r"start must lie in \[0, 2\]"):
        SC.slot_read(z((2, 4, 3)), 3, 2)
    with pytest.raises(ValueError, match="start must be an integer scalar"):
        SC.slot_write(z((2, 4, 3)), z((2, 2, 3)), jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="part must be"):
        SC.slot_write(z((2, 4, 3)), z((2, 2, 4)), 0)
    with pytest.raises(TypeError, match="part dtype"):
        SC.slot_write(z((2, 4, 3)), z((2, 2, 3), jnp.bfloat16), 0)
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        SC.SlotCopyConfig(chunk=3)
