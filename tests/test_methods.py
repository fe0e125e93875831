"""Scan methods as types: the paper's worked example (Appendix A), exact byte counts, labels, specs."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fathom_jax import calibrate as C
from fathom_jax import methods as M
from fathom_jax import scan as SC
from fathom_jax.index import parts as P
from tests.support import build_index_jit as build
from tests.support import random_setting, top_set

scan = jax.jit(SC.scan_scores, static_argnums=0, static_argnames="implementation")


# ----------------------------------------------------------------------------------------------
# Appendix A


@pytest.fixture(scope="module")
def example(appendix):
    eye = np.eye(4, dtype=np.float32)
    calib = C.from_arrays(variance=appendix.var, mean=np.zeros(4), basis=eye, eigenvalues=appendix.var,
                          ds_order=np.arange(4), loki_basis=eye)  # DS picks channels 0, 1; Loki ~ channels 0, 1
    methods = [M.Fathom(8), M.Fathom(6), M.Fathom(8, "exact"), M.SparQ(2), M.DoubleSparsity(2), M.Loki(2),
               M.Thumbnail(2), M.Full4(), M.Exact()]
    index = build(appendix.keys, calib, methods)
    return {m: scan(m, appendix.q, index, calib) for m in methods}


def verdict(result, right=({0, 3}, {5, 0})):
    """Whether each head's top-2 by the method's scores is its true top-2 (Appendix A: A {t0, t3}, B {t5, t0})."""
    scores = np.asarray(result.scores)[:, :6]
    return [top_set(scores[h], 2) == right[h] for h in range(2)]


def test_appendix_a_exact_scores(example, appendix):
    exact = np.asarray(example[M.Exact()].scores)[:, :6]
    np.testing.assert_allclose(exact, appendix.exact_scores, atol=0.006)
    assert verdict(example[M.Exact()], appendix.right) == [True, True]


def test_appendix_a_fathom_b8(example):
    for m in (M.Fathom(8), M.Fathom(8, "exact")):
        r = example[m]
        np.testing.assert_array_equal(r.depths, [4, 3, 1, 0])
        s = np.asarray(r.scores)[:, :6]
        np.testing.assert_allclose(s[0], [5.01, -1.79, 0.46, 4.96, -2.34, 3.59], atol=0.006)
        np.testing.assert_allclose(s[1], [2.84, 0.24, -2.01, 2.49, -0.61, 3.36], atol=0.006)
        assert verdict(r) == [True, True]
        assert float(r.bits_per_token) == 8 + 3 * 16 / 64


def test_appendix_a_fathom_b6_misranks_b(example):
    r = example[M.Fathom(6)]
    np.testing.assert_array_equal(r.depths, [3, 2, 1, 0])
    assert verdict(r)[1] is False


@pytest.mark.parametrize("method", [M.SparQ(2), M.DoubleSparsity(2), M.Loki(2)])
def test_appendix_a_channel_picks_rank_b_wrong(example, method):
    r = example[method]
    np.testing.assert_array_equal(r.depths, [4, 4, 0, 0])  # channel 1 wins SparQ's tie with channel 2
    assert top_set(np.asarray(r.scores)[1, :6], 2) == {5, 3}
    assert verdict(r) == [True, False]
    assert float(r.bits_per_token) == 8 + 2 * 16 / 64


def test_appendix_a_thumbnail_misranks_both(example):
    r = example[M.Thumbnail(2)]
    np.testing.assert_array_equal(r.depths, [2, 2, 2, 2])
    assert verdict(r) == [False, False]


def test_appendix_a_loki_from_session_pca(appendix):
    """The keys' own PCA directions are ~channels 0 and 1: Loki r=2 makes the same mistake."""
    calib = C.calibrate_session(appendix.keys, skip_tokens=0)
    assert np.linalg.norm(np.asarray(calib.loki_basis)[2:, :2]) < 0.1
    index = build(appendix.keys, calib, [M.Loki(2)])
    r = scan(M.Loki(2), appendix.q, index, calib)
    assert top_set(np.asarray(r.scores)[1, :6], 2) == {5, 3}


# ----------------------------------------------------------------------------------------------
# Byte accounting


