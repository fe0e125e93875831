"""Plane scan: every implementation == an independent numpy oracle == q . store.dequantize; stacked layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import store as S
from kernel_test_base import IMPLS, KernelTestBase, assert_ran, assert_scores_close, host, random_store_arrays
from oracles import plane_scan as np_plane_scan
from pallas_kernels import plane_scan as PS
from pallas_kernels import tier_gather as TG
from pallas_kernels.operands import LayerTiers, RunList, StorePlanes
from pallas_kernels.plane_layout import tier_table
from test_tier_gather import split_tiers
from tests.support import lower_triton_text

D, G = 16, 4


def depth_plan(rng, kind, batch):
    if kind == "random":
        return jnp.asarray(rng.integers(0, 5, (*batch, D)), jnp.int32)
    if kind == "zero":
        return jnp.zeros((*batch, D), jnp.int32)
    if kind == "four":
        return jnp.full((*batch, D), 4, jnp.int32)
    dep = np.zeros((*batch, D), np.int32)  # "one": one active channel at a random depth
    dep[..., rng.integers(D)] = rng.integers(1, 5)
    return jnp.asarray(dep)


class TestPlaneScan(KernelTestBase):
    @pytest.mark.parametrize("kind,n_cap,config", [
        ("random", 320, PS.PlaneScanConfig(tile=512, lanes=16)),
        ("zero", 64, PS.PlaneScanConfig(tile=1024, lanes=16, num_warps=2)),
        ("four", 1984, PS.PlaneScanConfig(tile=256, lanes=8, num_warps=2)),
        ("one", 1024, PS.PlaneScanConfig(tile=1024, lanes=32)),
    ], ids=["random-320-l16", "zero-64-l16", "four-1984-l8", "one-1024-l32"])
    def test_matches_numpy_oracle(self, impl, rng, kind, n_cap, config):
        planes, scales, length = random_store_arrays(rng, (6,), D, n_cap)
        q = jnp.asarray(rng.standard_normal((6, G, D)), jnp.float32)
        runs = PS.active_channels(depth_plan(rng, kind, (6,)), max_active=D)
        got = PS.plane_scan(q, StorePlanes(planes, scales), length, runs, config=config, **impl.kw)
        assert got.shape == (6, G, n_cap)
        assert_scores_close(got, np_plane_scan(q, planes, scales, length, runs.channels, runs.depths))

    @pytest.mark.parametrize("rotate", [False, True])
    def test_equals_dequantized_store(self, impl, rng, rotate):
        """Raw and KLT stores: the scan is q . dequantize(store, depth) (queries in the store basis)."""
        n = 200  # not a multiple of the tile nor of 64
        keys = jnp.asarray(rng.standard_normal((2, n, D)) * np.exp(rng.normal(0, 1, D)), jnp.float32)
        rotation = None
        if rotate:
            basis = np.linalg.qr(rng.standard_normal((D, D)))[0].astype(np.float32)
            rotation = S.KeyRotation(mean=jnp.asarray(rng.standard_normal((2, D)), jnp.float32),
                                     basis=jnp.asarray(np.broadcast_to(basis, (2, D, D))))
        st = S.build_store(keys, capacity=320, rotation=rotation)
        q = S.rotate_queries(jnp.asarray(rng.standard_normal((2, G, D)), jnp.float32), rotation)
        depths = depth_plan(rng, "random", (2,))
        got = PS.plane_scan_store(q, st, depths, **impl.kw)
        assert_scores_close(got, jnp.einsum("bgd,bnd->bgn", q, S.dequantize(st, depths), precision="highest"))

    def test_stacked_layer_read_in_place(self, impl, rng):
        """A stacked [L, R, ...] store read at a (traced) layer == the scan of that layer's arrays."""
        planes, scales, length = random_store_arrays(rng, (3, 4), D, 448)
        q = jnp.asarray(rng.standard_normal((4, G, D)), jnp.float32)
        runs = PS.active_channels(depth_plan(rng, "random", (4,)), max_active=10)
        scan = jax.jit(lambda store: PS.plane_scan(q, store, length[1], runs, **impl.kw))
        for layer in (0, 2):
            got = scan(StorePlanes(host(planes, impl), host(scales, impl), jnp.int32(layer)))
            assert_scores_close(got, np_plane_scan(q, planes[layer], scales[layer], length[1], runs.channels,
                                                   runs.depths))

    @pytest.mark.parametrize("group_start,groups", [(1, 3), (3, 1)])
    def test_group_window_of_stacked_store(self, impl, rng, group_start, groups):
        """Queries over Rc groups scan groups group_start.. of a stacked store (one GPU stream's share)."""
        planes, scales, length = random_store_arrays(rng, (3, 4), D, 448)
        q = jnp.asarray(rng.standard_normal((groups, G, D)), jnp.float32)
        runs = PS.active_channels(depth_plan(rng, "random", (groups,)), max_active=10)
        window = slice(group_start, group_start + groups)
        scan = jax.jit(lambda p, s: PS.plane_scan(q, StorePlanes(p, s, jnp.int32(2), group_start), length[1][window],
                                                  runs, **impl.kw))
        got = scan(host(planes, impl), host(scales, impl))
        assert_scores_close(got, np_plane_scan(q, planes[2][window], scales[2][window], length[1][window],
                                               runs.channels, runs.depths))

    def test_unsorted_list_and_determinism(self, impl, rng):
        planes, scales, length = random_store_arrays(rng, (3,), D, 640)
        q = jnp.asarray(rng.standard_normal((3, G, D)), jnp.float32)
        ch = jnp.asarray(rng.permutation(D)[:9][None].repeat(3, 0), jnp.int32)  # unsorted depths
        dep = jnp.asarray(rng.integers(0, 5, (3, 9)), jnp.int32)
        store, runs = StorePlanes(planes, scales), RunList(ch, dep)
        a = PS.plane_scan(q, store, length, runs, **impl.kw)
        assert np.array_equal(np.asarray(a), np.asarray(PS.plane_scan(q, store, length, runs, **impl.kw)))
        assert_scores_close(a, np_plane_scan(q, planes, scales, length, ch, dep))
        assert_ran(PS.plane_scan, q, store, length, runs, name=PS.KERNEL_NAME, impl=impl)


