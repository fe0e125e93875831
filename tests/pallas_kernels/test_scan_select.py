"""The scan that selects: each head's candidates are exactly the tokens of the window whose scan score (the plane
scan's, bit for bit, on the same implementation) reaches its threshold; overflow keeps a subset and counts them all."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_base import IMPLS, KernelTestBase, assert_ran, host, random_store_arrays
from pallas_kernels import plane_scan as PS
from pallas_kernels import scan_select as SS
from pallas_kernels import tier_gather as TG
from pallas_kernels.operands import LayerTiers, ResidentPlanes, RunList, StorePlanes
from pallas_kernels.plane_layout import tier_table
from pallas_kernels.topk_radix import sortable_key
from test_tier_gather import split_tiers
from tests.support import lower_triton_text

D, G, START = 16, 3, 4


def expected(scores, threshold, stop, shift=None):
    """Per (group, head): the set of (position, score bits) passing, from written scores (numpy)."""
    scores = np.asarray(scores, np.float32)
    if shift is not None:
        scores = scores + np.asarray(shift, np.float32)[..., None]
    keys = np.asarray(sortable_key(jnp.asarray(scores)))
    pos = np.arange(scores.shape[-1])
    out = {}
    for r, h in np.ndindex(scores.shape[:2]):
        keep = (pos >= START) & (pos < int(stop[r])) & (keys[r, h] >= int(threshold[r, h]))
        out[r, h] = {(int(p), scores[r, h, p].view(np.uint32).item()) for p in pos[keep]}
    return out


def got_sets(c: SS.Candidates):
    count, position, score = (np.asarray(x) for x in (c.count, c.position, c.score))
    out = {}
    for r, h in np.ndindex(position.shape[:2]):
        n = min(int(count[r, h]), c.capacity)
        out[r, h] = {(int(p), s.view(np.uint32).item()) for p, s in zip(position[r, h, :n], score[r, h, :n])}
    return out, count


def thresholds(rng, scores, quantile):
    """Keys of a per-head quantile of the scores (ties made likely by rounding them to a grid)."""
    return sortable_key(jnp.asarray(np.quantile(np.asarray(scores), quantile, axis=-1), jnp.float32))


class TestScanSelect(KernelTestBase):
    @pytest.mark.parametrize("math", ["f32", "f16x2"])
    def test_candidates_are_the_scores_reaching_the_threshold(self, impl, rng, math):
        planes, scales, length = random_store_arrays(rng, (4,), D, 1024, length=[1024, 700, 37, 0])
        q = jnp.asarray(rng.standard_normal((4, G, D)), jnp.float32)
        runs = PS.active_channels(jnp.asarray(rng.integers(0, 5, (4, D)), jnp.int32))
        store, config = StorePlanes(planes, scales), PS.PlaneScanConfig(math=math)
        shift = jnp.asarray(rng.standard_normal((4, G)), jnp.float32)
        scores = PS.plane_scan(q, store, length, runs, config=config, **impl.kw)
        stop = jnp.maximum(length - 32, 0)
        threshold = thresholds(rng, scores + shift[..., None], 0.9)
        got = SS.scan_select(q, store, length, runs, threshold, stop, start=START, capacity=256, shift=shift,
                             config=config, **impl.kw)
        sets, count = got_sets(got)
        want = expected(scores, threshold, stop, shift)
        assert sets == want
        assert [count[r, h] for r, h in want] == [len(s) for s in want.values()]
        assert np.all(count[:, G:] == 0)  # the counts' padding
        assert_ran(SS.scan_select, q, store, length, runs, threshold, stop, name=SS.KERNEL_NAME + (
            "" if math == "f32" else "_f16x2"), impl=impl, start=START, capacity=256, config=config)

    def test_overflow_keeps_a_subset_and_counts_all(self, impl, rng):
        planes, scales, length = random_store_arrays(rng, (2,), D, 2048, length=2048)
        q = jnp.asarray(rng.standard_normal((2, G, D)), jnp.float32)
        runs = PS.active_channels(jnp.asarray(rng.integers(0, 5, (2, D)), jnp.int32))
        store = StorePlanes(planes, scales)
        scores = PS.plane_scan(q, store, length, runs, **impl.kw)
        stop = length - 32
        threshold = thresholds(rng, scores, 0.5)  # ~1000 pass, 64 slots
        sets, count = got_sets(SS.scan_select(q, store, length, runs, threshold, stop, start=START, capacity=64,
                                              **impl.kw))
        want = expected(scores, threshold, stop)
        for key, passing in want.items():
            assert count[key] == len(passing) > 64 and len(sets[key]) == 64 and sets[key] <= passing

    def test_stacked_layer_window_and_resident_planes(self, impl, rng):
        """A stacked store at a layer for a window of its groups, and a staged buffer with resident planes from a hot
        tier: the candidates of the plane scan's scores of the same operands."""
        planes, scales, length = random_store_arrays(rng, (3, 4), D, 1024)
        q = jnp.asarray(rng.standard_normal((2, G, D)), jnp.float32)
        runs = PS.active_channels(jnp.asarray(rng.integers(0, 5, (2, D)), jnp.int32), max_active=10)
        store = StorePlanes(host(planes, impl), host(scales, impl), jnp.int32(2), 1)
        ln, stop = length[2][1:3], jnp.maximum(length[2][1:3] - 32, 0)
        scores = PS.plane_scan(q, store, ln, runs, **impl.kw)
        threshold = thresholds(rng, scores, 0.8)
        sets, _ = got_sets(SS.scan_select(q, store, ln, runs, threshold, stop, start=START, capacity=512, **impl.kw))
        assert sets == expected(scores, threshold, stop)
        resident = (1, 2, 0)
        hot, cold = split_tiers(planes, resident)
        tiers = LayerTiers(hot, host(cold, impl), scales, jnp.asarray(tier_table(resident)), jnp.int32(1), 1)
        staged = TG.tier_gather(tiers, runs, **impl.kw)
        q_staged = jnp.take_along_axis(q, runs.channels[:, None, :], axis=-1)
        res, ln = ResidentPlanes(tiers, runs.channels), length[1][1:3]
        scores = PS.plane_scan(q_staged, staged, ln, runs.slots(), resident=res, **impl.kw)
        stop = jnp.maximum(ln - 32, 0)
        threshold = thresholds(rng, scores, 0.8)
        sets, _ = got_sets(SS.scan_select(q_staged, staged, ln, runs.slots(), threshold, stop, start=START,
                                          capacity=512, resident=res, **impl.kw))
        assert sets == expected(scores, threshold, stop)


