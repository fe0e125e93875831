"""scripts/threshold_seeds.py's simulation against the library's own decisions, step by step: the candidates a scan
keeps (built here by brute force), :func:`pallas_kernels.candidate_topk.candidate_topk_reference`'s ``failed``, the
next seed (by hand: the library no longer seeds from the previous step) and on the second path
:func:`fathom_jax.select.kth_largest_middle`."""

import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax.decode.selection import ThresholdSelection
from fathom_jax.format import BLOCK_TOKENS
from fathom_jax.select import kth_largest_middle
from pallas_kernels.candidate_topk import candidate_topk_reference
from pallas_kernels.topk_radix import INT_MIN, sortable_key
from scripts import threshold_seeds
from tests.support import scores_sequence

SINK, LOCAL = 4, 8


def reference(scores, lengths, k, rank, slack, coupled):
    """``(second [P, H], failed [P, H])`` by the library's selection code, one step at a time."""
    steps, heads, n = scores.shape
    kp = k - SINK - LOCAL
    capacity = ThresholdSelection(rank, slack).capacity(kp)
    threshold = jnp.full((1, heads), INT_MIN, jnp.int32)
    second, failed_all = [], []
    for t, length in enumerate(lengths):
        s = jnp.asarray(scores[t])
        keys = np.asarray(sortable_key(s))
        newest = (length - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        stop = min(length - LOCAL, newest)
        count = np.zeros((1, 4), np.int32)  # [R, Gp]
        position = np.zeros((1, heads, capacity + 1), np.int32)
        score = np.zeros((1, heads, capacity + 1), np.float32)
        for h in range(heads):
            passed = [i for i in range(SINK, stop) if keys[h, i] >= int(threshold[0, h])]
            count[0, h] = len(passed)
            kept = passed[:capacity]
            position[0, h, :len(kept)], score[0, h, :len(kept)] = kept, scores[t, h, kept]
        extra_position = newest + np.arange(BLOCK_TOKENS, dtype=np.int32)
        extra_score = scores[t][:, np.minimum(extra_position, n - 1)]
        _, failed = candidate_topk_reference(
            jnp.asarray(count), jnp.asarray(position), jnp.asarray(score), jnp.asarray([length], jnp.int32),
            threshold, jnp.asarray([stop], jnp.int32), jnp.asarray(extra_position[None]),
            jnp.asarray(extra_score[None]), k=k, sink=SINK, local=LOCAL)
        fail = np.asarray(failed[0]) > 0
        seed = np.zeros((1, heads), np.int32)
        extra_ok = (extra_position >= SINK) & (extra_position < length - LOCAL)
        for h in range(heads):  # the (rank k')-th best candidate reaching the threshold, never below it
            held = np.concatenate([keys[h, position[0, h, :min(count[0, h], capacity)]],
                                   np.asarray(sortable_key(jnp.asarray(extra_score[h])))[extra_ok]])
            reaching = np.sort(held[held >= int(threshold[0, h])])[::-1]
            best = reaching[rank * kp - 1] if len(reaching) >= rank * kp else INT_MIN
            seed[0, h] = max(int(best), int(threshold[0, h]))
        go = np.full(heads, fail.any()) if coupled else fail
        scored = kth_largest_middle(s[None], jnp.asarray([length]), rank * kp, sink=SINK, local=LOCAL,
                                    implementation="xla")
        threshold = jnp.where(jnp.asarray(go)[None], scored, jnp.asarray(seed))
        second.append(go)
        failed_all.append(fail)
    return np.asarray(second), np.asarray(failed_all)


@pytest.mark.parametrize("k,rank,slack,coupled", [(40, 2, 2, False), (40, 4, 1, False), (40, 2, 2, True),
                                                  (44, 1, 1, False)])
def test_simulation_equals_the_library_step_by_step(k, rank, slack, coupled):
    scores = scores_sequence()
    lengths = np.arange(370, 370 + scores.shape[0], dtype=np.int32)  # crosses a block boundary (384)
    keys = np.asarray(sortable_key(jnp.asarray(scores)))
    got = threshold_seeds.simulate(keys, lengths, k, rank, slack, sink=SINK, local=LOCAL, coupled=coupled)
    second, failed = reference(scores, lengths, k, rank, slack, coupled)
    np.testing.assert_array_equal(got["second"], second)
    np.testing.assert_array_equal(got["overflow"] | got["few"], failed)
    assert not (got["overflow"] & got["few"]).any()
    assert got["overflow"][0].all()  # the lowest threshold: every stored middle token passes
    if (k, rank, slack, coupled) == (40, 2, 2, False):  # the sequence exercises both failures and successes
        assert got["overflow"][1:].any() and got["few"][1:].any() and not got["second"][1:].all()
