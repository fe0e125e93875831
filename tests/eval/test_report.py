"""The study's figure: every point visible (legend off the data), readable error ticks, k ascending."""

import json
import pathlib

import numpy as np
import pytest

from fathom_jax.eval import report

RESULTS = pathlib.Path(__file__).parents[2] / "results"


@pytest.fixture(scope="module")
def results():
    # The committed 8k study: its k = 128, 256, 164 were plotted in that order, and the legend hid the
    # thumbnail and Loki r = 32 points of the first panel.
    return json.loads((RESULTS / "fidelity_smollm2_8k.json").read_text())


@pytest.fixture(scope="module")
def fig(results):
    import matplotlib.pyplot as plt

    fig = report.figure(results)
    fig.canvas.draw()
    yield fig
    plt.close(fig)


def test_panels_in_ascending_k(fig, results):
    titles = [ax.get_title() for ax in fig.axes]
    ks = sorted(results["meta"]["ks"])
    assert titles == [f"k = {k}" for k in ks] + [f"k = {k}: vs flat Fathom" for k in ks]


def test_legend_covers_no_panel(fig):
    renderer = fig.canvas.get_renderer()
    legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends, "the figure has no legend"
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), f"legend overlaps panel {ax.get_title()}"


def test_error_axis_has_plain_number_ticks(fig):
    for ax in fig.axes[: len(fig.axes) // 2]:
        low, high = ax.get_ylim()
        labels = [t.get_text() for t in ax.get_yticklabels() if low <= t.get_position()[1] <= high and t.get_text()]
        assert len(labels) >= 3, (ax.get_title(), labels)
        for text in labels:
            float(text)  # "0.15", not mathtext like $\mathdefault{10^{-1}}$


def test_allocations_against_flat_fathom_at_equal_bits():
    """Excess ratios against flat Fathom: log-log interpolation between its budgets, and the paired comparison with
    standard errors over blocks of positions."""
    rng = np.random.default_rng(0)
    oracle = rng.uniform(0.09, 0.11, 32)
    flat_lo, flat_hi = oracle + rng.uniform(0.04, 0.06, 32), oracle + rng.uniform(0.01, 0.03, 32)
    alloc = oracle + 0.8 * (flat_lo - oracle) + rng.normal(0, 0.002, 32)

    def row(name, family, kind, bits, errors):
        return {"name": name, "family": family, "kind": kind, "bits": bits, "calibration": "corpus",
                "error": {"128": float(errors.mean())}, "error_per_position": {"128": errors.tolist()},
                "excess": {"128": float(errors.mean() - oracle.mean())}}

    results = {"meta": {"ks": [128]}, "rows": [
        row("oracle", "oracle", "exact", 1024.0, oracle), row("Fathom 32", "Fathom", "fathom", 37.0, flat_lo),
        row("Fathom 64", "Fathom", "fathom", 74.0, flat_hi),
        row("tuned", "Fathom tuned", "fathom_tuned", 36.5, alloc)]}
    ex_lo, ex_hi = (flat_lo - oracle).mean(), (flat_hi - oracle).mean()
    assert report.flat_excess(results, 52.0, "128") == pytest.approx(
        np.exp(np.interp(np.log(52.0), np.log([37.0, 74.0]), np.log([ex_lo, ex_hi]))))
    assert report.flat_excess(results, 80.0, "128") is None
    p = report.paired(results, results["rows"][3], results["rows"][1], "128")
    a, b = alloc - oracle, flat_lo - oracle
    assert p["ratio"] == pytest.approx(a.mean() / b.mean())
    blocks = (a - p["ratio"] * b).reshape(4, 8).mean(axis=1)
    assert p["ratio_se"] == pytest.approx(blocks.std(ddof=1) / 2 / b.mean())
    assert p["gap_se"] == pytest.approx((flat_lo - alloc).reshape(4, 8).mean(axis=1).std(ddof=1) / 2)
    [line] = report.allocation_lines(results)
    assert line.startswith("tuned (36.5 bits) vs Fathom 32 (37.0 bits): k=128: excess") and "ratio 0.8" in line
    # Equal bits: within 1 bit per 64 channels (3 bits apart is not equal at D = 64, is at D = 256)
    results["rows"][3]["bits"] = 34.0
    assert report.allocation_lines(results) == []
    results["meta"]["head_dim"] = 256
    [line] = report.allocation_lines(results)
    assert line.startswith("tuned (34.0 bits) vs Fathom 32 (37.0 bits)")
