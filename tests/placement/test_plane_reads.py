"""Plane read frequencies and bit shares: hand-computed plans (Appendix A's group), the planner as reference."""

import numpy as np
import pytest

from fathom_jax import calibrate
from fathom_jax import planner as planner_lib
from fathom_jax.methods import Fathom, FathomKLT, SparQ
from fathom_jax.placement.plane_reads import PlaneReads, plan_depths, plane_read_counts, plane_reads, plane_reuse


def stats(variance) -> calibrate.Calibration:
    variance = np.asarray(variance, np.float32)
    d = variance.shape[-1]
    eye = np.broadcast_to(np.eye(d, dtype=np.float32), variance.shape + (d,))
    return calibrate.from_arrays(variance=variance, mean=np.zeros_like(variance), basis=eye, eigenvalues=variance,
                                 ds_order=np.argsort(-variance, axis=-1), loki_basis=eye)


def test_counts_are_the_channel_reads_that_include_each_plane():
    depths = np.array([[0, 1, 2, 4], [3, 0, 0, 1]], np.int32)
    # plane 0: every nonzero depth (5); plane 1: depths 2, 4, 3; plane 2: 4, 3; plane 3: 4
    assert plane_read_counts(depths).tolist() == [5, 3, 2, 1]


def test_shares_from_frequencies_by_hand():
    reads = PlaneReads(np.array([[1.0, 0.5, 0.25, 0.0]]), head_dim=4)
    # plane bits 4, 2, 1, 0 per token; 4 channels read, so 4 x 16 / 64 = 1 scale bit
    np.testing.assert_allclose(reads.plane_bits, [[4, 2, 1, 0]])
    np.testing.assert_allclose(reads.code_bits, [7])
    np.testing.assert_allclose(reads.scale_bits, [1])
    np.testing.assert_allclose(reads.bits, [8])
    np.testing.assert_allclose(reads.code_share, [[4 / 7, 2 / 7, 1 / 7, 0]])
    np.testing.assert_allclose(reads.scale_share, [1 / 8])
    np.testing.assert_allclose(reads.resident_share, [[0, 5 / 8, 7 / 8, 1, 1]])


def test_appendix_group_at_two_budgets_by_hand(appendix):
    # g = sum_h q^2 var = [10, 5, 5, 0.05] x var = [12.22, 3.775, 0.635, 5e-5]. Marginal gains g 4^-t, largest first:
    # 12.22 (ch 0), 3.775 (ch 1), 3.055 (ch 0), 0.944 (ch 1), 0.764 (ch 0), 0.635 (ch 2), 0.236, ...
    # budget 6 -> depths [3, 2, 1, 0]; budget 2 -> [1, 1, 0, 0].
    q = np.stack([appendix.q[None, None]] * 2)  # [L = 2, P = 1, Hkv = 1, G = 2, D = 4]
    calib = stats(np.stack([appendix.var[None]] * 2))  # [L, Hkv]
    reads = plane_reads([Fathom(6), Fathom(2)], q, calib)
    np.testing.assert_allclose(reads.read_frequency, [[3 / 4, 2 / 4, 1 / 4, 0], [2 / 4, 0, 0, 0]])
    np.testing.assert_allclose(reads.code_bits, [6, 2])
    np.testing.assert_allclose(reads.code_share, [[3 / 6, 2 / 6, 1 / 6, 0], [1, 0, 0, 0]])
    np.testing.assert_allclose(reads.scale_bits, [0.75, 0.5])
    # pooled: plane bits [3 + 2, 2, 1, 0] of 8 code bits; 1.25 scale bits of 9.25
    np.testing.assert_allclose(reads.overall_code_share, [5 / 8, 2 / 8, 1 / 8, 0])
    np.testing.assert_allclose(reads.overall_scale_share, 1.25 / 9.25)
    np.testing.assert_allclose(reads.overall_resident_share, [0, 6.25 / 9.25, 8.25 / 9.25, 1, 1])
    summary = reads.summary()
    assert summary["per_layer"]["read_frequency"] == reads.read_frequency.tolist()
    assert summary["bits"] == pytest.approx((6.75 + 2.5) / 2)