def test_scan_select_lowers_to_triton():
    """Both arithmetics lower to Triton IR for an H200 (the atomic, the prefix sums, the scatter stores)."""
    z = jnp.zeros
    q, planes, scales = z((2, G, D)), z((2, D, 4, 20), jnp.uint32), z((2, D, 10), jnp.float16)
    ln, ch, thr = z((2,), jnp.int32), z((2, 8), jnp.int32), z((2, G), jnp.int32)
    for math in ("f32", "f16x2"):
        text = lower_triton_text(SS.scan_select, q, StorePlanes(planes, scales), ln, RunList(ch, ch), thr, ln,
                                 start=4, capacity=64, shift=z((2, G)), implementation="triton", interpret=False,
                                 config=PS.PlaneScanConfig(math=math))
        name = SS.KERNEL_NAME + ("" if math == "f32" else "_f16x2")
        assert text.count(f'name = "{name}"') == 1


def test_scan_select_validation():
    z = jnp.zeros
    q, planes, scales = z((2, G, D)), z((2, D, 4, 20), jnp.uint32), z((2, D, 10), jnp.float16)
    ln, ch, thr = z((2,), jnp.int32), z((2, 8), jnp.int32), z((2, G), jnp.int32)
    store, runs = StorePlanes(planes, scales), RunList(ch, ch)
    with pytest.raises(ValueError, match="threshold must be int32 keys"):
        SS.scan_select(q, store, ln, runs, thr[:, :2], ln, start=4, capacity=64)
    with pytest.raises(TypeError, match="threshold"):
        SS.scan_select(q, store, ln, runs, thr.astype(jnp.float32), ln, start=4, capacity=64)
    with pytest.raises(ValueError, match="capacity must be a power of two"):
        SS.scan_select(q, store, ln, runs, thr, ln, start=4, capacity=100)
    with pytest.raises(ValueError, match="stop must be"):
        SS.scan_select(q, store, ln, runs, thr, z((3,), jnp.int32), start=4, capacity=64)
    with pytest.raises(ValueError, match="shift must be"):
        SS.scan_select(q, store, ln, runs, thr, ln, start=4, capacity=64, shift=z((2,)))
    assert jax.eval_shape(lambda: SS.scan_select(q, store, ln, runs, thr, ln, start=4, capacity=64)).count.shape == (
        2, 4)


