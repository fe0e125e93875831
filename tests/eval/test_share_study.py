"""The shared-selection study's pieces (fathom_jax.eval.share_study, share_run, share_report) on tiny synthetic
captures: the scores it selects from, rules read off the pair errors, the layer choice, a whole study."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import calibrate as cal
from fathom_jax.eval import fidelity as fid
from fathom_jax.eval import share_study as ss
from fathom_jax.eval.fidelity_run import _score_program, _window_index
from fathom_jax.eval.scoring import MethodScore
from fathom_jax.methods import Fathom

D = 16


def test_study_scores_are_the_error_studys_bit_for_bit():
    rng = np.random.default_rng(1)
    keys = jnp.asarray(rng.standard_normal((2, 1, 256, D)) * np.exp(rng.standard_normal(D)), jnp.float32)
    cap = fid.Capture(jnp.asarray(rng.standard_normal((2, 2, 256, D)), jnp.float32), keys, keys)
    calib, pos, method = cal.calibrate(cap.k, cap.q), np.array([200, 255], np.int32), Fathom(24)
    queries = jnp.stack([cap.layer_queries(layer, pos) for layer in range(2)])
    score = MethodScore(method)
    for layer in range(2):
        full = _window_index(method.parts)(cap.k, calib, np.int32(layer))
        theirs, _ = jax.jit(_score_program(score, True))(queries, cap.k, jnp.asarray(pos), calib, np.int32(layer), full,
                                                score.program()[1])
        mine = ss.layer_scores(method, queries[layer], cap.k[layer], jax.tree.map(lambda x: x[layer], calib),
                               jnp.asarray(pos))
        np.testing.assert_array_equal(mine, theirs)


def test_rule_errors_read_the_selection_layers_sets():
    own = np.arange(4.0)[:, None] * np.ones((4, 2))
    pair = np.full((4, 4, 2), np.nan)
    pair[0, 1], pair[0, 2], pair[2, 3] = 10.0, 20.0, 30.0
    np.testing.assert_array_equal(ss.rule_errors((True, False, True, False), own, pair)[:, 0], [0, 10, 2, 30])
    np.testing.assert_array_equal(ss.rule_errors((True,) * 4, own, pair), own)


def test_choose_layers_is_the_best_set_by_brute_force():
    rng = np.random.default_rng(2)
    n = 6
    own, pair = rng.uniform(0.1, 1, n), rng.uniform(0.2, 3, (n, n))
    for count in range(1, n + 1):
        def total(layers):
            selects = tuple(i in layers for i in range(n))
            return ss.rule_errors(selects, own[:, None], pair[..., None]).sum()

        best = min((c for c in itertools.combinations(range(n), count) if c[0] == 0), key=total)
        assert ss.choose_layers(own, pair, count) == best


def test_share_study_end_to_end(tmp_path):
    """A tiny study through to its report and figure: every-layer selection is the baseline, a rule's rows and bits
    are its selection layers' plus its budget's rows at the others."""
    from fathom_jax.eval import share_report
    from fathom_jax.eval.share_run import run_share_study

    rng = np.random.default_rng(3)
    caps = []
    for _ in range(2):
        k = jnp.asarray(rng.standard_normal((3, 1, 320, D)) * np.exp(rng.standard_normal(D)), jnp.float32)
        caps.append(fid.Capture(jnp.asarray(rng.standard_normal((3, 2, 320, D)), jnp.float32), k,
                                jnp.asarray(rng.standard_normal((3, 1, 320, D)), jnp.float32)))
    config = ss.ShareConfig(method="fathom:12", k=40, budgets=(48, 64), rankings=("weight", "rank"),
                            rules=("first", "every2", "all", "0,1,2"), chosen_counts=(2,), positions=16,
                            calib_positions=8, row_ks=(40, 64, 96), bits_fractions=(1 / 4, 1 / 2))
    res = run_share_study(caps[0], caps[1], cal.calibrate(caps[1].k, caps[1].q), config, n_layers=3,
                          scanning_layers=(0, 1, 2), meta={"model": "tiny (random)", "command": "test"},
                          log=lambda *_: None)
    base = res["baseline"]
    assert res["meta"]["skipped_rules"] == {"0,1,2": "selects the layers of 'all'"}
    every = [r for r in res["rules"] if r["rule"] == "all" and r["scan"] == base["method"]]
    assert len(every) == 4 and all(r["ratio"] == 1.0 and r["error_per_layer"] == base["error_per_layer"]
                                   and r["bits"] == base["bits"] for r in every)
    first = next(r for r in res["rules"] if r["rule"] == "first" and r["budget"] == 64 and r["ranking"] == "rank"
                 and r["scan"] == base["method"])
    assert first["bits"] == pytest.approx(base["bits_per_layer"][0] / 3)
    assert first["rows"] == pytest.approx((base["rows_per_layer"][0] + 2 * 64) / 3)
    assert {r["rule"] for r in res["rules"]} >= {"first", "every2", "all", "chosen 2"}
    assert "## Every rule" in share_report.render_markdown(res)
    share_report.plot(res, str(tmp_path / "share.png"))
    assert (tmp_path / "share.png").stat().st_size > 0


def test_topk_pair_errors_over_every_position_are_the_exact_top_ks():
    """The study's ``attending="topk"``: a set of every position attended top k per head errs as the oracle does."""
    from fathom_jax.select import select_topk, sparse_attention

    rng = np.random.default_rng(4)
    n, pos = 256, np.array([200, 255], np.int32)
    q = jnp.asarray(rng.standard_normal((2, 1, 2, D)), jnp.float32)  # [P, Hkv, G, D]
    keys, values = (jnp.asarray(rng.standard_normal((1, n, D)), jnp.float32) for _ in range(2))
    refs = jnp.asarray(rng.standard_normal((2, 1, 2, D)), jnp.float32)
    shared = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (2, n))
    got = ss._pair_errors(q, keys, values, refs, shared, shared < jnp.asarray(pos + 1)[:, None], jnp.asarray(pos),
                          (n,), 40)
    for p in range(2):
        scores = jnp.einsum("hgd,hnd->hgn", q[p], keys, precision=jax.lax.Precision.HIGHEST)
        idx, mask = select_topk(scores, jnp.full((1,), pos[p] + 1), 40, implementation="xla")
        o = sparse_attention(q[p], keys, values, idx, mask)
        want = jnp.mean(jnp.linalg.norm(o - refs[p], axis=-1) / jnp.linalg.norm(refs[p], axis=-1))
        np.testing.assert_allclose(got[p, 0], want, rtol=1e-5)
