"""Plane scan: every implementation == an independent numpy oracle == q . store.dequantize; stacked layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import store as S
from kernel_test_base import KernelTestBase, assert_ran, assert_scores_close, host, random_store_arrays
from oracles import plane_scan as np_plane_scan
from pallas_kernels import plane_scan as PS
from pallas_kernels.operands import RunList, StorePlanes
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
    with pytest.raises(ValueError, match=r"with a layer index they must be \[L, R, D, 4, W\]"):
        PS.plane_scan(q, StorePlanes(planes, scales, 0), ln, runs, implementation="triton")
    # value checks are skipped (not failed) under jit: the caller owns them there
    jax.jit(lambda c: PS.plane_scan(q, store, ln, RunList(c, c), implementation="xla"))(ch)