@pytest.mark.parametrize("planner", ["bisection", "exact"])
def test_frequencies_match_the_planners_depths(rng, planner):
    layers, positions, hkv, g, d, budget = 3, 4, 2, 3, 16, 20
    q = rng.standard_normal((layers, positions, hkv, g, d)).astype(np.float32)
    var = np.exp(1.25 * rng.standard_normal((layers, hkv, d))).astype(np.float32)
    reads = plane_reads(Fathom(budget, planner=planner), q, stats(var))
    plan = planner_lib.plan(planner_lib.importance(q, var[:, None]), budget, method=planner)  # [L, P, Hkv, D]
    depths = np.asarray(plan.depths)
    expect = np.stack([(depths > i).mean(axis=(1, 2, 3)) for i in range(4)], axis=1)
    np.testing.assert_array_equal(reads.read_frequency, expect)
    np.testing.assert_allclose(reads.bits, np.asarray(plan.bits_per_token).mean(axis=(1, 2)), rtol=1e-6)
    np.testing.assert_allclose(reads.code_share.sum(axis=1), 1.0)
    assert np.all(np.diff(reads.read_frequency, axis=1) <= 0)
    np.testing.assert_array_equal(plan_depths(Fathom(budget, planner=planner), q, stats(var)), depths)


def _reuse_by_sets(depths, resident, window):
    """The cache as sets of (group, channel, plane) read by each step: what :func:`plane_reuse` counts."""
    t_steps, *groups, d = depths.shape
    flat = depths.reshape(t_steps, -1, d)
    reads = [{(n, c, i) for n in range(flat.shape[1]) for c in range(d) for i in range(resident, flat[t, n, c])}
             for t in range(t_steps)]
    read = new = 0
    kept = []
    for t in range(window, t_steps):
        held = set().union(*reads[t - window:t])
        read += len(reads[t])
        new += len(reads[t] - held)
        kept.append([len({x for x in reads[t] | held if x[0] == n}) for n in range(flat.shape[1])])
    steps_groups = (t_steps - window) * flat.shape[1]
    return read / steps_groups, new / max(read, 1), np.mean(kept), np.max(kept)


@pytest.mark.parametrize("resident,window", [(0, 1), (1, 1), (1, 3), (2, 2), (4, 1)])
def test_plane_reuse_counts_what_a_cache_of_the_last_steps_lacks(rng, resident, window):
    depths = rng.integers(0, 5, size=(7, 2, 3, 6))  # [T, batch, Hkv, D]
    reuse = plane_reuse(depths, resident, window)
    read, new, held_mean, held_max = _reuse_by_sets(depths, resident, window)
    assert (reuse.read, reuse.held_mean, reuse.held_max) == pytest.approx((read, held_mean, held_max))
    assert reuse.new == pytest.approx(new)


def test_plane_reuse_by_hand():
    # one group, two channels; steps read depths (3, 1), (2, 2), (3, 2) with plane 0 resident
    depths = np.array([[[3, 1]], [[2, 2]], [[3, 2]]])
    reuse = plane_reuse(depths, resident=1, window=1)
    # step 1 reads planes 1 of ch 0 and 1 of ch 1 (2); the cache of step 0 holds 1-2 of ch 0: new = ch 1's plane 1.
    # step 2 reads 1-2 of ch 0 and 1 of ch 1 (3); step 1 held 1 of ch 0 and 1 of ch 1: new = ch 0's plane 2.
    assert (reuse.read, reuse.new) == (2.5, 2 / 5)
    assert (reuse.held_mean, reuse.held_max) == (3.0, 3)
    with pytest.raises(ValueError, match="T > window"):
        plane_reuse(depths, resident=1, window=3)
    with pytest.raises(ValueError, match="resident must lie"):
        plane_reuse(depths, resident=5, window=1)


def test_bad_inputs_raise_clear_errors(rng):
    q = rng.standard_normal((2, 3, 2, 8)).astype(np.float32)  # [L, Hkv, G, D]
    calib = stats(np.ones((2, 3, 8)))
    with pytest.raises(TypeError, match="must be Fathom"):
        plane_reads(FathomKLT(8), q, calib)
    with pytest.raises(TypeError, match="must be Fathom"):
        plane_reads(SparQ(2), q, calib)
    with pytest.raises(ValueError, match="one per layer"):
        plane_reads([Fathom(8)] * 3, q, calib)
    with pytest.raises(ValueError, match="budget must lie in"):
        plane_reads(Fathom(33), q, calib)
    with pytest.raises(ValueError, match="head_dim 4 does not match"):
        plane_reads(Fathom(8), q[..., :4], calib)
    with pytest.raises(ValueError, match="layers first"):
        plane_reads(Fathom(8), q, stats(np.ones((3, 3, 8))))
    with pytest.raises(ValueError, match="trailing axes"):
        plane_reads(Fathom(8), q, stats(np.ones((2, 4, 8))))
    with pytest.raises(ValueError, match=r"\[L, \*B, G, D\]"):
        plane_reads(Fathom(8), q[0, 0], calib)
    with pytest.raises(ValueError, match="not increase"):
        PlaneReads(np.array([[0.5, 0.6, 0.0, 0.0]]), head_dim=4)
    with pytest.raises(ValueError, match=r"\[layers, 4\]"):
        PlaneReads(np.zeros((2, 3)), head_dim=4)

