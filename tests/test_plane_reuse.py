"""scripts/plane_reuse.py: the fixed sets it measures a step's cache against, its synthetic part end to end."""

import numpy as np
import pytest

from scripts import plane_reuse


def test_fixed_set_keeps_the_most_often_read_channel_planes():
    # one group, D = 3, p = 1: the calibration plans read channel 0 to depth 3 always, channel 2 to depth 2 half the
    # time, channel 1 never past plane 0: frequencies (0,1) 1, (0,2) 1, (2,1) 0.5, everything else 0
    calib = np.array([[[3, 1, 2]], [[3, 1, 1]]])
    steps = np.array([[[3, 2, 2]], [[2, 1, 3]]])  # host reads: (0,1) (0,2) (1,1) (2,1); (0,1) (2,1) (2,2)
    # two slots keep (0,1) and (0,2): missed (1,1), (2,1), (2,1), (2,2) of 7
    assert plane_reuse.static_new(steps, calib, resident=1, slots=2) == pytest.approx(4 / 7)
    assert plane_reuse.static_new(steps, calib, resident=1, slots=3) == pytest.approx(2 / 7)  # + (2,1)
    assert plane_reuse.static_new(steps, calib, resident=4, slots=3) == 0.0  # nothing read from the host


def test_gain_set_follows_the_planners_marginal_gains():
    # mean importance (8, 1, 3): gains g 4^-i at planes >= 1: (0,1) 2, (2,1) 0.75, (0,2) 0.5, (1,1) 0.25, ...
    mean_importance = np.array([[8.0, 1.0, 3.0]])
    steps = np.array([[[3, 2, 2]], [[2, 1, 3]]])
    assert plane_reuse.gain_new(steps, mean_importance, resident=1, slots=2) == pytest.approx(3 / 7)  # (0,1) (2,1)
    assert plane_reuse.gain_new(steps, mean_importance, resident=1, slots=3) == pytest.approx(2 / 7)  # + (0,2)


def test_synthetic_part_reports_every_budget_resident_and_window(tmp_path):
    plane_reuse.main(["--no-model", "--steps", "12", "--out", str(tmp_path)])
    text = (tmp_path / "plane_reuse.md").read_text()
    for inputs in ("honest (drift 0.96)", "honest keys, fresh queries"):
        for budget in plane_reuse.BUDGETS:
            for p in plane_reuse.RESIDENT:
                assert f"| {inputs} | {budget} | {budget} | {p} | " in text
    # Fathom 48 at p = 1 reads ~17 channel planes a step from the host, 640 MB at 1M (the benchmark's link bytes)
    row = next(line for line in text.splitlines() if line.startswith("| honest (drift 0.96) | 48 | 48 | 1 |"))
    assert 15 < float(row.split("|")[5]) < 19
    assert "## Residency by plane against residency by channel plane" in text
