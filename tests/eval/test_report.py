"""The study's figure: every point visible (legend off the data), readable error ticks, k ascending."""

import json
import pathlib

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
    assert titles == [f"k = {k}" for k in sorted(results["meta"]["ks"])]


def test_legend_covers_no_panel(fig):
    renderer = fig.canvas.get_renderer()
    legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends, "the figure has no legend"
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), f"legend overlaps panel {ax.get_title()}"


def test_error_axis_has_plain_number_ticks(fig):
    for ax in fig.axes:
        low, high = ax.get_ylim()
        labels = [t.get_text() for t in ax.get_yticklabels() if low <= t.get_position()[1] <= high and t.get_text()]
        assert len(labels) >= 3, (ax.get_title(), labels)
        for text in labels:
            float(text)  # "0.15", not mathtext like $\mathdefault{10^{-1}}$
