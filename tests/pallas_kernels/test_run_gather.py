"""Run gather: exact equality with a numpy oracle; stacked layers; pinned-host sources on the GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_base import KernelTestBase, assert_ran, assert_scores_close, assert_staged, host, random_store_arrays
from oracles import plane_scan as np_plane_scan
from oracles import run_gather as np_run_gather
from pallas_kernels import plane_scan as PS
from pallas_kernels import run_gather as RG
from pallas_kernels.operands import RunList, StorePlanes
from tests.support import lower_triton_text

D = 16


def run_list(rng, kind, r):
    c = {"random": 7, "zero": 5, "four": D, "one": 1}[kind]
    ch = jnp.asarray(rng.integers(0, D, (r, c)), jnp.int32)
    dep = {"random": rng.integers(0, 5, (r, c)), "zero": np.zeros((r, c)), "four": np.full((r, c), 4),
           "one": rng.integers(1, 5, (r, c))}[kind]
    return RunList(ch, jnp.asarray(dep, jnp.int32))


class TestRunGather(KernelTestBase):
    @pytest.mark.parametrize("n_cap,chunk,kind", [(320, 4, "random"), (64, 2, "zero"), (1216, 16, "four"),
                                                   (640, 8, "one")])
    def test_exact(self, impl, rng, n_cap, chunk, kind):
        planes, scales, _ = random_store_arrays(rng, (2, 6), D, n_cap)
        runs = run_list(rng, kind, 6)
        config = RG.RunGatherConfig(chunk=chunk)
        gather = jax.jit(lambda store: RG.run_gather(store, runs, config=config, **impl.kw))
        got = gather(StorePlanes(host(planes, impl), host(scales, impl), jnp.int32(1)))
        want_p, want_s = np_run_gather(planes[1], scales[1], runs.channels, runs.depths)
        assert_staged(got.planes, got.scales, want_p, want_s, runs.depths)
        flat = RG.run_gather(StorePlanes(planes[1], scales[1]), runs, config=config, **impl.kw)
        assert_staged(flat.planes, flat.scales, want_p, want_s, runs.depths)

    @pytest.mark.parametrize("group_start,groups", [(0, 2), (2, 3), (5, 1)])
    def test_group_window_of_stacked_store(self, impl, rng, group_start, groups):
        """Run lists over Rc groups read groups group_start.. of a stacked store (one GPU stream's share)."""
        planes, scales, _ = random_store_arrays(rng, (2, 6), D, 320)
        runs = run_list(rng, "random", groups)
        gather = jax.jit(lambda p, s, layer: RG.run_gather(StorePlanes(p, s, layer, group_start), runs,
                                                           config=RG.RunGatherConfig(chunk=4), **impl.kw))
        got = gather(host(planes, impl), host(scales, impl), jnp.int32(1))
        window = slice(group_start, group_start + groups)
        want_p, want_s = np_run_gather(planes[1][window], scales[1][window], runs.channels, runs.depths)
        assert_staged(got.planes, got.scales, want_p, want_s, runs.depths)

    @pytest.mark.parametrize("programs", [1, 7, 1 << 20])
    def test_persistent_programs_copy_every_item(self, impl, rng, programs):
        """Persistent programs (fewer than, or more than, the work items) loop over the items: the same staged
        buffers, bit for bit; an ``after`` operand orders the kernel and changes nothing."""
        planes, scales, _ = random_store_arrays(rng, (2, 6), D, 640)
        runs = run_list(rng, "random", 3)
        config = RG.RunGatherConfig(chunk=8, programs=programs)
        gather = jax.jit(lambda p, s, layer, after: RG.run_gather(StorePlanes(p, s, layer, 2), runs, after=after,
                                                                  config=config, **impl.kw))
        got = gather(host(planes, impl), host(scales, impl), jnp.int32(1), (jnp.ones((4, 3)), jnp.int32(0)))
        want_p, want_s = np_run_gather(planes[1][2:5], scales[1][2:5], runs.channels, runs.depths)
        assert_staged(got.planes, got.scales, want_p, want_s, runs.depths)

    @pytest.mark.parametrize("programs", [0, 3])
    def test_a_sorted_list_is_walked_without_its_sort(self, impl, rng, programs):
        """``runs.sorted``: a list sorted by decreasing depth (the decode step's, slots of depth 0 last) is walked as
        it is; the same buffers where the scan reads them."""
        planes, scales, _ = random_store_arrays(rng, (2, 6), D, 640)
        runs = PS.active_channels(jnp.asarray(rng.integers(0, 5, (3, D)) * (rng.random((3, D)) < 0.4), jnp.int32))
        ch, dep = runs.channels, runs.depths
        assert runs.sorted and int(jnp.sum(dep == 0)) > 0
        config = RG.RunGatherConfig(chunk=8, programs=programs)
        got = RG.run_gather(StorePlanes(host(planes, impl), host(scales, impl), 1, 1), runs, config=config, **impl.kw)
        assert_staged(got.planes, got.scales, *np_run_gather(planes[1][1:4], scales[1][1:4], ch, dep), dep)

    def test_gather_then_scan_equals_direct_scan(self, impl, rng):
        """Staged planes scanned with the identity list == the plane scan of the store itself."""
        planes, scales, length = random_store_arrays(rng, (4,), D, 448)
        q = jnp.asarray(rng.standard_normal((4, 4, D)), jnp.float32)
        runs = PS.active_channels(jnp.asarray(rng.integers(0, 5, (4, D)), jnp.int32), max_active=10)
        staged = RG.run_gather(StorePlanes(planes, scales), runs, **impl.kw)
        q_staged = jnp.take_along_axis(q, runs.channels[:, None, :], axis=-1)
        got = PS.plane_scan(q_staged, staged, length, runs.slots(), **impl.kw)
        assert_scores_close(got, np_plane_scan(q, planes, scales, length, runs.channels, runs.depths))
        assert_ran(RG.run_gather, StorePlanes(planes, scales), runs, name=RG.KERNEL_NAME, impl=impl)


def test_run_gather_lowers_to_triton_and_validates():
    z = jnp.zeros
    runs = RunList(z((2, 5), jnp.int32), z((2, 5), jnp.int32))
    text = lower_triton_text(lambda p, s, layer: RG.run_gather(StorePlanes(p, s, layer), runs, implementation="triton",
                                                                interpret=False),
                             z((3, 2, D, 4, 20), jnp.uint32), z((3, 2, D, 10), jnp.float16), jnp.int32(0))
    assert text.count(f'name = "{RG.KERNEL_NAME}"') == 1
    persistent = lower_triton_text(
        lambda p, s, layer, a: RG.run_gather(StorePlanes(p, s, layer), RunList(runs.channels, runs.depths, sorted=True),
                                             after=a, config=RG.RunGatherConfig(chunk=4, programs=3),
                                             implementation="triton", interpret=False),
        z((3, 2, D, 4, 20), jnp.uint32), z((3, 2, D, 10), jnp.float16), jnp.int32(0), z((7,), jnp.float32))
    assert persistent.count(f'name = "{RG.KERNEL_NAME}"') == 1
    assert "grid_x = 3 : i32, grid_y = 1 : i32, grid_z = 1" in persistent  # three programs walking the items
    # the kernel's operands: the run list, the layer, the store, then the `after` operand riding along
    assert "gpu.triton(%arg3, %arg4, %arg2, %arg0, %arg1, %arg5)" in persistent
    with pytest.raises(ValueError, match="depths"):
        RG.run_gather(StorePlanes(z((2, D, 4, 20), jnp.uint32), z((2, D, 10), jnp.float16)),
                      RunList(runs.channels, runs.depths + 7))
    stacked = (z((3, 2, D, 4, 20), jnp.uint32), z((3, 2, D, 10), jnp.float16))
    with pytest.raises(ValueError, match=r"1 <= Rc <= 1 \(groups 1\.\. of the store's 2\)"):
        RG.run_gather(StorePlanes(*stacked, 0, 1), runs)
    with pytest.raises(ValueError, match=r"with a layer index they must be \[L, R, D, 4, W\]"):  # one group axis
        RG.run_gather(StorePlanes(z((3, 2, 2, D, 4, 20), jnp.uint32), z((3, 2, 2, D, 10), jnp.float16), 0),
                      RunList(z((2, 2, 5), jnp.int32), z((2, 2, 5), jnp.int32)))
    with pytest.raises(ValueError, match="group_start=1 needs a stacked"):
        RG.run_gather(StorePlanes(*(a[0] for a in stacked), group_start=1), runs)
    one = RunList(z((1, 5), jnp.int32), z((1, 5), jnp.int32))
    with pytest.raises(ValueError, match="group_start must be an int >= 0"):
        RG.run_gather(StorePlanes(*stacked, 0, -1), one)
    with pytest.raises(ValueError, match="chunk must be >= 2"):
        RG.RunGatherConfig(chunk=1)
    with pytest.raises(ValueError, match="programs must be an int >= 0"):
        RG.RunGatherConfig(programs=-1)