def test_fixed_byte_counts_at_d128():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((64, 128)).astype(np.float32)
    q = rng.standard_normal((4, 128)).astype(np.float32)
    calib = C.calibrate_session(keys)
    expect = {M.SparQ(32): 136, M.DoubleSparsity(32): 136, M.Loki(32): 136, M.SparQ(16): 68, M.Loki(64): 272,
              M.Thumbnail(2): 288, M.Full4(): 544, M.Landmark(): 256, M.Quest(): 256, M.Quest(8): 512, M.Exact(): 2048,
              M.Dense(): 2048}
    index = build(keys, calib, expect)
    for m, bits in expect.items():
        assert m.fixed_bits_per_token(128) == bits, m.label
        assert float(scan(m, q, index, calib).bits_per_token) == bits, m.label


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), budget=st.integers(0, 64), exact_plan=st.booleans())
def test_fathom_bits_are_planes_plus_active_scales(seed, budget, exact_plan):
    keys, q, calib = random_setting(seed, n=64, d=16)
    m = M.Fathom(budget, "exact" if exact_plan else "bisection")
    index = build(keys, calib[0][None], [m])
    r = scan(m, q, index, calib[0][None])
    depths = np.asarray(r.depths)
    assert depths.sum() <= budget
    np.testing.assert_allclose(r.bits_per_token, depths.sum(-1) + (depths > 0).sum(-1) / 4)


def test_fathom_bits_read_within_their_budget_as_read():
    from fathom_jax import allocation as A

    keys, q, calib = random_setting(11, n=64, d=16)
    calib = C.tuned(calib, plane_error=A.plane_errors(keys))
    index = build(keys, calib, [M.Fathom(0)])  # every plane method reads the same raw store
    for m in (M.FathomBits(30), M.FathomBits(45, "exact", "observed")):
        r = SC.scan_scores(m, q, index, calib)
        depths = np.asarray(r.depths)
        assert float(r.bits_per_token[0]) == depths.sum() + (depths > 0).sum() / 4 <= m.budget
        assert float(r.bits_per_token[0]) > m.budget - 1.25 * (m.planner == "exact") - 4.25
    tuned = C.tuned(calib, budget=np.full(1, 30, np.float32))
    r2 = SC.scan_scores(M.FathomTuned(), q, index, tuned)
    np.testing.assert_array_equal(r2.depths, SC.scan_scores(M.FathomBits(30), q, index, calib).depths)


def test_fathom_bits_need_their_calibration_fields():
    keys, q, calib = random_setting(1, n=64, d=16)
    index = build(keys, calib, [M.FathomBits(20)])
    with pytest.raises(ValueError, match="observed error model needs calibration with plane errors"):
        SC.scan_scores(M.FathomBits(20, importance="observed"), q, index, calib)
    with pytest.raises(ValueError, match="needs calibration with tuned budgets"):
        SC.scan_scores(M.FathomTuned(), q, index, calib)
    with pytest.raises(ValueError, match=r"budget must lie in \[0, 68\] bits per token as read"):
        SC.scan_scores(M.FathomBits(69), q, index, calib)


def test_sparq_union_bits_count_the_union():
    keys, q, calib = random_setting(3, n=64)
    m = M.SparQUnion(4)
    r = scan(m, q, build(keys, calib, [m]), calib)
    picks = np.argsort(-np.abs(q[0]), axis=-1, kind="stable")[:, :4]
    union = np.unique(picks)
    assert float(r.bits_per_token[0]) == 4 * len(union) + len(union) / 4
    assert len(union) > 4


# ----------------------------------------------------------------------------------------------
# Method descriptions


def test_labels_and_paper_settings():
    labels = [m.label for m in M.paper_methods(128)]
    for want in ("Fathom 48", "Fathom 64", "Fathom KLT 48", "Double Sparsity c=32", "SparQ r=16", "SparQ r=32",
                 "Loki r=32", "Loki r=64", "2-bit thumbnail", "block landmark", "Quest P=16", "Quest P=8",
                 "full 4-bit scan", "exact top-k oracle", "dense"):
        assert want in labels
    assert [m.label for m in M.paper_methods(64, klt=False)][:2] == ["Fathom 24", "Fathom 32"]
    assert M.Fathom(48, "exact").label == "Fathom 48 (exact plan)"
    assert M.fathom_budgets(64) == (20, 24, 32, 40)
    assert hash(M.SparQ(16)) == hash(M.SparQ(16)) and M.SparQ(16) != M.SparQUnion(16)



