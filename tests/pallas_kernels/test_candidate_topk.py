"""Top-k among candidates: the selection of a numpy oracle (sink, local window, the k' best middle candidates by
(score descending, position ascending)) and the failure rule; and end to end, the scan's candidates
finished here select what the top-k over every written score selects."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_base import KernelTestBase, assert_ran, random_store_arrays
from pallas_kernels import candidate_topk as CT
from pallas_kernels import plane_scan as PS
from pallas_kernels import scan_select as SS
from pallas_kernels import topk as TK
from pallas_kernels.operands import StorePlanes
from pallas_kernels.topk_radix import sortable_key
from tests.support import lower_triton_text

SINK, LOCAL, K = 4, 8, 24
KP = K - SINK - LOCAL


def np_select(pos, score, valid, length):
    """The oracle: sink, local window and the KP best valid (position, score) by (score desc, position asc)."""
    keys = np.asarray(sortable_key(jnp.asarray(score, jnp.float32)))
    ranked = sorted((-int(k), int(p)) for p, k, v in zip(pos, keys, valid) if v)
    middle = {p for _, p in ranked[:KP]}
    sink = set(range(min(SINK, length)))
    local = set(range(max(SINK, length - LOCAL), length))
    return sink | local | middle


def random_candidates(rng, lengths, counts, capacity, g=3):
    """Candidates of distinct stored middle positions, scores on a coarse grid (ties likely), and the newest block."""
    r = len(lengths)
    length = np.asarray(lengths, np.int32)
    newest = (length - 1) // 64 * 64
    stop = np.minimum(length - LOCAL, newest)
    gp = 1 << (g - 1).bit_length()
    count = np.zeros((r, gp), np.int32)
    position = np.full((r, g, capacity + 1), -9, np.int32)
    score = np.zeros((r, g, capacity + 1), np.float32)
    for i, h in np.ndindex(r, g):
        room = max(int(stop[i]) - SINK, 0)
        n = min(counts[i][h], room)
        count[i, h] = counts[i][h] if counts[i][h] > capacity else n
        held = min(n, capacity)
        position[i, h, :held] = SINK + rng.choice(room, held, replace=False)
        score[i, h, :held] = np.round(rng.standard_normal(held) * 2) / 2 + 1.0
    extra_position = newest[:, None] + np.arange(64, dtype=np.int32)
    extra_score = (np.round(rng.standard_normal((r, g, 64)) * 2) / 2 + 1.0).astype(np.float32)
    return tuple(jnp.asarray(x) for x in (count, position, score, length, stop, extra_position, extra_score))


class TestCandidateTopk(KernelTestBase):
    def test_matches_numpy_oracle(self, impl, rng):
        capacity = 64
        # rows: plenty of candidates; few reaching the threshold; an overflow; every stored middle token passed
        # (complete) with fewer than k'; a context shorter than the sink and local window
        lengths = [600, 300, 900, 120, 9]
        counts = [[60, 40, 30], [3, 2, 1], [100, 64, 65], [10 ** 6] * 3, [0, 0, 0]]
        count, position, score, length, stop, epos, escore = random_candidates(rng, lengths, counts, capacity)
        room = int(stop[3]) - SINK  # row 3: complete (every stored middle token a candidate)
        count = count.at[3, :3].set(room)
        position = position.at[3, :, :room].set(SINK + jnp.arange(room)).at[3, :, room:capacity].set(-9)
        escore = escore.at[1].set(0.0)  # row 1: neither list holds k' tokens reaching the threshold
        threshold = sortable_key(jnp.full((5, 3), 1.0, jnp.float32))
        selected, failed = CT.candidate_topk(count, position, score, length, threshold, stop, epos, escore, k=K,
                                             sink=SINK, local=LOCAL, **impl.kw)
        selected, failed = np.asarray(selected), np.asarray(failed)
        assert selected.shape == (5, 3, K + 1)
        ekeys = np.asarray(sortable_key(escore))
        for i, h in np.ndindex(5, 3):
            n = min(int(count[i, h]), capacity)
            ep, es = np.asarray(epos[i]), np.asarray(escore[i, h])
            evalid = (ep >= SINK) & (ep < int(length[i]) - LOCAL)
            pos = np.concatenate([np.asarray(position[i, h, :n]), ep])
            valid = np.concatenate([np.ones(n, bool), evalid])
            want = np_select(pos, np.concatenate([np.asarray(score[i, h, :n]), es]), valid, int(length[i]))
            got = selected[i, h, :K]
            assert set(got[got >= 0].tolist()) == want and np.sum(got >= 0) == len(want), (i, h)
            reached = n + int(np.sum(evalid & (ekeys[i, h] >= int(threshold[i, h]))))
            complete = int(count[i, h]) == max(int(stop[i]) - SINK, 0)
            assert failed[i, h] == int(count[i, h] > capacity or (reached < KP and not complete)), (i, h)
        assert failed[1].all() and failed[2, 0] and failed[2, 2] and not failed[3].any() and not failed[0].any()
        assert_ran(CT.candidate_topk, count, position, score, length, threshold, stop, epos, escore,
                   name=CT.KERNEL_NAME, impl=impl, k=K, sink=SINK, local=LOCAL)

    def test_scan_candidates_select_what_topk_selects(self, impl, rng):
        """End to end: thresholds at several ranks, the scan's candidates finished here == the top-k kernels' (or
        lax.top_k's) selection over every written score, wherever the candidates do not fail."""
        d, g, n = 16, 3, 2048
        planes, scales, length = random_store_arrays(rng, (3,), d, n, length=[2048, 1500, 700])
        q = jnp.asarray(rng.standard_normal((3, g, d)), jnp.float32)
        runs = PS.active_channels(jnp.asarray(rng.integers(0, 5, (3, d)), jnp.int32))
        store = StorePlanes(planes, scales)
        scores = PS.plane_scan(q, store, length, runs, **impl.kw)
        want = np.asarray(TK.topk_select(scores.reshape(-1, n), jnp.repeat(length, g), k=K, sink=SINK, local=LOCAL,
                                         **impl.kw)).reshape(3, g, K)
        for quantile, fails in ((0.95, False), (0.99, False), (0.999, True)):  # ~100, ~20, ~2 candidates a head
            threshold = sortable_key(jnp.asarray(np.quantile(np.asarray(scores), quantile, axis=-1), jnp.float32))
            stop = length - LOCAL
            c = SS.scan_select(q, store, length, runs, threshold, stop, start=SINK, capacity=256, **impl.kw)
            selected, failed = CT.candidate_topk(c.count, c.position, c.score, length, threshold, stop, k=K,
                                                 sink=SINK, local=LOCAL, **impl.kw)
            selected, failed = np.asarray(selected)[..., :K], np.asarray(failed)
            assert failed.all() if fails else not failed.any()
            for i, h in zip(*np.nonzero(failed == 0)):
                assert np.array_equal(np.sort(selected[i, h]), np.sort(want[i, h])), (quantile, i, h)


def test_candidate_topk_lowers_to_triton_and_validates():
    z = jnp.zeros
    count, pos, score = z((2, 4), jnp.int32), z((2, 3, 65), jnp.int32), z((2, 3, 65))
    ln, thr = z((2,), jnp.int32), z((2, 3), jnp.int32)
    text = lower_triton_text(CT.candidate_topk, count, pos, score, ln, thr, ln, z((2, 64), jnp.int32), z((2, 3, 64)),
                             k=K, sink=SINK, local=LOCAL, implementation="triton", interpret=False)
    assert text.count(f'name = "{CT.KERNEL_NAME}"') == 1
    with pytest.raises(ValueError, match="count"):
        CT.candidate_topk(count[:, :3], pos, score, ln, thr, ln, k=K, sink=SINK, local=LOCAL)
    with pytest.raises(ValueError, match="capacity must be a power of two"):
        CT.candidate_topk(count, pos[..., :60], score[..., :60], ln, thr, ln, k=K, sink=SINK, local=LOCAL)
    with pytest.raises(ValueError, match="come together"):
        CT.candidate_topk(count, pos, score, ln, thr, ln, z((2, 64), jnp.int32), k=K, sink=SINK, local=LOCAL)
    with pytest.raises(ValueError, match="need k > sink"):
        CT.candidate_topk(count, pos, score, ln, thr, ln, k=12, sink=SINK, local=LOCAL)
    with pytest.raises(ValueError, match="threshold must be"):
        CT.candidate_topk(count, pos, score, ln, thr[:, :2], ln, k=K, sink=SINK, local=LOCAL)
