"""Tiered write: each plane of new words lands in its own tier == a numpy oracle (decode blocks and prefilled layers,
past the end dropped); written through the pinned_host tier in place on the GPU; one launch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_base import HAS_GPU, Impl, KernelTestBase, assert_equal, assert_ran, host
from oracles import tier_write as np_tier_write
from pallas_kernels import tier_write as TW
from pallas_kernels.operands import LayerTiers
from pallas_kernels.plane_layout import tier_table
from tests.support import lower_triton_text

D, W = 12, 20


def tiers_of(rng, resident):
    n_hot, n_cold = sum(resident), 4 * len(resident) - sum(resident)
    return (rng.integers(0, 2**32, (n_hot, 3, D, W), dtype=np.uint32),
            rng.integers(0, 2**32, (n_cold, 3, D, W), dtype=np.uint32), jnp.asarray(tier_table(resident)))


class TestTierWrite(KernelTestBase):
    @pytest.mark.parametrize("resident,layers,words,layer", [((1, 2, 0, 4), 1, 2, 1), ((1, 2, 0, 4), 4, 2, 0),
                                                             ((3, 1), 1, W, 1), ((0, 4, 2), 2, 7, 1)])
    def test_matches_numpy_oracle(self, impl, rng, resident, layers, words, layer):
        hot, cold, tiers = tiers_of(rng, resident)
        src = rng.integers(0, 2**32, (layers, 3, D, 4, words), dtype=np.uint32)
        start = rng.integers(0, W - words + 1, 3).astype(np.int32)
        start[-1] = W - 1  # past the end: words beyond W are dropped, nothing else is touched
        want_hot, want_cold = np_tier_write(hot, cold, resident, src, start, layer)
        config = TW.TierWriteConfig(block=16)  # several programs per layer and group
        write = jax.jit(lambda h, c, s, st, lay: TW.tier_write(LayerTiers(h, c, None, tiers, lay), s, st, config=config,
                                                               **impl.kw), donate_argnums=(0, 1))
        got_hot, got_cold = write(jnp.asarray(hot), jnp.asarray(cold), jnp.asarray(src), jnp.asarray(start),
                                  jnp.int32(layer))
        assert_equal(got_hot, want_hot)
        assert_equal(got_cold, want_cold)
        assert_ran(TW.tier_write, LayerTiers(jnp.asarray(hot), jnp.asarray(cold), None, tiers, layer), jnp.asarray(src),
                   jnp.asarray(start), name=TW.KERNEL_NAME, impl=impl)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (interpret mode writes no inputs)")
def test_writes_the_host_tier_in_place():
    impl, rng = Impl("triton", False), np.random.default_rng(7)
    resident = (1, 2)
    hot, cold, tiers = tiers_of(rng, resident)
    src = rng.integers(0, 2**32, (1, 3, D, 4, 2), dtype=np.uint32)
    start = np.array([0, 6, 18], np.int32)
    want_hot, want_cold = np_tier_write(hot, cold, resident, src, start, 1)
    hot_d, cold_h = jnp.asarray(hot), host(jnp.asarray(cold), impl)
    token = jax.jit(lambda h, c, s, st: TW.tier_write_in_place(LayerTiers(h, c, None, tiers, 1), s, st))(
        hot_d, cold_h, jnp.asarray(src), jnp.asarray(start))
    token.block_until_ready()
    assert_equal(cold_h, want_cold)
    assert_equal(hot_d, want_hot)
    assert cold_h.sharding.memory_kind == "pinned_host"


def test_tier_write_lowers_to_triton_and_validates():
    z = jnp.zeros
    hot, cold, tiers = z((3, 2, D, W), jnp.uint32), z((5, 2, D, W), jnp.uint32), jnp.asarray(tier_table((1, 2)))
    text = lower_triton_text(lambda h, c, s, st: TW.tier_write(LayerTiers(h, c, None, tiers, 1), s, st,
                                                               implementation="triton", interpret=False),
                             hot, cold, z((1, 2, D, 4, 2), jnp.uint32), z((2,), jnp.int32))
    assert text.count(f'name = "{TW.KERNEL_NAME}"') == 1
    two = LayerTiers(hot, cold, None, tiers)
    with pytest.raises(ValueError, match="src must be"):
        TW.tier_write(two, z((1, 2, D, 3, 2), jnp.uint32), z((2,), jnp.int32))
    with pytest.raises(ValueError, match="start must be >= 0"):
        TW.tier_write(two, z((1, 2, D, 4, 2), jnp.uint32), jnp.array([0, -1], jnp.int32))
    with pytest.raises(ValueError, match="hot and tiers.cold"):
        TW.tier_write(LayerTiers(hot[..., :10], cold, None, tiers), z((1, 2, D, 4, 2), jnp.uint32), z((2,), jnp.int32))
    with pytest.raises(ValueError, match="writes every group"):
        TW.tier_write(LayerTiers(hot, cold, None, tiers, 0, 1), z((1, 2, D, 4, 2), jnp.uint32), z((2,), jnp.int32))
    if not HAS_GPU:
        with pytest.raises(ValueError, match="writes host memory"):
            TW.tier_write_in_place(two, z((1, 2, D, 4, 2), jnp.uint32), z((2,), jnp.int32))