# ----------------------------------------------------------------------------------------------
# The registry: specs round-trip, one class per method, derived help


@pytest.mark.parametrize("method", M.paper_methods(64) + (M.Fathom(40, "exact"), M.SparQUnion(8), M.Thumbnail(3),
                                                          M.FathomBits(55), M.FathomBits(37, "exact", "observed"),
                                                          M.FathomBits(20, importance="observed"), M.FathomTuned(),
                                                          M.FathomTuned("exact", "observed"), M.Quest(4)),
                         ids=lambda m: m.spec)
def test_spec_round_trip(method):
    assert M.parse(method.spec) == method
    assert M.REGISTRY[method.name] is type(method)


def test_parse_specs_and_errors():
    assert M.parse("fathom:48") == M.Fathom(48)
    assert M.parse("Fathom_KLT:64:exact") == M.FathomKLT(64, planner="exact")
    assert M.parse("double_sparsity:16") == M.DoubleSparsity(16) and M.DoubleSparsity(16).c == 16
    assert M.parse("thumbnail") == M.Thumbnail(2) and M.parse(" landmark ") == M.Landmark()
    assert M.parse("quest") == M.Quest(16) == M.Quest() and M.parse("Quest:8") == M.Quest(8) != M.Quest()
    assert M.Quest().spec == "quest:16" and M.Quest(8).label == "Quest P=8" and M.Quest().kind == "quest"
    assert M.parse(M.SparQ(4)) == M.SparQ(4)
    assert M.parse("fathom_bits:55:observed:exact") == M.FathomBits(55, "exact", "observed")
    assert M.FathomBits(55, "exact", "observed").label == "Fathom 55 bits as read (exact, observed)"
    for bad, match in [("fathmo:48", "unknown scan method 'fathmo'"), ("fathom", "expected fathom:BUDGET"),
                       ("sparq:x", "r must be an integer"), ("exact:3", "exact takes no parameters"),
                       ("", "non-empty"), ("fathom:-3", "budget must be an int >= 0"),
                       ("fathom:abc", "budget must be an integer"), ("fathom:8:greedy", "planner must be one of"),
                       ("thumbnail:5", "depth must be an int in \\[1, 4\\]"), ("loki:0", "r must be an int >= 1"),
                       ("fathom_bits:55:exact:exact", "planner one of"), ("fathom_bits", "expected fathom_bits:BITS"),
                       ("fathom_tuned:48", "error model one of"), ("quest:12", "page must be an int dividing 64"),
                       ("quest:128", "page must be an int dividing 64"), ("quest:x", "page must be an integer"),
                       ("quest:16:8", r"expected quest\[:P\]")]:
        with pytest.raises(ValueError, match=match):
            M.parse(bad)


def test_help_is_derived_from_the_registry():
    help_text = M.spec_help()
    for cls in M.REGISTRY.values():
        assert cls.spec_syntax in help_text
    assert [s for s, _ in M.describe()] == [cls.spec_syntax for cls in M.REGISTRY.values()]


def test_parts_and_calibration_needs():
    assert M.Fathom(8).parts == {P.RAW} and M.FathomKLT(8).parts == {P.KLT} and M.Loki(4).parts == {P.LOKI}
    assert M.Landmark().parts == {P.LANDMARKS} and M.Exact().parts == {P.KEYS}
    # Quest's pages: one part per page size, equal parts for equal pages (two methods share a cache only then)
    assert M.Quest().parts == {P.QUEST16} and M.Quest(8).parts == {P.QUEST8} and M.Quest(4).parts == {P.PageBounds(4)}
    assert P.PageBounds(16) == P.QUEST16 and hash(P.PageBounds(16)) == hash(P.QUEST16) and P.QUEST16 != P.QUEST8
    assert [p.name for p in (P.QUEST16, P.QUEST8)] == ["quest16", "quest8"]
    assert M.parts_of([M.Quest(), M.Quest(16), M.Quest(8)]) == {P.QUEST16, P.QUEST8}
    needs = {cls.name for cls in M.REGISTRY.values() if cls.needs_calibration}
    assert needs == {"fathom", "fathom_klt", "fathom_bits", "fathom_tuned", "double_sparsity", "loki"}
    assert M.Fathom(100).max_active(64) == 64 and M.Fathom(12).max_active(64) == 12 and M.SparQ(8).max_active(64) == 8
