"""Selection shared across layers: the jnp semantics (fathom_jax.eval.shared_selection) on tiny synthetic q/k/v."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax.eval.shared_selection import shared_attention, shared_positions, stack_attention
from fathom_jax.methods.sharing import SharedSelection
from fathom_jax.select import attend, select_topk, sparse_attention

L, HKV, G, N, D = 3, 2, 2, 256, 16


@pytest.fixture(scope="module")
def stack():
    """Per layer: q [2, Hkv, G, D] (two sequences), keys / values [2, Hkv, N, D], scores [2, Hkv, G, N]."""
    key = jax.random.key(0)
    q, k, v, s = (jax.random.normal(kk, shape) for kk, shape in zip(jax.random.split(key, 4), [
        (L, 2, HKV, G, D), (L, 2, HKV, N, D), (L, 2, HKV, N, D), (L, 2, HKV, G, N)]))
    return list(q), list(k), list(v), list(s), jnp.array([N, 180], jnp.int32)


def test_every_layer_selecting_is_todays_per_layer_selection_bit_for_bit(stack):
    q, k, v, scores, length = stack
    sharing = SharedSelection(("all",), 64)  # budget = k
    out = stack_attention(sharing.plan_layers(L), sharing, q, k, v, length, scores, 64)
    for layer in range(L):
        idx, mask = select_topk(scores[layer], length[:, None], 64, implementation="xla")
        np.testing.assert_array_equal(out[layer], sparse_attention(q[layer], k[layer], v[layer], idx, mask))


def test_sharing_layers_attend_exactly_the_selection_layers_set(stack):
    q, k, v, scores, length = stack
    sharing = SharedSelection((0,), 96, "mass")
    out = stack_attention(sharing.plan_layers(L), sharing, q, k, v, length, [scores[0], None, None], 64)
    idx, mask = shared_positions(scores[0], length, 96, scale=1 / np.sqrt(D), ranking="mass")
    for layer in (1, 2):
        allowed = jnp.zeros((2, N), bool).at[jnp.arange(2)[:, None], idx].max(mask)  # the set as a mask over keys
        dense = attend(q[layer], k[layer], v[layer], jnp.broadcast_to(allowed[:, None, None], (2, HKV, G, N)))
        np.testing.assert_allclose(out[layer], dense, rtol=1e-5, atol=1e-6)
    assert int(mask[0].sum()) == 96 and int(mask[1].sum()) == 96


@pytest.mark.parametrize("ranking", ["weight", "mass", "rank"])
def test_shared_set_keeps_sink_and_local_and_grows_by_prefix(stack, ranking):
    _, _, _, scores, length = stack
    idx, mask = map(np.asarray, shared_positions(scores[1], length, 120, scale=0.25, ranking=ranking))
    small, _ = shared_positions(scores[1], length, 60, scale=0.25, ranking=ranking)
    np.testing.assert_array_equal(idx[:, :60], small)
    for b, n in enumerate(np.asarray(length)):
        forced = set(range(4)) | set(range(n - 32, n))
        assert set(idx[b, :36].tolist()) == forced  # the sink and the local window first
        assert len(set(idx[b].tolist())) == 120 and idx[b].max() < n and mask[b].all()


@pytest.mark.parametrize("ranking", ["weight", "mass", "rank"])
def test_one_head_shares_its_own_top_k(stack, ranking):
    """With one head and budget = k, the shared set is that head's top-k (the selection layer's set)."""
    _, _, _, scores, length = stack
    one = scores[2][:, :1, :1]
    idx, _ = shared_positions(one, length, 80, scale=0.25, ranking=ranking)
    top, _ = select_topk(one, length[:, None], 80, implementation="xla")
    for b in range(2):
        assert set(np.asarray(idx[b]).tolist()) == set(np.asarray(top[b, 0, 0]).tolist())


def test_rankings_by_hand():
    """Head 0 prefers 10 then 20, head 1 30 then 10: best rank interleaves the heads; the largest weight follows the
    sharpest head; the summed weight favours the token both heads want."""
    scores = np.full((1, 2, 64), -30.0, np.float32)
    scores[0, 0, [10, 20]] = [5.0, 4.9]
    scores[0, 1, [30, 10]] = [2.0, 1.9]
    scores[0, 1, 40:44] = 1.9  # head 1's weight is spread: its top token weighs less than head 0's second
    run = lambda ranking: np.asarray(shared_positions(scores, 64, 3, scale=1.0, ranking=ranking, sink=0, local=0)[0])
    np.testing.assert_array_equal(run("rank"), [10, 30, 20])
    np.testing.assert_array_equal(run("weight"), [10, 20, 30])
    assert run("mass")[0] == 10


def test_shared_positions_rejects_bad_budgets():
    with pytest.raises(ValueError, match=r"budget must be an int in \(36, 64\]"):
        shared_positions(jnp.zeros((1, 1, 64)), 64, 65, scale=1.0)
    with pytest.raises(ValueError, match=r"ranking must be one of"):
        shared_positions(jnp.zeros((1, 1, 64)), 64, 40, scale=1.0, ranking="best")


def test_shared_attention_matches_per_head_sparse_attention(stack):
    q, k, v, scores, length = stack
    idx, mask = shared_positions(scores[0], length, 100, scale=0.25)
    per_head = jnp.broadcast_to(idx[:, None, None], (2, HKV, G, 100)), jnp.broadcast_to(mask[:, None, None],
                                                                                     (2, HKV, G, 100))
    np.testing.assert_allclose(shared_attention(q[1], k[1], v[1], idx, mask),
                               sparse_attention(q[1], k[1], v[1], *per_head), rtol=1e-6, atol=1e-6)


def _exact_top_k(q, keys, values, length, k):
    """Each head's exact top k of every valid position (sink and local forced): the oracle's step."""
    scores = jnp.einsum("bhgd,bhnd->bhgn", q, keys, precision=jax.lax.Precision.HIGHEST)
    idx, mask = select_topk(scores, jnp.broadcast_to(length[:, None], scores.shape[:2]), k, implementation="xla")
    return sparse_attention(q, keys, values, idx, mask)


def test_topk_over_every_position_is_the_exact_top_k(stack):
    """``attend=topk`` over a set holding every valid position attends each head's exact top k: the oracle's step."""
    q, k, v, _, length = stack
    every = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (2, N))
    out = shared_attention(q[1], k[1], v[1], every, every < length[:, None], topk=(40, length))
    np.testing.assert_allclose(out, _exact_top_k(q[1], k[1], v[1], length, 40), rtol=1e-6, atol=1e-6)


def test_topk_attends_only_the_set(stack):
    """Each head attends its top k of the set's positions only: rows outside the set change nothing, rows inside do;
    a set of k positions (sink and local among them) attends all of them."""
    q, k, v, scores, length = stack
    idx, mask = shared_positions(scores[0], length, 100, scale=0.25)
    out = shared_attention(q[1], k[1], v[1], idx, mask, topk=(40, length))
    outside = jnp.ones((2, N), bool).at[jnp.arange(2)[:, None], idx].set(False)
    noisy = jnp.where(outside[:, None, :, None], 100.0, k[1])
    np.testing.assert_array_equal(shared_attention(q[1], noisy, v[1], idx, mask, topk=(40, length)), out)
    small_idx, small_mask = shared_positions(scores[0], length, 40, scale=0.25)
    np.testing.assert_allclose(shared_attention(q[1], k[1], v[1], small_idx, small_mask, topk=(40, length)),
                               shared_attention(q[1], k[1], v[1], small_idx, small_mask), rtol=1e-6, atol=1e-6)
