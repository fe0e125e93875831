"""scripts/threshold_rules.py's rules against a brute-force reference: each head, each step, each position one at a
time in plain Python (sorted lists), and the baseline against scripts/threshold_seeds.py's simulation (itself checked
against the library's kernels in tests/test_threshold_seeds.py)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax.decode.selection import ThresholdSelection
from pallas_kernels.topk_radix import INT_MIN, sortable_key
from scripts import threshold_rules as tr
from scripts import threshold_seeds
from tests.support import scores_sequence

SINK, LOCAL, BLOCK = 4, 8, 64


def data(steps=40, heads=6, seed=0):
    scores = scores_sequence(steps=steps, heads=heads, seed=seed)
    lengths = np.arange(370, 370 + steps, dtype=np.int32)  # crosses a block boundary (384)
    qnorm = np.random.default_rng(seed + 1).uniform(0.5, 2.0, (steps, heads))
    return scores, np.asarray(sortable_key(jnp.asarray(scores))), lengths, qnorm


def f32_key(x: float) -> int:
    return int(sortable_key(jnp.float32(x)))


def ref_test(key, threshold, length, kp, capacity):
    """One head's ``(overflow, few, written, reached)`` at one step, position by position."""
    newest = (length - 1) // BLOCK * BLOCK
    stop = max(SINK, min(length - LOCAL, newest))
    count = sum(1 for p in range(SINK, stop) if key[p] >= threshold)
    reached = min(count, capacity) + sum(1 for p in range(max(SINK, newest), length - LOCAL) if key[p] >= threshold)
    return count > capacity, reached < kp and count != stop - SINK, min(count, capacity), reached


def ref_kth(values, m):
    ranked = sorted(values, reverse=True)
    return int(ranked[m - 1]) if 0 < m <= len(ranked) else INT_MIN


def ref_seeded(keys, lengths, k, rank, capacity, gamma, qnorm, unit):
    """``(fail, second)`` lists of lists [P][H]."""
    kp = k - SINK - LOCAL
    steps, heads, _ = keys.shape
    threshold = [INT_MIN] * heads
    fails, seconds = [], []
    for t in range(steps):
        length = int(lengths[t])
        tests = [ref_test(keys[t, h], threshold[h], length, kp, capacity) for h in range(heads)]
        fail = [o or f for o, f, _, _ in tests]
        second = [any(fail[u - u % unit:u - u % unit + unit]) for u in range(heads)]
        nxt = []
        for h in range(heads):
            middle = [int(x) for x in keys[t, h, SINK:length - LOCAL]]
            hi = ref_kth(middle, rank * kp)
            reached, th = tests[h][3], threshold[h]
            if second[h]:
                seed = hi
            elif gamma is None:
                seed = max(hi, th)
            elif reached >= rank * kp:
                seed = hi
            elif th != INT_MIN and reached >= kp:
                s_t = float(tr.score_of(th))
                s_k = float(tr.score_of(ref_kth(middle, kp)))
                seed = f32_key(s_t - gamma * (s_k - s_t))
            else:
                seed = th
            if qnorm is not None and t + 1 < steps and seed != INT_MIN:
                seed = f32_key(float(tr.score_of(seed)) / qnorm[t, h] * qnorm[t + 1, h])
            nxt.append(seed)
        threshold = nxt
        fails.append(fail)
        seconds.append(second)
    return np.array(fails), np.array(seconds)


@pytest.mark.parametrize("k,rank,capacity,gamma,qn,unit", [
    (40, 2, 128, None, False, 1), (40, 2, 128, 1.0, False, 1), (40, 4, 256, 0.5, True, 1),
    (40, 2, 128, 2.0, True, 3), (44, 2, 64, None, True, 6)])
def test_seeded_rules_equal_the_reference(k, rank, capacity, gamma, qn, unit):
    _, keys, lengths, qnorm = data()
    got = tr.simulate_seeded(keys, lengths, k, rank=rank, capacity=capacity, gamma=gamma, qnorm=qnorm if qn else None,
                             unit=unit, sink=SINK, local=LOCAL)
    fail, second = ref_seeded(keys, lengths, k, rank, capacity, gamma, qnorm if qn else None, unit)
    np.testing.assert_array_equal(got["fail"], fail)
    np.testing.assert_array_equal(got["second"], second)
    np.testing.assert_array_equal(got["fail"], got["overflow"] | got["few"])
    if (gamma, qn, unit) == (1.0, False, 1):  # the data exercise both failures and successes
        assert got["overflow"][1:].any() and got["few"][1:].any() and not got["fail"][1:].all()


