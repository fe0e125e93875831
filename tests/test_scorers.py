"""Every scan method: the paper's worked example, byte counts, independent references, limits, errors, jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fathom_jax import calibrate as C
from fathom_jax import planner
from fathom_jax import scorers as S
from fathom_jax.scorers import ScanMethod as M


_build_jit = jax.jit(S.build_index, static_argnums=(2,), static_argnames=("capacity",))
scan = jax.jit(S.scan_scores, static_argnums=0)


def build(keys, calib, methods, **kw):
    """build_index under jit (much faster to compile than op by op on CPU)."""
    return _build_jit(keys, calib, tuple(methods), **kw)


# ----------------------------------------------------------------------------------------------
# Independent plain-numpy reference of the store's quantizer (DESIGN.md "Store semantics").


def np_dequant(keys, depth, block=64):
    """Keys [n, D] read at per-channel depth [D] with 64-token fp16 absmax block scales."""
    keys = np.asarray(keys, np.float64)
    n, d = keys.shape
    depth = np.broadcast_to(np.asarray(depth), (d,))
    out = np.zeros_like(keys)
    for b0 in range(0, n, block):
        blk = keys[b0:b0 + block]
        a = np.abs(blk).max(0).astype(np.float16).astype(np.float64)
        cell = a / 8
        code = np.clip(np.floor(np.divide(blk, cell, out=np.zeros_like(blk), where=cell > 0)), -8, 7) + 8
        for j in range(d):
            t = int(depth[j])
            if t == 0:
                continue
            half = 2.0 ** (t - 1)
            out[b0:b0 + block, j] = ((code[:, j].astype(np.int64) >> (4 - t)) + 0.5 - half) * a[j] / half
    return out


def np_scales(keys, block=64):
    keys = np.asarray(keys, np.float64)
    out = np.zeros_like(keys)
    for b0 in range(0, keys.shape[0], block):
        out[b0:b0 + block] = np.abs(keys[b0:b0 + block]).max(0).astype(np.float16).astype(np.float64)
    return out


def top_set(row, k):
    return set(np.argsort(-np.asarray(row), kind="stable")[:k].tolist())


def random_setting(seed, n=192, d=16, g=4, hkv=1):
    rng = np.random.default_rng(seed)
    mix = np.linalg.qr(rng.standard_normal((d, d)))[0]
    keys = (rng.standard_normal((hkv, n, d)) * np.geomspace(3, 0.1, d)) @ mix + 0.5 * rng.standard_normal(d)
    queries = rng.standard_normal((hkv * g, 64, d)) * np.linspace(0.5, 2, d)
    calib = C.calibrate(keys.astype(np.float32), queries.astype(np.float32))
    q = rng.standard_normal((hkv, g, d)).astype(np.float32) * np.linspace(0.5, 2, d).astype(np.float32)
    return keys.astype(np.float32), q, calib


# ----------------------------------------------------------------------------------------------
# Appendix A


K_A = np.array(
    [[1.8, 0.4, -0.2, 0.05], [-1.1, 0.9, 0.3, -0.02], [0.3, -1.2, 0.1, 0.04],
     [1.2, 0.7, 0.4, 0.01], [-0.6, -0.3, -0.5, 0.03], [0.9, 1.1, -0.3, -0.05]], np.float32)
VAR_A = np.array([1.222, 0.755, 0.127, 0.001], np.float32)
Q_A = np.array([[3, 1, 2, 0.1], [1, 2, -1, 0.2]], np.float32)  # heads A and B
RIGHT = [{0, 3}, {5, 0}]


@pytest.fixture(scope="module")
def example():
    eye = np.eye(4, dtype=np.float32)
    calib = C.from_arrays(variance=VAR_A, mean=np.zeros(4), basis=eye, eigenvalues=VAR_A,
                          ds_order=np.arange(4), loki_basis=eye)  # DS picks channels 0, 1; Loki ~ channels 0, 1
    methods = [M.fathom(8), M.fathom(6), M.fathom(8, "exact"), M.sparq(2), M.double_sparsity(2), M.loki(2),
               M.thumbnail(2), M.full4(), M.exact()]
    index = build(K_A, calib, methods)
    return {m: scan(m, Q_A, index, calib) for m in methods}


def verdict(result):
    scores = np.asarray(result.scores)[:, :6]
    return [top_set(scores[h], 2) == RIGHT[h] for h in range(2)]


def test_appendix_a_exact_scores(example):
    exact = np.asarray(example[M.exact()].scores)[:, :6]
    np.testing.assert_allclose(exact[0], [5.40, -1.80, -0.10, 5.10, -3.10, 3.19], atol=0.006)
    np.testing.assert_allclose(exact[1], [2.81, 0.40, -2.19, 2.20, -0.69, 3.39], atol=0.006)
    assert verdict(example[M.exact()]) == [True, True]


def test_appendix_a_fathom_b8(example):
    for m in (M.fathom(8), M.fathom(8, "exact")):
        r = example[m]
        np.testing.assert_array_equal(r.depths, [4, 3, 1, 0])
        s = np.asarray(r.scores)[:, :6]
        np.testing.assert_allclose(s[0], [5.01, -1.79, 0.46, 4.96, -2.34, 3.59], atol=0.006)
        np.testing.assert_allclose(s[1], [2.84, 0.24, -2.01, 2.49, -0.61, 3.36], atol=0.006)
        assert verdict(r) == [True, True]
        assert float(r.bits_per_token) == 8 + 3 * 16 / 64


def test_appendix_a_fathom_b6_misranks_b(example):
    r = example[M.fathom(6)]
    np.testing.assert_array_equal(r.depths, [3, 2, 1, 0])
    assert verdict(r)[1] is False


@pytest.mark.parametrize("method", [M.sparq(2), M.double_sparsity(2), M.loki(2)])
def test_appendix_a_channel_picks_rank_b_wrong(example, method):
    r = example[method]
    np.testing.assert_array_equal(r.depths, [4, 4, 0, 0])  # channel 1 wins SparQ's tie with channel 2
    assert top_set(np.asarray(r.scores)[1, :6], 2) == {5, 3}
    assert verdict(r) == [True, False]
    assert float(r.bits_per_token) == 8 + 2 * 16 / 64


def test_appendix_a_thumbnail_misranks_both(example):
    r = example[M.thumbnail(2)]
    np.testing.assert_array_equal(r.depths, [2, 2, 2, 2])
    assert verdict(r) == [False, False]


def test_appendix_a_loki_from_session_pca():
    """The keys' own PCA directions are ~channels 0 and 1: Loki r=2 makes the same mistake."""
    calib = C.calibrate_session(K_A, skip_tokens=0)
    assert np.linalg.norm(np.asarray(calib.loki_basis)[2:, :2]) < 0.1
    index = build(K_A, calib, [M.loki(2)])
    r = scan(M.loki(2), Q_A, index, calib)
    assert top_set(np.asarray(r.scores)[1, :6], 2) == {5, 3}


