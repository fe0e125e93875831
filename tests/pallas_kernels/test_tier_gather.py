"""Tiered run gather: the staged buffers of a store split into resident (HBM) and host tiers equal the run gather's of
the same store in one tier, exactly (numpy oracle); group windows, persistent programs; host tier on the GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_base import KernelTestBase, assert_equal, assert_ran, assert_scores_close, host, random_store_arrays
from oracles import plane_scan as np_plane_scan
from oracles import run_gather as np_run_gather
from pallas_kernels import plane_scan as PS
from pallas_kernels import run_gather as RG
from pallas_kernels import tier_gather as TG
from tests.support import lower_triton_text

D = 16


def split_tiers(planes, resident):
    """A stacked one-tier store ``planes [L, R, D, 4, W]`` as its two tiers (numpy): hot rows [Nh, R, D, W] and cold
    rows [Nc, R, D, W], plane-major, each layer's rows in order (an independent construction of the layout)."""
    planes = np.asarray(planes)
    hot = [planes[layer, :, :, i] for layer, p in enumerate(resident) for i in range(p)]
    cold = [planes[layer, :, :, i] for layer, p in enumerate(resident) for i in range(p, 4)]
    return jnp.asarray(np.stack(hot)), jnp.asarray(np.stack(cold))


def run_list(rng, r, c=7):
    ch = jnp.asarray(rng.integers(0, D, (r, c)), jnp.int32)
    return ch, jnp.asarray(rng.integers(0, 5, (r, c)), jnp.int32)


def test_tier_table_rows():
    np.testing.assert_array_equal(TG.tier_table((1, 2, 0, 4)), [[1, 0, 0], [2, 1, 3], [0, 3, 5], [4, 3, 9]])


class TestTierGather(KernelTestBase):
    @pytest.mark.parametrize("resident", [(1, 2, 0, 4), (1, 1, 1, 1), (3, 0, 2, 1)])
    def test_equals_the_one_tier_gather(self, impl, rng, resident):
        planes, scales, _ = random_store_arrays(rng, (4, 3), D, 320)
        hot, cold = split_tiers(planes, resident)
        tiers = jnp.asarray(TG.tier_table(resident))
        ch, dep = run_list(rng, 3)
        gather = jax.jit(lambda h, c, s, layer: TG.tier_gather(h, c, s, tiers, ch, dep, layer=layer,
                                                                config=RG.RunGatherConfig(chunk=4), **impl.kw))
        for layer in range(4):
            got_p, got_s = gather(hot, host(cold, impl), scales, jnp.int32(layer))
            want_p, want_s = np_run_gather(planes[layer], scales[layer], ch, dep)
            assert_equal(got_p, want_p)
            assert_equal(got_s, want_s)

    @pytest.mark.parametrize("group_start,groups,programs", [(0, 2, 0), (2, 3, 5), (5, 1, 1 << 20)])
    def test_group_windows_and_persistent_programs(self, impl, rng, group_start, groups, programs):
        planes, scales, _ = random_store_arrays(rng, (2, 6), D, 640)
        resident = (2, 1)
        hot, cold = split_tiers(planes, resident)
        tiers = jnp.asarray(TG.tier_table(resident))
        ch, dep = run_list(rng, groups)
        config = RG.RunGatherConfig(chunk=8, programs=programs)
        gather = jax.jit(lambda h, c, s, layer, after: TG.tier_gather(
            h, c, s, tiers, ch, dep, layer=layer, group_start=group_start, after=after, config=config, **impl.kw))
        got_p, got_s = gather(hot, host(cold, impl), scales, jnp.int32(1), (jnp.ones((2,)),))
        window = slice(group_start, group_start + groups)
        want_p, want_s = np_run_gather(planes[1][window], scales[1][window], ch, dep)
        assert_equal(got_p, want_p)
        assert_equal(got_s, want_s)

    def test_gather_then_scan_equals_the_scan_of_one_tier(self, impl, rng):
        """The staged buffer scanned with the identity list == the plane scan of the store in one tier."""
        planes, scales, length = random_store_arrays(rng, (3, 4), D, 448)
        resident = (0, 2, 1)
        hot, cold = split_tiers(planes, resident)
        tiers = jnp.asarray(TG.tier_table(resident))
        q = jnp.asarray(rng.standard_normal((4, 4, D)), jnp.float32)
        ch, dep = PS.active_channels(jnp.asarray(rng.integers(0, 5, (4, D)), jnp.int32), max_active=10)
        sp, ss = TG.tier_gather(hot, cold, scales, tiers, ch, dep, layer=jnp.int32(1), **impl.kw)
        q_staged = jnp.take_along_axis(q, ch[:, None, :], axis=-1)
        iota = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (4, 10))
        staged = PS.plane_scan(q_staged, sp, ss, length[1], iota, dep, assume_sorted=True, **impl.kw)
        assert_scores_close(staged, np_plane_scan(q, planes[1], scales[1], length[1], ch, dep))
        assert_ran(TG.tier_gather, hot, cold, scales, tiers, ch, dep, name=TG.KERNEL_NAME, impl=impl, layer=1)


def test_tier_gather_lowers_to_triton_and_validates():
    z = jnp.zeros
    args = (z((3, 2, D, 20), jnp.uint32), z((5, 2, D, 20), jnp.uint32), z((2, 2, D, 10), jnp.float16),
            jnp.asarray(TG.tier_table((1, 2))))
    text = lower_triton_text(lambda h, c, s, t, layer: TG.tier_gather(h, c, s, t, z((2, 5), jnp.int32),
                                                                       z((2, 5), jnp.int32), layer=layer,
                                                                       implementation="pallas", interpret=False),
                             *args, jnp.int32(0))
    assert text.count(f'name = "{TG.KERNEL_NAME}"') == 1
    with pytest.raises(ValueError, match="tiers must be"):
        TG.tier_gather(*args[:3], z((3, 3), jnp.int32), z((2, 5), jnp.int32), z((2, 5), jnp.int32), layer=0)
    with pytest.raises(ValueError, match="hot and cold must be"):
        TG.tier_gather(args[0][..., :10], *args[1:], z((2, 5), jnp.int32), z((2, 5), jnp.int32), layer=0)
    with pytest.raises(ValueError, match="depths"):
        TG.tier_gather(*args, z((2, 5), jnp.int32), z((2, 5), jnp.int32) + 7, layer=0)
    with pytest.raises(ValueError, match=r"1 <= Rc <= 1"):
        TG.tier_gather(*args, z((2, 5), jnp.int32), z((2, 5), jnp.int32), layer=0, group_start=1)