@pytest.mark.parametrize("impl", [p for p in IMPLS if p.id != "xla"])
def test_kernel_equals_reference_set(impl):
    """The kernel's candidate sets and the reference's agree where both score alike (integer-valued scores)."""
    rng = np.random.default_rng(5)
    planes, scales, length = random_store_arrays(rng, (2,), D, 512, length=500)
    scales = jnp.ones_like(scales)  # unit scales and integer queries: every score an exact small multiple of 1/8
    q = jnp.asarray(rng.integers(-3, 4, (2, G, D)), jnp.float32)
    runs = PS.active_channels(jnp.asarray(rng.integers(0, 5, (2, D)), jnp.int32))
    store, stop = StorePlanes(planes, scales), length - 32
    threshold = sortable_key(jnp.zeros((2, G), jnp.float32))
    want, _ = got_sets(SS.scan_select_reference(q, store, length, runs, threshold, stop, start=START, capacity=512))
    got, _ = got_sets(SS.scan_select(q, store, length, runs, threshold, stop, start=START, capacity=512, **impl.kw))
    assert got == want


class TestSampleThreshold(KernelTestBase):
    @pytest.mark.parametrize("stride", [1, 4, 16])
    def test_mth_best_of_every_strideth_token(self, impl, rng, stride):
        """Integer queries and unit scales (every score exact in f32): the kernel's key is the numpy oracle's, the
        ``m``-th best of the window's every ``stride``-th token (the lowest int32 where fewer)."""
        planes, scales, length = random_store_arrays(rng, (3,), D, 2048, length=[2048, 1500, 90])
        scales = jnp.ones_like(scales)
        q = jnp.asarray(rng.integers(-3, 4, (3, G, D)), jnp.float32)
        runs = PS.active_channels(jnp.asarray(rng.integers(0, 5, (3, D)), jnp.int32))
        store, stop, shift = StorePlanes(planes, scales), length - 32, jnp.asarray(rng.integers(-2, 3, (3, G)),
                                                                                  jnp.float32)
        got = np.asarray(SS.sample_threshold(q, store, length, runs, stop, start=START, m=10, stride=stride,
                                             shift=shift, **impl.kw))
        scores = np.asarray(PS.plane_scan(q, store, length, runs, implementation="xla")) + np.asarray(shift)[..., None]
        keys = np.asarray(sortable_key(jnp.asarray(scores)))
        for r, h in np.ndindex(3, G):
            pos = np.arange(START, int(stop[r]))
            sample = sorted(keys[r, h, pos[pos % stride == 0]].tolist(), reverse=True)
            assert got[r, h] == (sample[9] if len(sample) >= 10 else -2**31), (r, h)
        assert_ran(SS.sample_threshold, q, store, length, runs, stop, name=SS.SAMPLE_NAME, impl=impl, start=START,
                   m=10, stride=stride)


def test_sample_threshold_lowers_to_triton():
    z = jnp.zeros
    q, planes, scales = z((2, G, D)), z((2, D, 4, 20), jnp.uint32), z((2, D, 10), jnp.float16)
    ln, ch = z((2,), jnp.int32), z((2, 8), jnp.int32)
    text = lower_triton_text(SS.sample_threshold, q, StorePlanes(planes, scales), ln, RunList(ch, ch), ln, start=4,
                             m=8, stride=16, implementation="triton", interpret=False)
    assert text.count(f'name = "{SS.SAMPLE_NAME}"') == 1 and 'name = "kth_largest"' in text