# ----------------------------------------------------------------------------------------------
# Byte accounting


def test_fixed_byte_counts_at_d128():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((64, 128)).astype(np.float32)
    q = rng.standard_normal((4, 128)).astype(np.float32)
    calib = C.calibrate_session(keys)
    expect = {M.sparq(32): 136, M.double_sparsity(32): 136, M.loki(32): 136, M.sparq(16): 68, M.loki(64): 272,
              M.thumbnail(2): 288, M.full4(): 544, M.landmark(): 256, M.exact(): 2048, M.dense(): 2048}
    index = build(keys, calib, expect)
    for m, bits in expect.items():
        assert m.fixed_bits_per_token(128) == bits, m.label
        assert float(scan(m, q, index, calib).bits_per_token) == bits, m.label


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), budget=st.integers(0, 64), exact_plan=st.booleans())
def test_fathom_bits_are_planes_plus_active_scales(seed, budget, exact_plan):
    keys, q, calib = random_setting(seed, n=64, d=16)
    m = M.fathom(budget, "exact" if exact_plan else "bisection")
    index = build(keys, calib[0][None], [m])
    r = scan(m, q, index, calib[0][None])
    depths = np.asarray(r.depths)
    assert depths.sum() <= budget
    np.testing.assert_allclose(r.bits_per_token, depths.sum(-1) + (depths > 0).sum(-1) / 4)


