"""The plane scan's tensor-core variant: scores == the numpy oracle within the tolerance derived in
:mod:`pallas_kernels.plane_scan_mma` (depth mixes, G = 3 and 4, length masking, stacked layers, group windows, an
unsorted list, resident planes of a tiered store); top-k sets equal but at near-ties; the named kernel ran."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_base import HAS_GPU, Impl, KernelTestBase, assert_ran, assert_scores_close, host, random_store_arrays
from oracles import plane_scan as np_plane_scan
from pallas_kernels import plane_scan as PS
from pallas_kernels import plane_scan_mma as PM
from pallas_kernels import tier_gather as TG
from pallas_kernels.operands import LayerTiers, RunList, StorePlanes
from pallas_kernels.plane_layout import tier_table
from test_plane_scan import D, depth_plan
from test_tier_gather import split_tiers
from tests.support import lower_triton_text

TOL = 2.0 ** -16  # of m * sum_k a_k per score (the module's derivation, with margin)
MMA = PS.PlaneScanConfig(variant="mma", tile=128, num_warps=4)


def bound(q, scales, length, channels, depths):
    """``m * sum_k a_k(i)`` per score ``[R, 1, n]``: ``m`` the group's largest ``|q|`` over the list, the sum over the
    read slots (numpy)."""
    q, scales, channels, depths = (np.asarray(x) for x in (q, scales, channels, depths))
    m = np.max(np.abs(np.take_along_axis(q, channels[:, None, :], axis=-1)), axis=(1, 2))
    a = np.take_along_axis(scales.astype(np.float64), channels[..., None], axis=1) * (depths[..., None] > 0)
    total = np.repeat(a.sum(axis=1), 64, axis=-1)
    total[np.arange(total.shape[-1])[None, :] >= np.asarray(length)[:, None]] = 0.0
    return (m[:, None] * total)[:, None, :]


def assert_within(got, want, limit):
    err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    assert np.all(np.isfinite(np.asarray(got)))
    assert np.all(err <= TOL * limit + 1e-30), float(np.max(err / np.maximum(limit, 1e-30)))


class TestPlaneScanMma(KernelTestBase):
    @pytest.fixture(params=[pytest.param(Impl("pallas", True), id="interpret"),
                            pytest.param(Impl("pallas", False), id="gpu", marks=[
                                pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")])])
    def impl(self, request) -> Impl:
        return request.param

    @pytest.mark.parametrize("kind,g,n_cap,tile,rows", [
        ("random", 4, 320, 128, 16), ("four", 4, 448, 64, 32), ("one", 3, 256, 256, 16), ("zero", 4, 64, 64, 16),
        ("random", 3, 640, 512, 64)], ids=["random-g4", "four-g4", "one-g3", "zero", "random-g3-rows64"])
    def test_matches_the_oracle(self, impl, rng, kind, g, n_cap, tile, rows):
        planes, scales, length = random_store_arrays(rng, (5,), D, n_cap)
        q = jnp.asarray(rng.standard_normal((5, g, D)) * np.exp(rng.normal(0, 2, D)), jnp.float32)
        runs = PS.active_channels(depth_plan(rng, kind, (5,)))
        config = PS.PlaneScanConfig(variant="mma", tile=tile, rows=rows, num_warps=4)
        got = PS.plane_scan(q, StorePlanes(planes, scales), length, runs, config=config, **impl.kw)
        assert got.shape == (5, g, n_cap)
        want = np_plane_scan(q, planes, scales, length, runs.channels, runs.depths)
        assert_within(got, want, bound(q, scales, length, runs.channels, runs.depths))
        past = np.broadcast_to(np.arange(n_cap)[None, None, :] >= np.asarray(length)[:, None, None], got.shape)
        assert np.all(np.asarray(got)[past] == 0)

    def test_stacked_window_and_unsorted_list(self, impl, rng):
        """A stacked store at a traced layer, groups 1.. of it, a list in no depth order (repeated channels too)."""
        planes, scales, length = random_store_arrays(rng, (3, 4), D, 448)
        q = jnp.asarray(rng.standard_normal((3, 4, D)), jnp.float32)
        runs = RunList(jnp.asarray(rng.integers(0, D, (3, 9)), jnp.int32), jnp.asarray(rng.integers(0, 5, (3, 9)),
                                                                                       jnp.int32))
        scan = jax.jit(lambda p, s, layer: PS.plane_scan(q, StorePlanes(p, s, layer, 1), length[2][1:], runs,
                                                         config=MMA, **impl.kw))
        got = scan(host(planes, impl), host(scales, impl), jnp.int32(2))
        p, s, n = planes[2][1:], scales[2][1:], length[2][1:]
        assert_within(got, np_plane_scan(q, p, s, n, runs.channels, runs.depths),
                      bound(q, s, n, runs.channels, runs.depths))
        assert_ran(PS.plane_scan, q, StorePlanes(p, s), n, runs, name=PM.KERNEL_NAME, impl=impl, config=MMA)

    def test_resident_planes_of_a_tiered_store(self, impl, rng):
        """The staged buffer of the tiered gather, planes below p_l read in place from the hot tier."""
        planes, scales, length = random_store_arrays(rng, (3, 5), D, 448)
        resident = (0, 2, 1)
        hot, cold = split_tiers(planes, resident)
        table = jnp.asarray(tier_table(resident))
        q = jnp.asarray(rng.standard_normal((4, 4, D)), jnp.float32)
        runs = PS.active_channels(depth_plan(rng, "random", (4,)), max_active=10)
        ch, dep = runs.channels, runs.depths
        q_staged = jnp.take_along_axis(q, ch[:, None, :], axis=-1)
        for layer in (1, 2):
            tiers = LayerTiers(hot, host(cold, impl), scales, table, jnp.int32(layer), 1)
            staged = TG.tier_gather(tiers, runs, **impl.kw)
            got = jax.jit(lambda q, st, n, rl, r: PS.plane_scan(q, st, n, rl, resident=r, config=MMA, **impl.kw))(
                q_staged, staged, length[layer][1:], runs.slots(), PS.ResidentPlanes(tiers, ch))
            args = (scales[layer][1:], length[layer][1:], ch, dep)
            assert_within(got, np_plane_scan(q, planes[layer][1:], *args), bound(q, *args))

    def test_top_k_sets_equal_but_at_near_ties(self, impl, rng):
        """lax.top_k of the kernel's scores and the reference's: every position in one set only scores within twice
        the tolerance of the k-th largest reference score."""
        n, k = 2048, 100
        planes, scales, _ = random_store_arrays(rng, (4,), D, n)
        length = jnp.full((4,), n, jnp.int32)
        q = jnp.asarray(rng.standard_normal((4, 4, D)), jnp.float32)
        runs = PS.active_channels(depth_plan(rng, "random", (4,)))
        store = StorePlanes(planes, scales)
        got = PS.plane_scan(q, store, length, runs, config=PS.PlaneScanConfig(variant="mma", tile=512), **impl.kw)
        want = PS.plane_scan_reference(q, store, length, runs)
        limit = bound(q, scales, length, runs.channels, runs.depths)
        kth = np.asarray(jax.lax.top_k(want, k)[0])[..., -1:]
        a, b = np.asarray(jax.lax.top_k(got, k)[1]), np.asarray(jax.lax.top_k(want, k)[1])
        near = np.abs(np.asarray(want) - kth) <= 2 * TOL * limit
        differing = 0
        for r in range(4):
            for h in range(4):
                diff = np.setxor1d(a[r, h], b[r, h])
                differing += diff.size
                assert np.all(near[r, h, diff]), (r, h, diff)
        assert differing <= 4  # a tie at most here: random fp16 scales leave scores apart by far more than TOL


def test_reference_is_the_oracle():
    """The product formulation in plain jnp (signed bits, no constant term) == the code-and-offset oracle."""
    rng = np.random.default_rng(3)
    planes, scales, length = random_store_arrays(rng, (3,), D, 256)
    q = jnp.asarray(rng.standard_normal((3, 4, D)), jnp.float32)
    runs = PS.active_channels(depth_plan(rng, "random", (3,)))
    ch = runs.channels
    got = PM.plane_scan_mma_reference(jnp.take_along_axis(q, ch[:, None, :], axis=-1),
                                      jnp.take_along_axis(planes, ch[..., None, None], axis=1),
                                      jnp.take_along_axis(scales, ch[..., None], axis=1), length, runs.depths)
    assert_scores_close(got, np_plane_scan(q, planes, scales, length, ch, runs.depths))


@pytest.mark.parametrize("jit", [False, True, pytest.param(True, id="gpu", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")])])
def test_row_table_splits_weights(jit):
    """hi + lo carries each weight q 2^-e 2^-(p+1) to 22 bits, also jitted (on the GPU, XLA folds an f32 -> f16 ->
    f32 round trip away, which would leave lo = 0); rows past the read ones weigh nothing."""
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((2, 3, 5)) * 1e3, jnp.float32)
    depths = jnp.asarray([[4, 0, 2, 1, 3], [0, 0, 0, 0, 1]], jnp.int32)
    slot, plane, hi, lo, steps, unscale = (jax.jit(PM.row_table) if jit else PM.row_table)(q, depths)
    assert np.any(np.asarray(lo) != 0)
    assert hi.shape == (2, 16, 32) and np.array_equal(np.asarray(steps), [1, 1])
    w = (hi.astype(jnp.float32) + lo.astype(jnp.float32)) * unscale[:, None, None]
    want = np.take_along_axis(np.asarray(q), np.asarray(slot)[:, None, :], -1)
    want = want * 2.0 ** -(np.asarray(plane) + 1.0)[:, None]
    read = np.arange(32)[None, :] < np.asarray(depths).sum(-1)[:, None]
    np.testing.assert_allclose(np.asarray(w)[:, :3], np.where(read[:, None], want, 0.0), rtol=2.0 ** -21, atol=0)
    assert not np.any(np.asarray(w)[:, 3:])
    assert sorted(zip(np.asarray(slot[0, :10]), np.asarray(plane[0, :10]))) == [
        (0, 0), (0, 1), (0, 2), (0, 3), (2, 0), (2, 1), (3, 0), (4, 0), (4, 1), (4, 2)]


@pytest.mark.parametrize("jit", [False, True])
def test_fp16_normal_part_is_round_to_nearest_even(jit):
    """Bit for bit numpy's f32 -> f16 rounding in fp16's normal range (ties, carries into the exponent, the top of
    the range included), 0 below it."""
    rng = np.random.default_rng(8)
    w = np.ldexp(rng.uniform(0.5, 1.0, 4000), rng.integers(-30, 16, 4000)) * rng.choice([-1, 1], 4000)
    w = w.astype(np.float32)
    tie = np.asarray([1 + 2.0**-11, 1 + 3 * 2.0**-11, 2 - 2.0**-12, 2.0**-14, 65504 + 15], np.float32)
    w = np.concatenate([w, tie, -tie, np.float32([0.0, 2.0**-14 * (1 - 2.0**-12)])])
    got = np.asarray((jax.jit(PM._fp16_normal_part) if jit else PM._fp16_normal_part)(jnp.asarray(w)))
    want = np.where(np.abs(w) < 2.0**-14, 0.0, w.astype(np.float16).astype(np.float32))
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def test_lowers_to_triton_with_its_name():
    z = jnp.zeros
    q, planes, scales = z((2, 4, D)), z((2, D, 4, 20), jnp.uint32), z((2, D, 10), jnp.float16)
    ln, ch = z((2,), jnp.int32), z((2, 8), jnp.int32)
    for tile, rows in ((64, 16), (256, 32)):
        config = PS.PlaneScanConfig(variant="mma", tile=tile, rows=rows, num_warps=4)
        text = lower_triton_text(PS.plane_scan, q, StorePlanes(planes, scales), ln, RunList(ch, ch),
                                 implementation="pallas", interpret=False, config=config)
        assert text.count(f'name = "{PM.KERNEL_NAME}"') == 1 and f'name = "{PS.KERNEL_NAME}"' not in text


def test_validation():
    z = jnp.zeros
    q, planes, scales = z((2, 4, D)), z((2, D, 4, 20), jnp.uint32), z((2, D, 10), jnp.float32)
    ln, ch = z((2,), jnp.int32), z((2, 8), jnp.int32)
    with pytest.raises(TypeError, match="scales must be float16"):
        PS.plane_scan(q, StorePlanes(planes, scales), ln, RunList(ch, ch), implementation="pallas", config=MMA)
    with pytest.raises(ValueError, match="variant must be one of"):
        PS.PlaneScanConfig(variant="wgmma")
    with pytest.raises(ValueError, match="rows 16, 32 or 64"):
        PS.PlaneScanConfig(variant="mma", rows=8)
    with pytest.raises(ValueError, match="tile >= 64"):
        PS.PlaneScanConfig(variant="mma", tile=32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("budget", [32, 48, 64])
def test_native_at_128k(budget):
    """Batch 4 x 8 KV heads at 128k, D = 128, G = 4, a planner's depths: within tolerance of the lanes kernel's
    reference, top-k sets equal but at near-ties."""
    from fathom_jax import planner

    rng = np.random.default_rng(budget)
    n, d = 1 << 17, 128
    planes = jnp.asarray(rng.integers(0, 2**32, (32, d, 4, n // 32), dtype=np.uint32))
    scales = jnp.asarray(rng.uniform(0.5, 2.0, (32, d, n // 64)).astype(np.float16))
    q = jnp.asarray(rng.standard_normal((32, 4, d)), jnp.float32)
    var = jnp.asarray(np.exp(1.25 * rng.standard_normal((32, d))), jnp.float32)
    runs = PS.active_channels(planner.plan_bisection(planner.importance(q, var), budget).depths, max_active=64)
    assert int(jnp.max(jnp.sum(runs.depths > 0, -1))) < 64  # every active channel listed
    length = jnp.asarray(rng.integers(n // 2, n + 1, 32), jnp.int32)
    store = StorePlanes(planes, scales)
    got = PS.plane_scan(q, store, length, runs, config=PS.PlaneScanConfig(variant="mma", tile=256, num_warps=4))
    want = PS.plane_scan_reference(q, store, length, runs)
    limit = bound(q, scales, length, runs.channels, runs.depths)
    assert_within(got, want, limit)
    a, b = jax.lax.top_k(got, 476)[1], jax.lax.top_k(want, 476)[1]
    kth = np.asarray(jax.lax.top_k(want, 476)[0])[..., -1:]
    near = np.abs(np.asarray(want) - kth) <= 2 * TOL * limit
    a, b = np.asarray(a), np.asarray(b)
    for r in range(32):
        for h in range(4):
            assert np.all(near[r, h, np.setxor1d(a[r, h], b[r, h])])
