"""The profiler-trace arithmetic of scripts/harness.py (the benchmarks' breakdowns): what runs while no plane
transfer does, and the gaps between transfers; and ``--preset NAME`` on a benchmark's command line."""

import gzip
import json

import pytest

from scripts import harness, trace_gaps


def kernel(name, ts, dur):
    return {"ph": "X", "name": name, "ts": float(ts), "dur": float(dur), "pid": 1, "tid": 1}


# Two layers' transfers (two chained chunks each) with a boundary between them: the scan and top-k of the last
# chunk, then the row fetch beside nothing, then the next layer's plan. Microseconds.
EVENTS = [
    kernel("run_gather", 0, 100), kernel("run_gather__1", 100, 100), kernel("fathom_plane_scan", 150, 80),
    kernel("topk_local_buckets", 230, 20), kernel("row_fetch", 250, 30), kernel("sort_1", 260, 10),
    kernel("water_line", 290, 10), kernel("run_gather", 300, 100), kernel("run_gather__1", 400, 50),
    kernel("fathom_plane_scan", 420, 40),
]


def test_time_outside_transfers_is_split_among_what_runs_then():
    got = harness.exposed_time(EVENTS)
    assert got["transfer_running"] == pytest.approx(0.350)  # [0, 200) and [300, 450)
    out = got["outside_transfers"]
    # [200, 230) scan; [230, 250) top-k; [250, 260) fetch; [260, 270) fetch + sort; [270, 280) fetch; [280, 290)
    # idle; [290, 300) plan; [450, 460) the last scan
    assert out == pytest.approx({"plane scan kernel": 0.040, "top-k": 0.020, "row fetch": 0.025, "other": 0.005,
                                 "idle": 0.010, "planner (water line)": 0.010})
    by_name = harness.exposed_time(EVENTS, key=str)["outside_transfers"]
    assert by_name["row_fetch"] == pytest.approx(0.025) and by_name["sort_1"] == pytest.approx(0.005)
    assert sum(by_name.values()) == pytest.approx(sum(out.values()))


def test_gaps_between_transfers_and_the_median_gap_kernel_by_kernel():
    assert harness.transfer_gaps(EVENTS) == [(200.0, 300.0)]  # chained chunks merge; the last transfer ends it
    gap = harness.gap_timeline(EVENTS, min_us=50)
    assert gap["gaps"] == 1 and gap["median_us"] == 100.0 and gap["total_ms"] == pytest.approx(0.1)
    names = [k["name"] for k in gap["kernels"]]
    assert names == ["fathom_plane_scan", "topk_local_buckets", "row_fetch", "sort_1", "water_line"]
    assert gap["kernels"][0]["start_us"] == -50.0 and gap["kernels"][-1]["end_us"] == 100.0
    assert harness.gap_timeline(EVENTS, min_us=150) == {}


def test_trace_gaps_reports_a_saved_trace(tmp_path):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    trace_gaps.main(["--out", str(tmp_path / "gaps"), "--steps", "1", "--note", "synthetic", f"layer={path}"])
    res = json.loads((tmp_path / "gaps.json").read_text())
    assert res["traces"]["layer"]["transfer_running_ms_per_step"] == pytest.approx(0.35)
    assert res["traces"]["layer"]["span_ms_per_step"] == pytest.approx(0.46)
    text = (tmp_path / "gaps.md").read_text()
    assert "## layer" in text and "| `row_fetch` | 0.025 |" in text and "| 50.0 | 80.0 | `row_fetch` |" in text
    assert "its plane transfers 200 us" in text


def test_a_layer_splits_into_its_transfers_its_tail_and_the_boundary():
    # Layer 1: transfers [0, 200), its last row fetch ends at 280, layer 2's first transfer starts at 300. Layer 2 has
    # no next layer to end it and is left out.
    assert trace_gaps.layer_phases(EVENTS) == {"transfers": 200.0, "tail": 80.0, "boundary": 20.0, "layers": 1}
    no_fetch = [e for e in EVENTS if e["name"] != "row_fetch"]
    assert trace_gaps.layer_phases(no_fetch) == {}


PRESETS = harness.presets({"a": '--tag a --methods "Fathom 48,SparQ r=16" --steps 3', "b": "--sections link"})


def test_a_preset_comes_first_so_the_command_line_overrides_it():
    assert PRESETS["a"] == ["--tag", "a", "--methods", "Fathom 48,SparQ r=16", "--steps", "3"]
    assert harness.expand_preset(["--out", "x", "--preset", "a", "--steps", "5"], PRESETS) == [
        "--tag", "a", "--methods", "Fathom 48,SparQ r=16", "--steps", "3", "--out", "x", "--steps", "5"]
    assert harness.expand_preset(["--preset=b"], PRESETS) == ["--sections", "link"]
    assert harness.expand_preset(["--steps", "5"], PRESETS) == ["--steps", "5"]


@pytest.mark.parametrize("argv, message", [(["--preset", "c"], "'c' is not a preset; presets: a, b"),
                                           (["--preset"], "'' is not a preset"),
                                           (["--preset", "a", "--preset=b"], "give one preset")])
def test_a_bad_preset_is_one_clear_line(argv, message):
    with pytest.raises(SystemExit, match=message):
        harness.expand_preset(argv, PRESETS)


def test_machine_name_says_which_device_ran():
    """Result files carry the machine a run used (``offload_h100_attn`` on an H100), not a hard-coded one."""
    from types import SimpleNamespace

    def devices(kind, n=1, platform="gpu"):
        return [SimpleNamespace(device_kind=kind, platform=platform)] * n

    assert harness.machine_name(devices("NVIDIA H200")) == "h200"
    assert harness.machine_name(devices("NVIDIA H100 80GB HBM3")) == "h100"
    assert harness.machine_name(devices("NVIDIA H200", 2)) == "h200x2"
    assert harness.machine_name(devices("cpu", platform="cpu")) == "cpu"