def test_sparq_union_bits_count_the_union():
    keys, q, calib = random_setting(3, n=64)
    m = M.sparq_union(4)
    r = scan(m, q, build(keys, calib, [m]), calib)
    picks = np.argsort(-np.abs(q[0]), axis=-1, kind="stable")[:, :4]
    union = np.unique(picks)
    assert float(r.bits_per_token[0]) == 4 * len(union) + len(union) / 4
    assert len(union) > 4


# ----------------------------------------------------------------------------------------------
# Each scorer against a plain computation


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.sampled_from([40, 150]), d=st.just(16),
       g=st.sampled_from([1, 3]), r=st.integers(1, 8))
def test_scorers_match_plain_numpy(seed, n, d, g, r):
    keys, q, calib = random_setting(seed, n=n, d=d, g=g)
    k, qh = keys[0].astype(np.float64), q[0].astype(np.float64)
    methods = [M.sparq(r), M.sparq_union(r), M.double_sparsity(r), M.loki(r), M.thumbnail(2), M.full4(),
               M.fathom(3 * d), M.fathom_klt(2 * d), M.landmark(), M.exact()]
    index = build(keys, calib, methods)
    got = {m: scan(m, q, index, calib) for m in methods}
    mu, v = np.asarray(calib.mean[0], np.float64), np.asarray(calib.basis[0], np.float64)
    full = np_dequant(k, 4)

    def check(m, ref, tol=1e-4):
        s = np.asarray(got[m].scores)[0]
        assert s.shape == (g, S.KeyIndex.capacity.fget(index))
        np.testing.assert_allclose(s[:, :n], ref, rtol=tol, atol=tol * (1 + np.abs(ref).max()), err_msg=m.label)

    # SparQ: S = top-r of the group's sum|q| (ties by lower index); scores q[:, S] . k4[:, S].
    sel = np.argsort(-np.abs(qh).sum(0), kind="stable")[:r]
    check(M.sparq(r), qh[:, sel] @ full[:, sel].T)
    # Per-head union: each head scores with its own r channels.
    check(M.sparq_union(r), np.stack([qh[h, s] @ full[:, s].T for h, s in
                                      enumerate(np.argsort(-np.abs(qh), axis=-1, kind="stable")[:, :r])]))
    ds = np.asarray(calib.ds_order[0])[:r]
    check(M.double_sparsity(r), qh[:, ds] @ full[:, ds].T)
    lv = np.asarray(calib.loki_basis[0], np.float64)
    rot = np_dequant((k - mu) @ lv, 4)
    check(M.loki(r), (qh @ lv)[:, :r] @ rot[:, :r].T + (qh @ mu)[:, None])
    check(M.thumbnail(2), qh @ np_dequant(k, 2).T)
    check(M.full4(), qh @ full.T)
    check(M.exact(), qh @ k.T)
    # Fathom: depths from the planner on sum_h q^2 Var.
    g_raw = (qh**2).sum(0) * np.asarray(calib.variance[0], np.float64)
    depths = np.asarray(planner.plan_bisection(jnp.asarray(g_raw, jnp.float32), 3 * d).depths)
    np.testing.assert_array_equal(got[M.fathom(3 * d)].depths[0], depths)
    check(M.fathom(3 * d), qh @ np_dequant(k, depths).T)
    # Fathom KLT: q V against planes of (k - mu) V, plus q . mu.
    depths = np.asarray(got[M.fathom_klt(2 * d)].depths[0])
    g_klt = ((qh @ v) ** 2).sum(0) * np.asarray(calib.eigenvalues[0], np.float64)
    np.testing.assert_array_equal(depths, planner.plan_bisection(jnp.asarray(g_klt, jnp.float32), 2 * d).depths)
    check(M.fathom_klt(2 * d), (qh @ v) @ np_dequant((k - mu) @ v, depths).T + (qh @ mu)[:, None])
    # Landmark: fp16 mean of each 8-token block (valid tokens only), repeated over the block.
    lm = np.stack([k[i:i + 8].mean(0) for i in range(0, n, 8)]).astype(np.float16).astype(np.float64)
    check(M.landmark(), np.repeat(qh @ lm.T, 8, axis=1)[:, :n], tol=1e-3)


