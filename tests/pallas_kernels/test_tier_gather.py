"""Tiered run gather: the planes it stages (those past each layer's resident ones, up to each slot's depth) equal the
run gather's of the same store in one tier, exactly (numpy oracle); group windows, persistent programs; host tier on
the GPU; the plane scan of its buffer, resident planes read in place, equals the scan of the one-tier store."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_base import KernelTestBase, assert_ran, assert_scores_close, assert_staged, host, random_store_arrays
from oracles import plane_scan as np_plane_scan
from oracles import run_gather as np_run_gather
from pallas_kernels import plane_scan as PS
from pallas_kernels import run_gather as RG
from pallas_kernels import tier_gather as TG
from pallas_kernels.operands import LayerTiers, RunList, StorePlanes
from pallas_kernels.plane_layout import tier_table
from tests.support import lower_triton_text

D = 16


def split_tiers(planes, resident):
    """A stacked one-tier store ``planes [L, R, D, 4, W]`` as its two tiers (numpy): hot rows [Nh, R, D, W] and cold
    rows [Nc, R, D, W], plane-major, each layer's rows in order (an independent construction of the layout)."""
    planes = np.asarray(planes)
    hot = [planes[layer, :, :, i] for layer, p in enumerate(resident) for i in range(p)]
    cold = [planes[layer, :, :, i] for layer, p in enumerate(resident) for i in range(p, 4)]
    return jnp.asarray(np.stack(hot)), jnp.asarray(np.stack(cold))


def warm_tier(rng, planes, resident, slots):
    """A warm tier of ``slots`` rows per (layer, group) over ``planes [L, R, D, 4, W]`` (numpy): each channel keeps a
    random number of the planes right after the layer's resident ones, rows in a random order, unused rows random
    words. Returns ``(warm [L, R, S, W], warm_map [L, R, D, 4], first [L, R, D])`` (the map holds 1 + the row, 0 for
    none): ``first`` the first plane only the cold tier holds."""
    planes = np.asarray(planes)
    layers, groups, d, _, w = planes.shape
    warm = rng.integers(0, 2**32, (layers, groups, slots, w), dtype=np.uint32)
    warm_map = np.zeros((layers, groups, d, 4), np.int32)
    first = np.zeros((layers, groups, d), np.int32)
    for layer, p in enumerate(resident):
        for r in range(groups):
            rows = list(rng.permutation(slots))
            for c in rng.permutation(d):
                count = min(int(rng.integers(0, 4 - p + 1)), len(rows))
                for i in range(p, p + count):
                    row = rows.pop()
                    warm_map[layer, r, c, i] = row + 1
                    warm[layer, r, row] = planes[layer, r, c, i]
                first[layer, r, c] = p + count
    return jnp.asarray(warm), jnp.asarray(warm_map), first


def run_list(rng, r, c=7):
    ch = jnp.asarray(rng.integers(0, D, (r, c)), jnp.int32)
    return RunList(ch, jnp.asarray(rng.integers(0, 5, (r, c)), jnp.int32))


def test_tier_table_rows():
    np.testing.assert_array_equal(tier_table((1, 2, 0, 4)), [[1, 0, 0], [2, 1, 3], [0, 3, 5], [4, 3, 9]])