@pytest.mark.parametrize("rank,slack,coupled", [(2, 2, False), (4, 1, False), (2, 2, True)])
def test_the_baseline_is_threshold_seeds_simulation(rank, slack, coupled):
    _, keys, lengths, _ = data()
    k = 40
    capacity = ThresholdSelection(rank, slack).capacity(k - SINK - LOCAL)
    got = tr.simulate_seeded(keys, lengths, k, rank=rank, capacity=capacity, unit=keys.shape[1] if coupled else 1,
                             sink=SINK, local=LOCAL)
    want = threshold_seeds.simulate(keys, lengths, k, rank, slack, sink=SINK, local=LOCAL, coupled=coupled)
    for name in ("overflow", "few", "second", "written"):
        np.testing.assert_array_equal(got[name], want[name])


def ref_sample(keys, lengths, k, c, s, word, capacity, retry, full_below):
    """``(retried, fail, overflow, few, written)`` arrays [P, H]."""
    kp = k - SINK - LOCAL
    m = math.ceil(c * kp / s)
    steps, heads, _ = keys.shape
    out = np.zeros((5, steps, heads), np.int64)
    for t in range(steps):
        length = int(lengths[t])
        newest = (length - 1) // BLOCK * BLOCK
        stop = max(SINK, min(length - LOCAL, newest))
        picks = [p for p in range(SINK, stop) if ((p // 32) % s == 0 if word else p % s == 0)]
        for h in range(heads):
            sample = [int(keys[t, h, p]) for p in picks]
            th = INT_MIN if full_below and length - SINK - LOCAL <= capacity else ref_kth(sample, m)
            over, few, written, _ = ref_test(keys[t, h], th, length, kp, capacity)
            retried = over or few
            if retried and retry:
                th2 = ref_kth(sample, retry * m) if few else ref_kth(sample, math.ceil(m / retry))
                over, few, written2, _ = ref_test(keys[t, h], th2, length, kp, capacity)
                written += written2
            out[:, t, h] = retried, over or few, over, few, written
    return out


@pytest.mark.parametrize("c,s,word,capacity,retry,full_below", [
    (1, 4, False, 32, None, True), (1, 4, False, 32, 2, True), (1, 2, True, 40, 4, False),
    (2, 3, True, 64, 2, False), (1, 2, False, 512, 2, True), (1, 2, False, 512, None, False)])
def test_sample_rules_equal_the_reference(c, s, word, capacity, retry, full_below):
    _, keys, lengths, _ = data()
    k = 40
    got = tr.sample_rule(keys, lengths, k, c=c, s=s, word=word, capacity=capacity, retry=retry, full_below=full_below,
                         sink=SINK, local=LOCAL)
    want = ref_sample(keys, lengths, k, c, s, word, capacity, retry, full_below)
    for i, name in enumerate(("retried", "fail", "overflow", "few", "written")):
        np.testing.assert_array_equal(got[name], want[i], err_msg=name)
    if (c, s, word, capacity, retry) == (1, 4, False, 32, None):  # both failures occur
        assert got["overflow"].any() and got["few"].any() and not got["fail"].all()
    if capacity == 512 and full_below:  # the middle fits: no sample, no failure
        assert not got["fail"].any() and (got["threshold"] == INT_MIN).all()


def test_helpers():
    x = np.array([-np.inf, -2.5, -0.0, 0.0, 1e-30, 3.0, np.inf], np.float32)
    np.testing.assert_array_equal(tr.key_of(x), np.asarray(sortable_key(jnp.asarray(x))))
    np.testing.assert_array_equal(tr.score_of(tr.key_of(x)), x)
    assert tr.stride_for(92, 2, 16) == (12, 16) and tr.stride_for(92, 4, 32) == (11, 34)
    assert tr.stride_for(476, 2, 32) == (16, 60) and tr.stride_for(10, 1, 16) == (1, 10)
    assert tr.default_capacity(92) == 2048 and tr.default_capacity(476) == 8192
    np.testing.assert_array_equal(tr.sample_positions(4, 140, 2, True), [*range(4, 32), *range(64, 96), 128, 129,
                                                                         *range(130, 140)])
    np.testing.assert_array_equal(tr.sample_positions(4, 20, 8, False), [8, 16])
    # summarize: the group and layer shares of a known pattern
    fail = np.zeros((3, 6), bool)
    fail[1, 0] = fail[2, 4] = fail[2, 5] = True
    res = {"fail": fail, "overflow": fail, "few": fail & False, "written": np.ones((3, 6))}
    got = tr.summarize(res, 3)
    assert got["fail"] == 3 / 12 and got["group_any"] == 2 / 4 and got["layer_any"] == 1.0