def test_depth_ladder_converges_to_exact():
    """Uniform depth t: |score error| <= sum_j |q_j| a_j / 2^t per token; the error halves per plane."""
    keys, q, calib = random_setting(11, n=256, d=16)
    methods = [M.thumbnail(t) for t in (1, 2, 3, 4)] + [M.full4(), M.exact()]
    index = build(keys, calib, methods)
    exact = np.asarray(scan(M.exact(), q, index, calib).scores)[0]
    a = np_scales(keys[0])
    rms = []
    for t in (1, 2, 3, 4):
        s = np.asarray(scan(M.thumbnail(t), q, index, calib).scores)[0]
        bound = np.abs(q[0]) @ a.T / 2**t
        assert np.all(np.abs(s - exact) <= bound + 1e-4)
        rms.append(np.sqrt(np.mean((s - exact) ** 2)))
    assert all(rms[i + 1] < 0.7 * rms[i] for i in range(3)), rms
    np.testing.assert_array_equal(scan(M.full4(), q, index, calib).scores,
                                  scan(M.thumbnail(4), q, index, calib).scores)


def test_fathom_full_budget_equals_full4():
    keys, q, calib = random_setting(12, n=128, d=16)
    methods = [M.fathom(64), M.fathom(64, "exact"), M.full4()]
    index = build(keys, calib, methods)
    full = scan(M.full4(), q, index, calib)
    for m in methods[:2]:
        r = scan(m, q, index, calib)
        np.testing.assert_array_equal(r.depths, 4)
        np.testing.assert_array_equal(r.scores, full.scores)
        np.testing.assert_array_equal(r.bits_per_token, full.bits_per_token)


def test_klt_full_budget_ranks_like_exact_within_quantization_error():
    keys, q, calib = random_setting(13, n=512, d=16)
    methods = [M.fathom_klt(64), M.full4(), M.exact()]
    index = build(keys, calib, methods)
    exact = np.asarray(scan(M.exact(), q, index, calib).scores)[0]
    mu, v = np.asarray(calib.mean[0]), np.asarray(calib.basis[0])
    for m, qq, kk in ((M.fathom_klt(64), q[0] @ v, (keys[0] - mu) @ v), (M.full4(), q[0], keys[0])):
        s = np.asarray(scan(m, q, index, calib).scores)[0]
        bound = np.abs(qq) @ np_scales(kk).T / 16  # half a 4-bit cell per channel
        assert np.all(np.abs(s - exact) <= bound + 1e-4), m.label
        for h in range(s.shape[0]):
            k = 16
            chosen = np.argsort(-s[h], kind="stable")[:k]
            kth = np.sort(exact[h])[::-1][k - 1]
            assert exact[h, chosen].min() >= kth - 2 * bound[h].max(), m.label


