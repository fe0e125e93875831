"""Scanning: every method against an independent plain-numpy computation, the Pallas kernels against the
reference, limits, errors, jit and vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fathom_jax import calibrate as C
from fathom_jax import index as I
from fathom_jax import methods as M
from fathom_jax import planner
from fathom_jax import scan as SC
from tests.support import build_index_jit as build
from tests.support import np_dequant, np_scales, random_setting

scan = jax.jit(SC.scan_scores, static_argnums=0, static_argnames="implementation")


# ----------------------------------------------------------------------------------------------
# Each scorer against a plain computation


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.sampled_from([40, 150]), d=st.just(16),
       g=st.sampled_from([1, 3]), r=st.integers(1, 8))
def test_scorers_match_plain_numpy(seed, n, d, g, r):
    keys, q, calib = random_setting(seed, n=n, d=d, g=g)
    k, qh = keys[0].astype(np.float64), q[0].astype(np.float64)
    methods = [M.SparQ(r), M.SparQUnion(r), M.DoubleSparsity(r), M.Loki(r), M.Thumbnail(2), M.Full4(),
               M.Fathom(3 * d), M.FathomKLT(2 * d), M.Landmark(), M.Quest(), M.Quest(8), M.Exact()]
    index = build(keys, calib, methods)
    got = {m: scan(m, q, index, calib) for m in methods}
    mu, v = np.asarray(calib.mean[0], np.float64), np.asarray(calib.basis[0], np.float64)
    full = np_dequant(k, 4)

    def check(m, ref, tol=1e-4):
        s = np.asarray(got[m].scores)[0]
        assert s.shape == (g, index.capacity)
        np.testing.assert_allclose(s[:, :n], ref, rtol=tol, atol=tol * (1 + np.abs(ref).max()), err_msg=m.label)

    # SparQ: S = top-r of the group's sum|q| (ties by lower index); scores q[:, S] . k4[:, S].
    sel = np.argsort(-np.abs(qh).sum(0), kind="stable")[:r]
    check(M.SparQ(r), qh[:, sel] @ full[:, sel].T)
    # Per-head union: each head scores with its own r channels.
    check(M.SparQUnion(r), np.stack([qh[h, s] @ full[:, s].T for h, s in
                                      enumerate(np.argsort(-np.abs(qh), axis=-1, kind="stable")[:, :r])]))
    ds = np.asarray(calib.ds_order[0])[:r]
    check(M.DoubleSparsity(r), qh[:, ds] @ full[:, ds].T)
    lv = np.asarray(calib.loki_basis[0], np.float64)
    rot = np_dequant((k - mu) @ lv, 4)
    check(M.Loki(r), (qh @ lv)[:, :r] @ rot[:, :r].T + (qh @ mu)[:, None])
    check(M.Thumbnail(2), qh @ np_dequant(k, 2).T)
    check(M.Full4(), qh @ full.T)
    check(M.Exact(), qh @ k.T)
    # Fathom: depths from the planner on sum_h q^2 Var.
    g_raw = (qh**2).sum(0) * np.asarray(calib.variance[0], np.float64)
    depths = np.asarray(planner.plan_bisection(jnp.asarray(g_raw, jnp.float32), 3 * d).depths)
    np.testing.assert_array_equal(got[M.Fathom(3 * d)].depths[0], depths)
    check(M.Fathom(3 * d), qh @ np_dequant(k, depths).T)
    # Fathom KLT: q V against planes of (k - mu) V, plus q . mu.
    depths = np.asarray(got[M.FathomKLT(2 * d)].depths[0])
    g_klt = ((qh @ v) ** 2).sum(0) * np.asarray(calib.eigenvalues[0], np.float64)
    np.testing.assert_array_equal(depths, planner.plan_bisection(jnp.asarray(g_klt, jnp.float32), 2 * d).depths)
    check(M.FathomKLT(2 * d), (qh @ v) @ np_dequant((k - mu) @ v, depths).T + (qh @ mu)[:, None])
    # Landmark: fp16 mean of each 8-token block (valid tokens only), repeated over the block.
    lm = np.stack([k[i:i + 8].mean(0) for i in range(0, n, 8)]).astype(np.float16).astype(np.float64)
    check(M.Landmark(), np.repeat(qh @ lm.T, 8, axis=1)[:, :n], tol=1e-3)
    # Quest: per page of P tokens the fp16 min and max of every channel over its valid tokens; each token gets its
    # page's bound sum_j max(q_j min_j, q_j max_j), as the paper writes it.
    for page in (16, 8):
        pages = [k[i:i + page] for i in range(0, n, page)]
        lo, hi = (np.stack([f(p, axis=0) for p in pages]).astype(np.float16).astype(np.float64)
                  for f in (np.min, np.max))
        bound = np.maximum(qh[:, None, :] * lo[None], qh[:, None, :] * hi[None]).sum(-1)  # [G, pages]
        check(M.Quest(page), np.repeat(bound, page, axis=1)[:, :n])
        exact = qh @ k.T  # an upper bound on every key of the page, up to the fp16 rounding of the bounds
        assert np.all(np.repeat(bound, page, axis=1)[:, :n] >= exact - 1e-2 * np.abs(qh).sum(-1, keepdims=True))


def test_depth_ladder_converges_to_exact():
    """Uniform depth t: |score error| <= sum_j |q_j| a_j / 2^t per token; the error halves per plane."""
    keys, q, calib = random_setting(11, n=256, d=16)
    methods = [M.Thumbnail(t) for t in (1, 2, 3, 4)] + [M.Full4(), M.Exact()]
    index = build(keys, calib, methods)
    exact = np.asarray(scan(M.Exact(), q, index, calib).scores)[0]
    a = np_scales(keys[0])
    rms = []
    for t in (1, 2, 3, 4):
        s = np.asarray(scan(M.Thumbnail(t), q, index, calib).scores)[0]
        bound = np.abs(q[0]) @ a.T / 2**t
        assert np.all(np.abs(s - exact) <= bound + 1e-4)
        rms.append(np.sqrt(np.mean((s - exact) ** 2)))
    assert all(rms[i + 1] < 0.7 * rms[i] for i in range(3)), rms
    np.testing.assert_array_equal(scan(M.Full4(), q, index, calib).scores,
                                  scan(M.Thumbnail(4), q, index, calib).scores)


def test_fathom_full_budget_equals_full4():
    keys, q, calib = random_setting(12, n=128, d=16)
    methods = [M.Fathom(64), M.Fathom(64, "exact"), M.Full4()]
    index = build(keys, calib, methods)
    full = scan(M.Full4(), q, index, calib)
    for m in methods[:2]:
        r = scan(m, q, index, calib)
        np.testing.assert_array_equal(r.depths, 4)
        np.testing.assert_array_equal(r.scores, full.scores)
        np.testing.assert_array_equal(r.bits_per_token, full.bits_per_token)


def test_klt_full_budget_ranks_like_exact_within_quantization_error():
    keys, q, calib = random_setting(13, n=512, d=16)
    methods = [M.FathomKLT(64), M.Full4(), M.Exact()]
    index = build(keys, calib, methods)
    exact = np.asarray(scan(M.Exact(), q, index, calib).scores)[0]
    mu, v = np.asarray(calib.mean[0]), np.asarray(calib.basis[0])
    for m, qq, kk in ((M.FathomKLT(64), q[0] @ v, (keys[0] - mu) @ v), (M.Full4(), q[0], keys[0])):
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
    methods = [M.Landmark(), M.Quest(), M.Full4(), M.Fathom(16), M.Exact()]
    index = build(keys, calib, methods, capacity=256)
    for m, size in ((M.Landmark(), 8), (M.Quest(), 16)):
        s = np.asarray(scan(m, q, index, calib).scores)[0]
        assert s.shape[-1] == 256
        full = 100 // size * size
        blocks = s[:, :full].reshape(s.shape[0], -1, size)
        np.testing.assert_array_equal(blocks, np.broadcast_to(blocks[..., :1], blocks.shape))
        np.testing.assert_array_equal(s[:, full:100], np.broadcast_to(s[:, full:full + 1], (s.shape[0], 100 - full)))
    for m in methods:
        sc = np.asarray(scan(m, q, index, calib).scores)[0]
        assert np.all(np.isneginf(sc[:, 100:])) and np.all(np.isfinite(sc[:, :100])), m.label


def test_dense_and_exact_are_exact_scores():
    keys, q, calib = random_setting(15, n=64, d=8)
    index = build(keys, None, [M.Exact(), M.Dense()])
    for m in (M.Exact(), M.Dense()):
        r = scan(m, q, index)
        np.testing.assert_allclose(r.scores[0], q[0] @ keys[0].T, rtol=1e-5, atol=1e-5)
        assert r.depths is None


# ----------------------------------------------------------------------------------------------
# Bad inputs


def test_bad_inputs_name_the_argument():
    keys, q, calib = random_setting(16, n=64, d=8)
    index = I.build_index(keys, calib, M.parts_of([M.SparQ(2), M.Fathom(8)]))
    with pytest.raises(TypeError, match="q must be floating"):
        SC.scan_scores(M.SparQ(2), q.astype(np.int32), index, calib)
    with pytest.raises(ValueError, match="q must be \\[\\*B, G, D\\]"):
        SC.scan_scores(M.SparQ(2), q[0], index, calib)
    with pytest.raises(ValueError, match="q head_dim 4 does not match"):
        SC.scan_scores(M.SparQ(2), q[..., :4], index, calib)
    with pytest.raises(ValueError, match="budget must be an int >= 0"):
        M.Fathom(-1)
    with pytest.raises(ValueError, match="budget must lie in \\[0, 32\\]"):
        SC.scan_scores(M.Fathom(33), q, index, calib)
    with pytest.raises(ValueError, match="r must be <= D = 8"):
        SC.scan_scores(M.SparQ(9), q, index, calib)
    with pytest.raises(ValueError, match="c must be <= D = 8"):
        SC.scan_scores(M.DoubleSparsity(9), q, index, calib)
    with pytest.raises(ValueError, match="r must be an int >= 1"):
        M.Loki(0)
    with pytest.raises(ValueError, match="unknown scan method 'qeust'"):
        M.parse("qeust")
    with pytest.raises(TypeError, match="method must be a ScanMethod"):
        SC.scan_scores("sparq:2", q, index, calib)
    with pytest.raises(ValueError, match="implementation must be one of"):
        SC.scan_scores(M.SparQ(2), q, index, calib, implementation="cuda")
    with pytest.raises(ValueError, match="planner must be one of"):
        M.Fathom(8, "greedy")
    with pytest.raises(ValueError, match="needs index parts \\['klt'\\]"):
        SC.scan_scores(M.FathomKLT(8), q, index, calib)
    with pytest.raises(ValueError, match="needs calib"):
        SC.scan_scores(M.Fathom(8), q, index, None)
    with pytest.raises(ValueError, match="calib is required"):
        I.build_index(keys, None, M.Loki(2).parts)
    with pytest.raises(ValueError, match="calib head_dim 8 does not match keys head_dim 4"):
        I.build_index(keys[..., :4], calib, M.Loki(2).parts)
    bad = keys.copy()
    bad[0, 3, 1] = np.nan
    with pytest.raises(ValueError, match="keys contains 1 NaN"):
        C.calibrate(bad)
    with pytest.raises(ValueError, match="keys contains"):
        I.build_index(bad, calib, M.Full4().parts)


# ----------------------------------------------------------------------------------------------
# jit and vmap


def test_jit_static_method_and_vmap_over_layers():
    rng = np.random.default_rng(17)
    layers, hkv, g, n, d = 3, 2, 2, 96, 8
    keys = (rng.standard_normal((layers, hkv, n, d)) * np.geomspace(2, 0.1, d)).astype(np.float32)
    queries = rng.standard_normal((layers, hkv * g, 32, d)).astype(np.float32)
    calib = C.calibrate(keys, queries)
    q = rng.standard_normal((layers, hkv, g, d)).astype(np.float32)
    methods = (M.Fathom(12), M.FathomKLT(12), M.SparQUnion(2), M.Loki(4), M.Landmark(), M.Quest(8))
    index = jax.jit(lambda k, c: I.build_index(k, c, M.parts_of(methods)))(keys, calib)
    eager_index = I.build_index(keys[1], calib[1], methods[0].parts)
    np.testing.assert_array_equal(index["raw"].planes[1], eager_index["raw"].planes)
    scan_jit = jax.jit(SC.scan_scores, static_argnums=0)
    for m in methods:
        batched = scan_jit(m, q, index, calib)  # leading axes [L, Hkv] handled directly
        per_layer = jax.jit(jax.vmap(lambda a, b, c, m=m: SC.scan_scores(m, a, b, c)))(q, index, calib)
        one = scan_jit(m, q[1], jax.tree.map(lambda x: x[1], index), calib[1])
        np.testing.assert_allclose(per_layer.scores, batched.scores, rtol=1e-5, atol=1e-5, err_msg=m.label)
        np.testing.assert_allclose(one.scores, batched.scores[1], rtol=1e-5, atol=1e-5, err_msg=m.label)
        np.testing.assert_array_equal(per_layer.bits_per_token, batched.bits_per_token)


@pytest.mark.parametrize("make", [lambda d: M.Fathom(d), lambda d: M.FathomKLT(d), lambda d: M.SparQUnion(d // 4)],
                         ids=["fathom", "fathom_klt", "sparq_union"])
def test_pallas_plane_scan_equals_reference(make):
    """implementation="triton" reads the same planes with the Pallas plane scan (interpret mode on CPU)."""
    rng = np.random.default_rng(7)
    d, n = 16, 200
    keys = (rng.standard_normal((2, n, d)) * np.exp(rng.normal(size=d))).astype(np.float32)
    q = rng.standard_normal((2, 3, d)).astype(np.float32)
    calib = C.calibrate_session(keys)
    method = make(d)
    index = I.build_index(keys, calib, method.parts, length=np.array([n, 150]))
    want = SC.scan_scores(method, q, index, calib)
    got = SC.scan_scores(method, q, index, calib, implementation="triton")
    np.testing.assert_array_equal(np.asarray(got.bits_per_token), np.asarray(want.bits_per_token))
    w, g = np.asarray(want.scores), np.asarray(got.scores)
    np.testing.assert_array_equal(np.isinf(w), np.isinf(g))
    finite = np.isfinite(w)
    np.testing.assert_allclose(g[finite], w[finite], rtol=2e-5, atol=2e-5 * np.abs(w[finite]).max())
