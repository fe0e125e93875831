"""The shared selection's trade-off report (fathom_jax.eval.share_tradeoff): pairing, matching and refusals."""

import pytest

from fathom_jax.eval import share_tradeoff

SPEC = "fathom:48@share=0,2,mid@budget=2048"


def _row(method, ms, planes, placement=0, context=1 << 20):
    return {"kind": "attention", "method": method, "context": context, "batch": 1, "resident_planes": placement,
            "warm_planes": 0, "rows": "model", "inputs": "honest", "median_ms": ms, "min_ms": ms - 1, "max_ms": ms + 1,
            "link_scan_bytes": planes, "row_bytes_max": 3e8, "bits_per_token": 55.0}


def _bench(rows, k=512):
    return {"machine": {"device": "NVIDIA H100 80GB HBM3", "commit": "abc"}, "command": "bench", "config": {"k": k},
            "rows": rows}


def _study(rule="0,2,mid", budget=512, k=128):
    rules = [{"scan": "Fathom 48", "ranking": ranking, "budget": b, "rule": rule, "layers": [0, 2, 15],
              "ratio": ratio, "ratio_se": 0.01, "bits": 5.6, "equal_rows_ratio": 1.7, "equal_bits_ratio": None}
             for ranking, b, ratio in (("mass", budget, 1.02), ("weight", budget, 1.4), ("mass", 2 * budget, 0.7))]
    return {"meta": {"model": "SmolLM2 (gguf)", "context": 8192},
            "baseline": {"method": "Fathom 48", "k": k, "bits": 55.1}, "rules": rules}


def test_pairs_rows_of_one_placement_and_takes_the_matching_rule():
    bench = _bench([_row("Fathom 48", 68.0, 2.1e9), _row("Fathom 48 shared", 25.0, 1.75e8),
                    _row("Fathom 48", 38.0, 6.5e8, placement=1),  # no shared row at p = 1: not paired
                    _row("Fathom 48 shared", 21.0, 5e7, placement=2)])
    res = share_tradeoff.build([bench], [_study(), _study(rule="every4")], per_layer="Fathom 48",
                               shared="Fathom 48 shared", spec=SPEC, meta={"date": "d", "commit": "c", "command": "x"})
    assert res["meta"]["budget_per_k"] == 4
    [pair] = res["steps"]
    assert pair["resident_planes"] == 0
    assert pair["time_ratio"] == pytest.approx(25 / 68)
    assert pair["plane_ratio"] == pytest.approx(1.75e8 / 2.1e9)
    [point] = res["errors"]  # the mass ranking at 4 k of the named rule; the other study ran no such rule
    assert (point["rule"], point["budget"], point["ratio"]) == ("0,2,mid", 512, 1.02)
    text = share_tradeoff.render_markdown(res)
    assert "| 68.00 [67.00, 69.00] | 25.00 [24.00, 26.00] | 0.37 |" in text and "**1.020 ± 0.010**" in text


def test_refuses_runs_whose_k_does_not_divide_the_budget():
    with pytest.raises(ValueError, match="benches: one k"):
        share_tradeoff.build([_bench([], k=512), _bench([], k=256)], [], per_layer="a", shared="b", spec=SPEC)
    with pytest.raises(ValueError, match="benches: one k"):
        share_tradeoff.build([_bench([], k=384)], [], per_layer="a", shared="b", spec=SPEC)


def test_plot_draws(tmp_path):
    res = share_tradeoff.build([_bench([_row("Fathom 48", 68.0, 2.1e9), _row("Fathom 48 shared", 25.0, 1.75e8)])],
                               [_study()], per_layer="Fathom 48", shared="Fathom 48 shared", spec=SPEC,
                               meta={"date": "d", "commit": "c", "command": "x"})
    share_tradeoff.plot(res, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 0
