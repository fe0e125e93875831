"""scripts/channel_shares.py: the share of a query's score variance in SparQ's channels and in the best ones."""


import numpy as np
import pytest

from scripts import channel_shares


def test_sparq_picks_large_queries_blind_to_key_variance():
    """D = 8, r = 2: the query is largest on channels 0 and 1, whose keys barely vary; the score variance sits in
    channels 6 and 7. SparQ's share is theirs alone, the best share is channels 6 and 7's."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 1, 200, 8)) * np.array([0.01, 0.01, 1, 1, 1, 1, 3, 3])
    q = np.broadcast_to(np.array([5.0, 4.0, 1, 1, 1, 1, 2, 2]), (1, 2, 200, 8)).copy()
    out = channel_shares.shares(q, k, np.array([150, 199]))
    g = q[0, 0, 0] ** 2 * k[0, 0, 64:].var(axis=0)
    assert (out["head_dim"], out["r"], out["queries"]) == (8, 2, 4)
    assert out["sparq_share"] == pytest.approx(g[:2].sum() / g.sum())
    assert out["best_share"] == pytest.approx(g[6:].sum() / g.sum()) and out["best_share"] > 0.5 > out["sparq_share"]