def test_landmark_constant_within_blocks_and_padding_is_neg_inf():
    keys, q, calib = random_setting(14, n=100, d=8)
    methods = [M.landmark(), M.full4(), M.fathom(16), M.exact()]
    index = build(keys, calib, methods, capacity=256)
    r = scan(M.landmark(), q, index, calib)
    s = np.asarray(r.scores)[0]
    assert s.shape[-1] == 256
    blocks = s[:, :96].reshape(s.shape[0], -1, 8)
    np.testing.assert_array_equal(blocks, np.broadcast_to(blocks[..., :1], blocks.shape))
    np.testing.assert_array_equal(s[:, 96:100], np.broadcast_to(s[:, 96:97], (s.shape[0], 4)))
    for m in methods:
        sc = np.asarray(scan(m, q, index, calib).scores)[0]
        assert np.all(np.isneginf(sc[:, 100:])) and np.all(np.isfinite(sc[:, :100])), m.label


def test_dense_and_exact_are_exact_scores():
    keys, q, calib = random_setting(15, n=64, d=8)
    index = build(keys, None, [M.exact(), M.dense()])
    for m in (M.exact(), M.dense()):
        r = scan(m, q, index)
        np.testing.assert_allclose(r.scores[0], q[0] @ keys[0].T, rtol=1e-5, atol=1e-5)
        assert r.depths is None


# ----------------------------------------------------------------------------------------------
# Method descriptions


def test_labels_and_paper_settings():
    labels = [m.label for m in S.paper_methods(128)]
    for want in ("Fathom 48", "Fathom 64", "Fathom KLT 48", "Double Sparsity c=32", "SparQ r=16", "SparQ r=32",
                 "Loki r=32", "Loki r=64", "2-bit thumbnail", "block landmark", "full 4-bit scan",
                 "exact top-k oracle", "dense"):
        assert want in labels
    assert [m.label for m in S.paper_methods(64, klt=False)][:2] == ["Fathom 24", "Fathom 32"]
    assert M.fathom(48, "exact").label == "Fathom 48 (exact plan)"
    assert S.fathom_budgets(64) == (20, 24, 32, 40)
    assert hash(M.sparq(16)) == hash(M.sparq(16)) and M.sparq(16) != M.sparq_union(16)


# ----------------------------------------------------------------------------------------------
# Bad inputs


def test_bad_inputs_name_the_argument():
    keys, q, calib = random_setting(16, n=64, d=8)
    index = S.build_index(keys, calib, [M.sparq(2), M.fathom(8)])
    with pytest.raises(TypeError, match="q must be floating"):
        S.scan_scores(M.sparq(2), q.astype(np.int32), index, calib)
    with pytest.raises(ValueError, match="q must be \\[\\*B, G, D\\]"):
        S.scan_scores(M.sparq(2), q[0], index, calib)
    with pytest.raises(ValueError, match="q head_dim 4 does not match"):
        S.scan_scores(M.sparq(2), q[..., :4], index, calib)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        M.fathom(-1)
    with pytest.raises(ValueError, match="budget must lie in \\[0, 32\\]"):
        S.scan_scores(M.fathom(33), q, index, calib)
    with pytest.raises(ValueError, match="r must be <= D = 8"):
        S.scan_scores(M.sparq(9), q, index, calib)
    with pytest.raises(ValueError, match="c must be <= D = 8"):
        S.build_index(keys, calib, [M.double_sparsity(9)])
    with pytest.raises(ValueError, match="r must be an int >= 1"):
        M.loki(0)
    with pytest.raises(ValueError, match="kind must be one of"):
        M("quest")
    with pytest.raises(ValueError, match="planner must be one of"):
        M.fathom(8, "greedy")
    with pytest.raises(ValueError, match="needs index parts \\['klt'\\]"):
        S.scan_scores(M.fathom_klt(8), q, index, calib)
    with pytest.raises(ValueError, match="needs calib"):
        S.scan_scores(M.fathom(8), q, index, None)
    with pytest.raises(ValueError, match="calib is required"):
        S.build_index(keys, None, [M.loki(2)])
    with pytest.raises(ValueError, match="calib head_dim 8 does not match keys head_dim 4"):
        S.build_index(keys[..., :4], calib, [M.loki(2)])
    bad = keys.copy()
    bad[0, 3, 1] = np.nan
    with pytest.raises(ValueError, match="keys contains 1 NaN"):
        C.calibrate(bad)
    with pytest.raises(ValueError, match="keys contains"):
        S.build_index(bad, calib, [M.full4()])