class TestTierGather(KernelTestBase):
    @pytest.mark.parametrize("resident", [(1, 2, 0, 4), (1, 1, 1, 1), (3, 0, 2, 1)])
    def test_equals_the_one_tier_gather(self, impl, rng, resident):
        planes, scales, _ = random_store_arrays(rng, (4, 3), D, 320)
        hot, cold = split_tiers(planes, resident)
        table = jnp.asarray(tier_table(resident))
        runs = run_list(rng, 3)
        gather = jax.jit(lambda c, s, layer: TG.tier_gather(LayerTiers(hot, c, s, table, layer), runs,
                                                             config=RG.RunGatherConfig(chunk=4), **impl.kw))
        for layer in range(4):
            got = gather(host(cold, impl), scales, jnp.int32(layer))
            assert_staged(got.planes, got.scales, *np_run_gather(planes[layer], scales[layer], runs.channels,
                                                                 runs.depths), runs.depths, resident[layer])

    @pytest.mark.parametrize("group_start,groups,programs", [(0, 2, 0), (2, 3, 5), (5, 1, 1 << 20)])
    def test_group_windows_and_persistent_programs(self, impl, rng, group_start, groups, programs):
        planes, scales, _ = random_store_arrays(rng, (2, 6), D, 640)
        resident = (2, 1)
        hot, cold = split_tiers(planes, resident)
        table = jnp.asarray(tier_table(resident))
        runs = run_list(rng, groups)
        config = RG.RunGatherConfig(chunk=8, programs=programs)
        gather = jax.jit(lambda c, s, layer, after: TG.tier_gather(
            LayerTiers(hot, c, s, table, layer, group_start), runs, after=after, config=config, **impl.kw))
        got = gather(host(cold, impl), scales, jnp.int32(1), (jnp.ones((2,)),))
        window = slice(group_start, group_start + groups)
        assert_staged(got.planes, got.scales, *np_run_gather(planes[1][window], scales[1][window], runs.channels,
                                                             runs.depths), runs.depths, resident[1])

    @pytest.mark.parametrize("group_start,programs", [(0, 0), (2, 3)])
    def test_warm_tier_planes_stay_off_the_link(self, impl, rng, group_start, programs):
        """With a warm tier each slot's staged planes start at its channel's first plane outside it: those equal the
        one-tier gather's, and the planes the warm tier holds are not staged (the reference leaves zeros)."""
        planes, scales, _ = random_store_arrays(rng, (3, 5), D, 320)
        resident = (1, 0, 2)
        hot, cold = split_tiers(planes, resident)
        warm, warm_map, first = warm_tier(rng, planes, resident, slots=12)
        table = jnp.asarray(tier_table(resident))
        runs = run_list(rng, 3)
        window = slice(group_start, group_start + 3)
        gather = jax.jit(lambda c, s, layer: TG.tier_gather(
            LayerTiers(hot, c, s, table, layer, group_start, warm, warm_map), runs,
            config=RG.RunGatherConfig(chunk=4, programs=programs), **impl.kw))
        for layer in range(3):
            got = gather(host(cold, impl), scales, jnp.int32(layer))
            slot_first = np.take_along_axis(first[layer][window], np.asarray(runs.channels), axis=-1)
            want = np_run_gather(planes[layer][window], scales[layer][window], runs.channels, runs.depths)
            assert_staged(got.planes, got.scales, *want, runs.depths, slot_first[..., None])
            if not impl.is_kernel:
                plane = np.arange(4)[None, None, :]
                assert not np.asarray(got.planes)[plane < slot_first[..., None]].any()
            np.testing.assert_array_equal(LayerTiers(hot, cold, scales, table, layer, group_start, warm, warm_map)
                                          .first_planes(runs.channels), slot_first)

    def test_scan_with_warm_planes_equals_the_scan_of_one_tier(self, impl, rng):
        """Resident planes from the hot tier, the warm tier's planes from there, the rest staged: the scan equals the
        plane scan of the store in one tier (unsorted lists too: the kernel's sort carries each slot's warm rows)."""
        group_start = 1
        planes, scales, length = random_store_arrays(rng, (2, 4), D, 448)
        resident = (1, 2)
        hot, cold = split_tiers(planes, resident)
        warm, warm_map, _ = warm_tier(rng, planes, resident, slots=20)
        table = jnp.asarray(tier_table(resident))
        groups = slice(group_start, group_start + 3)
        q = jnp.asarray(rng.standard_normal((3, 4, D)), jnp.float32)
        sorted_runs = PS.active_channels(jnp.asarray(rng.integers(0, 5, (3, D)), jnp.int32), max_active=10)
        f16x2 = PS.PlaneScanConfig(math="f16x2")
        for runs, layer, config in ((sorted_runs, 0, None), (run_list(rng, 3), 1, None), (sorted_runs, 1, f16x2)):
            q_staged = jnp.take_along_axis(q, runs.channels[:, None, :], axis=-1)
            tiers = LayerTiers(hot, host(cold, impl), scales, table, jnp.int32(layer), group_start, warm, warm_map)
            staged = TG.tier_gather(tiers, runs, **impl.kw)
            got = jax.jit(lambda q, st, n, rl, r, config=config: PS.plane_scan(
                q, st, n, rl, resident=r, config=config, **impl.kw))(
                q_staged, staged, length[layer][groups], runs.slots(), PS.ResidentPlanes(tiers, runs.channels))
            want = np_plane_scan(q, planes[layer][groups], scales[layer][groups], length[layer][groups],
                                 runs.channels, runs.depths)
            if config is None:
                assert_scores_close(got, want)
            else:  # the packed-f16 kernel within its bound (the reference is the f32 one)
                bound = PS.f16x2_error_bound(q, StorePlanes(planes[layer][groups], scales[layer][groups]), runs)
                assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= np.asarray(bound)[:, None] + 1e-6)

    def test_scan_with_resident_planes_in_place_equals_the_scan_of_one_tier(self, impl, rng):
        """The staged buffer scanned with the identity list, planes below p_l read from the hot tier in place, ==
        the plane scan of the store in one tier (a window of groups past the first)."""
        group_start = 1
        planes, scales, length = random_store_arrays(rng, (3, 5), D, 448)
        resident = (0, 2, 1)
        hot, cold = split_tiers(planes, resident)
        table = jnp.asarray(tier_table(resident))
        groups = slice(group_start, group_start + 4)
        q = jnp.asarray(rng.standard_normal((4, 4, D)), jnp.float32)
        runs = PS.active_channels(jnp.asarray(rng.integers(0, 5, (4, D)), jnp.int32), max_active=10)
        ch, dep = runs.channels, runs.depths
        q_staged = jnp.take_along_axis(q, ch[:, None, :], axis=-1)
        for layer in (1, 2):
            tiers = LayerTiers(hot, host(cold, impl), scales, table, jnp.int32(layer), group_start)
            staged = TG.tier_gather(tiers, runs, **impl.kw)
            scan = jax.jit(lambda q, st, n, rl, r: PS.plane_scan(q, st, n, rl, resident=r, **impl.kw))
            got = scan(q_staged, staged, length[layer][groups], runs.slots(), PS.ResidentPlanes(tiers, ch))
            want = np_plane_scan(q, planes[layer][groups], scales[layer][groups], length[layer][groups], ch, dep)
            assert_scores_close(got, want)
        assert_ran(TG.tier_gather, LayerTiers(hot, cold, scales, table, 1), runs, name=TG.KERNEL_NAME, impl=impl)
        assert_ran(PS.plane_scan, q_staged, staged, length[1][:4], runs.slots(), name=PS.KERNEL_NAME, impl=impl,
                   resident=PS.ResidentPlanes(LayerTiers(hot, cold, scales, table, jnp.int32(1)), ch))


