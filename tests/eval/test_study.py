import json

import numpy as np

from fathom_jax.eval import fidelity as fid
from fathom_jax.eval import study


def tiny_capture(random_keys, rng, tokens=192):
    return fid.Capture(
        q=random_keys(rng, (2, 4, tokens, 16)),
        k=random_keys(rng, (2, 2, tokens, 16)),
        v=rng.standard_normal((2, 2, tokens, 16)).astype(np.float32),
    )


def test_study_end_to_end_and_report_from_json(rng, tmp_path, random_keys):
    config = study.StudyConfig(
        context=192, ks=(48, 64), positions=8, calib_positions=8, budgets=(8, 16, 32), klt_budgets=(16,),
        layer_plan_means=(16,), layer_plan_grid=(8, 16, 32), session_budgets=(16,), exact_planner_budgets=(16,),
        bits_budgets=(18,), observed_budgets=(18,), exact_bits_budgets=(18,), tuned_means=(18,), tuning_grid=(4, 16, 48),
        session_tuned_means=(18,), session_tuning_positions=8,
    )
    res = study.run_study(tiny_capture(random_keys, rng), tiny_capture(random_keys, rng), config, meta={"model": "random"}, progress=False)
    names = [r["name"] for r in res["rows"]]
    for want in ["Fathom 16", "Fathom KLT 16", "Fathom 16 (session calib)", "Fathom 16 (exact plan)",
                 "SparQ r=2", "SparQ r=4", "Double Sparsity c=4", "Loki r=4", "Loki r=8", "2-bit thumbnail",
                 "block landmark", "Quest P=16", "Quest P=8", "full 4-bit scan", "exact top-k oracle",
                 "Fathom per-layer 16",
                 "Fathom 18 bits as read", "Fathom 18 bits as read (observed)", "Fathom 18 bits as read (exact, observed)",
                 "Fathom tuned, mean 18 bits (per layer and KV head)", "Fathom tuned on the session, mean 18 bits"]:
        assert want in names, want
    for r in res["rows"]:
        if r["family"] in ("Fathom bits as read", "Fathom observed errors", "Fathom observed, exact plan"):
            assert r["bits"] <= 18
    for source in ("calibration", "session"):
        tuned = res["tuning"][source]["means"]["18"]
        assert np.asarray(tuned["budgets"]).shape == (2, 2) and np.mean(tuned["budgets"]) <= 18
        assert -1 <= tuned["surrogate"]["pearson_change"] <= 1 and len(res["tuning"][source]["tables"]["grid"]) == 3
    assert res["tuning"]["session"]["positions"] == [176, 183, 8]  # just before the 8 evaluated positions
    assert res["tuning"]["calibration"]["positions"] == [107, 191, 8]  # spread over the second half
    assert all(len(v) == 8 for v in res["rows"][0]["error_per_position"].values())
    oracle = next(r for r in res["rows"] if r["kind"] == "exact")
    assert all(abs(v) < 1e-12 for v in oracle["excess"].values())
    full = next(r for r in res["rows"] if r["kind"] == "full4")
    assert full["bits"] == 4 * 16 + 16 / 4
    quest = {r["spec"]: r for r in res["rows"] if r["kind"] == "quest"}
    assert quest["quest:16"]["bits"] == 32 and quest["quest:8"]["bits"] == 64  # 2 x 16 D / P at D = 16
    assert quest["quest:16"]["family"] == "Quest" and quest["quest:16"]["calibration"] == "none"
    plan = res["layer_plans"]["16"]
    assert len(plan) == 2 and np.mean(plan) <= 16
    assert res["basis_rule"]["basis"] in ("raw", "klt")
    paths = study.write_report(res, str(tmp_path / "fid"))
    # The table is reproducible from the JSON alone.
    with open(paths[0]) as f:
        again = json.load(f)
    assert study.render_markdown(again) == open(paths[1]).read()
    markdown = open(paths[1]).read()
    assert "Budgets tuned with optax on the session" in markdown and "Allocations vs flat Fathom at equal bits" in markdown
    assert (tmp_path / "fid.png").stat().st_size > 1000


def test_baseline_rows_are_the_papers_method_set_at_the_head_dim():
    """The study's baselines are fathom_jax.methods.PAPER_METHODS at D (less dense attention, the error's reference),
    with SparQ's per-head union beside the two SparQ rows."""
    from fathom_jax import methods as M

    assert M.at_head_dim("sparq:D/8", 64) == "sparq:8" and M.at_head_dim("thumbnail:2", 64) == "thumbnail:2"
    specs = [row.method.spec for row in study.baseline_rows(64)]
    assert specs == ["sparq:8", "sparq:16", "sparq_union:8", "double_sparsity:16", "loki:16", "loki:32", "thumbnail:2",
                     "landmark", "quest:16", "quest:8", "full4", "exact"]
    assert [m.spec for m in M.paper_methods(64, budgets=())] == [M.at_head_dim(s, 64) for s in M.PAPER_METHODS]


def test_allocation_budgets_scale_with_the_head_dim():
    """The allocation rows sit at the same fractions of D as the flat budgets: SmolLM2's (D = 64) are the budgets
    its committed studies ran; Gemma 3's (D = 256) four times them, so they stay just under flat Fathom's bits."""
    from fathom_jax.eval import tuning

    small, gemma = study.StudyConfig().at_head_dim(64), study.StudyConfig().at_head_dim(256)
    assert (small.bits_budgets, small.observed_budgets, small.exact_bits_budgets) == ((37, 55), (37, 55, 73), (55,))
    assert small.tuned_means == small.session_tuned_means == (37, 55)
    assert small.tuning_grid == tuning.GRID == (8, 16, 26, 37, 55, 80, 120)
    assert (gemma.bits_budgets, gemma.observed_budgets, gemma.tuned_means) == ((148, 220), (148, 220, 292), (148, 220))
    assert gemma.tuning_grid == (32, 64, 104, 148, 220, 320, 480)
    labels = [row.name for row in study.default_rows(256, study.StudyConfig()) if row.family.startswith("Fathom tuned")]
    assert labels == ["Fathom tuned, mean 148 bits (per layer and KV head)", "Fathom tuned, mean 220 bits (per layer and KV head)"]
    assert study.StudyConfig(tuned_means=(18,)).at_head_dim(256).tuned_means == (18,)  # given budgets stay as given