def assert_within_f16x2_bound(got, want, q, store, runs, length):
    """The packed-f16 scan's scores within their stated bound of the exact ones (0 past each group's length)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    bound = np.asarray(PS.f16x2_error_bound(q, store, runs), np.float64)[..., None, :]
    valid = np.arange(got.shape[-1]) < np.asarray(length)[..., None, None]
    assert np.all(got[~np.broadcast_to(valid, got.shape)] == 0)
    excess = np.abs(got - want) - bound
    assert np.all(excess[np.broadcast_to(valid, got.shape)] <= 1e-6 * max(1.0, float(np.max(np.abs(want))))), \
        float(np.max(excess))


class TestPlaneScanF16x2(KernelTestBase):
    """``math="f16x2"`` (pairs of tokens in packed f16): scores within :func:`f16x2_error_bound` of the exact ones on
    every path (plain store, stacked layer, resident planes), interpreted (the f16 FMA emulated) and on the GPU."""

    CONFIG = PS.PlaneScanConfig(math="f16x2")

    def test_within_bound_of_oracle(self, impl, rng):
        """Groups of every kind of plan (random depths, all at 4, one channel, none), and two of extreme scales:
        sums far past f16's range (scales ~6e4, queries x100) and far below it (scales ~1e-4) keep f16's relative
        precision, since each thread scales its weights by a power of two first (one compile: one shape)."""
        n_cap = 1984
        planes, scales, length = random_store_arrays(rng, (6,), D, n_cap)
        scales = scales.at[4].set(6e4).at[5].set(1e-4)
        q = rng.standard_normal((6, G, D)) * np.exp(rng.normal(0, 1.5, D))
        q[4:] *= 100
        q = jnp.asarray(q, jnp.float32)
        depths = jnp.concatenate([depth_plan(rng, kind, (1,)) for kind in ("random", "four", "one", "zero")]
                                 + [jnp.full((2, D), 4, jnp.int32)])
        runs = PS.active_channels(depths, max_active=D)
        store = StorePlanes(planes, scales)
        got = PS.plane_scan(q, store, length, runs, config=self.CONFIG, **impl.kw)
        want = np_plane_scan(q, planes, scales, length, runs.channels, runs.depths)
        if not impl.is_kernel:  # the reference is the exact scan whatever the kernel's arithmetic
            assert_scores_close(got, want)
            return
        assert_within_f16x2_bound(got, want, q, store, runs, length)
        full = np.asarray(length[4:]) > 0
        rel = np.linalg.norm(np.asarray(got - want)[4:], axis=-1) / np.maximum(
            np.linalg.norm(np.asarray(want)[4:], axis=-1), 1e-30)
        assert np.all(rel[full] < 2e-3), rel
        assert_ran(PS.plane_scan, q, store, length, runs, name=f"{PS.KERNEL_NAME}_f16x2", impl=impl,
                   config=self.CONFIG)

    @pytest.mark.parametrize("impl", [p for p in IMPLS if p.id != "interpret"])  # interpreted: the same reads as f32's
    def test_stacked_layer_and_resident_planes(self, impl, rng):
        """A stacked store read at a layer, and a staged buffer whose resident planes come from a hot tier in place:
        both within the bound of the one-tier oracle."""
        planes, scales, length = random_store_arrays(rng, (3, 4), D, 1024)
        q = jnp.asarray(rng.standard_normal((4, G, D)), jnp.float32)
        runs = PS.active_channels(depth_plan(rng, "random", (4,)), max_active=10)
        got = jax.jit(lambda p, s: PS.plane_scan(q, StorePlanes(p, s, jnp.int32(2)), length[2], runs,
                                                 config=self.CONFIG, **impl.kw))(host(planes, impl), host(scales, impl))
        want = np_plane_scan(q, planes[2], scales[2], length[2], runs.channels, runs.depths)
        if impl.is_kernel:
            assert_within_f16x2_bound(got, want, q, StorePlanes(planes[2], scales[2]), runs, length[2])
        resident = (1, 2, 0)
        hot, cold = split_tiers(planes, resident)
        tiers = LayerTiers(hot, host(cold, impl), scales, jnp.asarray(tier_table(resident)), jnp.int32(1))
        staged = TG.tier_gather(tiers, runs, **impl.kw)
        q_staged = jnp.take_along_axis(q, runs.channels[:, None, :], axis=-1)
        got = PS.plane_scan(q_staged, staged, length[1], runs.slots(), resident=PS.ResidentPlanes(tiers, runs.channels),
                            config=self.CONFIG, **impl.kw)
        want = np_plane_scan(q, planes[1], scales[1], length[1], runs.channels, runs.depths)
        if impl.is_kernel:
            assert_within_f16x2_bound(got, want, q, StorePlanes(planes[1], scales[1]), runs, length[1])
        else:
            assert_scores_close(got, want)


def test_plane_scan_lowers_to_triton():
    """The kernel lowers to Triton IR for an H200 (CPU-side check of the GPU path), flat and stacked."""
    z = jnp.zeros
    q, planes, scales = z((2, G, D)), z((2, D, 4, 20), jnp.uint32), z((2, D, 10), jnp.float16)
    ln, ch = z((2,), jnp.int32), z((2, 8), jnp.int32)
    for lanes in (8, 16, 32):
        config = PS.PlaneScanConfig(lanes=lanes, tile=32 * lanes)
        text = lower_triton_text(PS.plane_scan, q, StorePlanes(planes, scales), ln, RunList(ch, ch),
                                 implementation="triton", interpret=False, config=config)
        assert text.count(f'name = "{PS.KERNEL_NAME}"') == 1
    text = lower_triton_text(lambda p, s, layer: PS.plane_scan(q, StorePlanes(p, s, layer), ln, RunList(ch, ch),
                                                                 implementation="triton", interpret=False),
                             z((3, 2, D, 4, 20), jnp.uint32), z((3, 2, D, 10), jnp.float16), jnp.int32(1))
    assert text.count(f'name = "{PS.KERNEL_NAME}"') == 1
    text = lower_triton_text(PS.plane_scan, q, StorePlanes(planes, scales), ln, RunList(ch, ch),
                             implementation="triton", interpret=False, config=PS.PlaneScanConfig(math="f16x2"))
    assert text.count(f'name = "{PS.KERNEL_NAME}_f16x2"') == 1 and "fma.rn.f16x2" in text


def test_plane_scan_validation():
    z = jnp.zeros
    q, planes, scales = z((2, G, D)), z((2, D, 4, 20), jnp.uint32), z((2, D, 10), jnp.float16)
    ln, ch = z((2,), jnp.int32), z((2, 8), jnp.int32)
    store, runs = StorePlanes(planes, scales), RunList(ch, ch)
    with pytest.raises(ValueError, match="implementation must be one of"):
        PS.plane_scan(q, store, ln, runs, implementation="cuda")
    with pytest.raises(ValueError, match="store.scales"):
        PS.plane_scan(q, StorePlanes(planes, scales[..., :3]), ln, runs)
    with pytest.raises(TypeError, match="store.planes"):
        PS.plane_scan(q, StorePlanes(planes.astype(jnp.int32), scales), ln, runs)
    with pytest.raises(ValueError, match="depths"):
        PS.plane_scan(q, store, ln, RunList(ch, ch + 5))
    with pytest.raises(ValueError, match="power of two"):
        PS.PlaneScanConfig(tile=96)
    with pytest.raises(ValueError, match="lanes"):
        PS.PlaneScanConfig(tile=256, lanes=16)
    with pytest.raises(ValueError, match="math must be one of"):
        PS.PlaneScanConfig(math="bf16")
    with pytest.raises(ValueError, match="needs lanes=32"):
        PS.PlaneScanConfig(math="f16x2", lanes=16)
    assert PS.PlaneScanConfig(math="f16x2") == PS.PlaneScanConfig(tile=1024, lanes=32, math="f16x2")
    with pytest.raises(ValueError, match=r"with a layer index they must be \[L, R, D, 4, W\]"):
        PS.plane_scan(q, StorePlanes(planes, scales, 0), ln, runs, implementation="triton")
    # value checks are skipped (not failed) under jit: the caller owns them there
    jax.jit(lambda c: PS.plane_scan(q, store, ln, RunList(c, c), implementation="xla"))(ch)