def test_tier_gather_lowers_to_triton_and_validates():
    z = jnp.zeros
    hot, cold, scales = z((3, 2, D, 20), jnp.uint32), z((5, 2, D, 20), jnp.uint32), z((2, 2, D, 10), jnp.float16)
    table = jnp.asarray(tier_table((1, 2)))
    runs = RunList(z((2, 5), jnp.int32), z((2, 5), jnp.int32))
    text = lower_triton_text(lambda c, s, t, layer: TG.tier_gather(LayerTiers(hot, c, s, t, layer), runs,
                                                                   implementation="triton", interpret=False),
                             cold, scales, table, jnp.int32(0))
    assert text.count(f'name = "{TG.KERNEL_NAME}"') == 1
    ch = runs.channels
    text = lower_triton_text(lambda q, p, s, h: PS.plane_scan(
        q, StorePlanes(p, s), z((2,), jnp.int32), runs,
        resident=PS.ResidentPlanes(LayerTiers(h, cold, scales, table, jnp.int32(1)), ch),
        implementation="triton", interpret=False), z((2, 4, 5)), z((2, 5, 4, 20), jnp.uint32),
        z((2, 5, 10), jnp.float16), hot)
    assert text.count(f'name = "{PS.KERNEL_NAME}"') == 1
    warm, warm_map = z((2, 2, 6, 20), jnp.uint32), z((2, 2, D, 4), jnp.int32)
    text = lower_triton_text(lambda c, s, t, layer: TG.tier_gather(
        LayerTiers(hot, c, s, t, layer, 0, warm, warm_map), runs, implementation="triton", interpret=False),
        cold, scales, table, jnp.int32(0))
    assert text.count(f'name = "{TG.KERNEL_NAME}"') == 1
    for config in (None, PS.PlaneScanConfig(math="f16x2")):
        text = lower_triton_text(lambda q, p, s, h, config=config: PS.plane_scan(
            q, StorePlanes(p, s), z((2,), jnp.int32), runs, config=config,
            resident=PS.ResidentPlanes(LayerTiers(h, cold, scales, table, jnp.int32(1), 0, warm, warm_map), ch),
            implementation="triton", interpret=False), z((2, 4, 5)), z((2, 5, 4, 20), jnp.uint32),
            z((2, 5, 10), jnp.float16), hot)
        assert text.count('name = "fathom_plane_scan') == 1
    with pytest.raises(ValueError, match="warm and tiers.warm_map come together"):
        TG.tier_gather(LayerTiers(hot, cold, scales, table, 0, 0, warm), runs)
    with pytest.raises(ValueError, match=r"warm_map must be \[L, R, D, 4\]"):
        TG.tier_gather(LayerTiers(hot, cold, scales, table, 0, 0, warm, warm_map[..., :3]), runs)
    with pytest.raises(ValueError, match="table must be"):
        TG.tier_gather(LayerTiers(hot, cold, scales, z((3, 3), jnp.int32), 0), runs)
    with pytest.raises(ValueError, match="cold must be"):
        TG.tier_gather(LayerTiers(hot, cold[..., :10], scales, table, 0), runs)
    with pytest.raises(ValueError, match="depths"):
        TG.tier_gather(LayerTiers(hot, cold, scales, table, 0), RunList(ch, ch + 7))
    with pytest.raises(ValueError, match=r"1 <= Rc <= 1"):
        TG.tier_gather(LayerTiers(hot, cold, scales, table, 0, 1), runs)
    with pytest.raises(ValueError, match="resident.channels must be"):
        PS.plane_scan(z((2, 4, 5)), StorePlanes(z((2, 5, 4, 20), jnp.uint32), z((2, 5, 10), jnp.float16)),
                      z((2,), jnp.int32), runs,
                      resident=PS.ResidentPlanes(LayerTiers(hot, cold, scales, table, jnp.int32(1)), ch[:, :3]))