# ----------------------------------------------------------------------------------------------
# jit and vmap


def test_jit_static_method_and_vmap_over_layers():
    rng = np.random.default_rng(17)
    layers, hkv, g, n, d = 3, 2, 2, 96, 8
    keys = (rng.standard_normal((layers, hkv, n, d)) * np.geomspace(2, 0.1, d)).astype(np.float32)
    queries = rng.standard_normal((layers, hkv * g, 32, d)).astype(np.float32)
    calib = C.calibrate(keys, queries)
    q = rng.standard_normal((layers, hkv, g, d)).astype(np.float32)
    methods = (M.fathom(12), M.fathom_klt(12), M.sparq_union(2), M.loki(4), M.landmark())
    index = jax.jit(lambda k, c: S.build_index(k, c, methods))(keys, calib)
    eager_index = S.build_index(keys[1], calib[1], methods[:1])
    np.testing.assert_array_equal(index.raw.planes[1], eager_index.raw.planes)
    scan_jit = jax.jit(S.scan_scores, static_argnums=0)
    for m in methods:
        batched = scan_jit(m, q, index, calib)  # leading axes [L, Hkv] handled directly
        per_layer = jax.jit(jax.vmap(lambda a, b, c, m=m: S.scan_scores(m, a, b, c)))(q, index, calib)
        one = scan_jit(m, q[1], jax.tree.map(lambda x: x[1], index), calib[1])
        np.testing.assert_allclose(per_layer.scores, batched.scores, rtol=1e-5, atol=1e-5, err_msg=m.label)
        np.testing.assert_allclose(one.scores, batched.scores[1], rtol=1e-5, atol=1e-5, err_msg=m.label)
        np.testing.assert_array_equal(per_layer.bits_per_token, batched.bits_per_token)


@pytest.mark.parametrize("make", [lambda d: M.fathom(d), lambda d: M.fathom_klt(d), lambda d: M.sparq(d // 4),
                                  lambda d: M.sparq_union(d // 4), lambda d: M.loki(d // 2), lambda d: M.thumbnail(2)],
                         ids=["fathom", "fathom_klt", "sparq", "sparq_union", "loki", "thumbnail"])
def test_pallas_plane_scan_equals_reference(make):
    """implementation="pallas" reads the same planes with the Pallas plane scan (interpret mode on CPU)."""
    rng = np.random.default_rng(7)
    d, n = 16, 200
    keys = (rng.standard_normal((2, n, d)) * np.exp(rng.normal(size=d))).astype(np.float32)
    q = rng.standard_normal((2, 3, d)).astype(np.float32)
    calib = C.calibrate_session(keys)
    method = make(d)
    index = S.build_index(keys, calib, [method], length=np.array([n, 150]))
    want = S.scan_scores(method, q, index, calib)
    got = S.scan_scores(method, q, index, calib, implementation="pallas")
    np.testing.assert_array_equal(np.asarray(got.bits_per_token), np.asarray(want.bits_per_token))
    w, g = np.asarray(want.scores), np.asarray(got.scores)
    np.testing.assert_array_equal(np.isinf(w), np.isinf(g))
    finite = np.isfinite(w)
    np.testing.assert_allclose(g[finite], w[finite], rtol=2e-5, atol=2e-5 * np.abs(w[finite]).max())
