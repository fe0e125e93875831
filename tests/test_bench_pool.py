"""scripts/bench_pool.py and scripts/pool_trace.py on the tiny random decoder (CPU): the churn trace is legal and
busy, the benchmark writes its json, report and plot."""

import json

from scripts import bench_pool, pool_trace


def test_the_churn_trace_moves_every_way_and_ends_empty():
    events = pool_trace.churn(sessions=5, slots=2, rounds=40, burst=3, seed=0)
    ops = [e["op"] for e in events]
    assert {"add", "steps", "pause", "resume", "save", "load", "remove"} <= set(ops)
    live = set()
    for e in events:  # replayed: a session is in the pool between its add (or load) and its save or remove, once
        i = e.get("session")
        if e["op"] in ("add", "load"):
            assert i not in live
            live.add(i)
        elif e["op"] in ("pause", "resume", "save", "remove"):
            assert i in live, e
            if e["op"] in ("save", "remove"):
                live.discard(i)
    assert not live and ops.count("add") == ops.count("remove") == 5


def test_the_benchmark_writes_its_results(tmp_path):
    argv = ["--model", "tiny", "--prompt-tokens", "128", "--slots", "2", "--sessions", "4", "--rounds", "6",
            "--burst", "3", "--fixed-steps", "3", "--method", "fathom:32", "--k", "40", "--rows", "model",
            "--out", str(tmp_path), "--tag", "t"]
    assert bench_pool.main(argv) == 0
    res = json.loads((tmp_path / "pool_t.json").read_text())["pool"]
    assert res["step_compiles"] <= 1 and res["pool_tokens_per_s"] > 0 and res["fixed_batch_tokens_per_s"] > 0
    assert len(res["add_s"]) >= 4 and res["session_bytes"] > 0
    assert {e["op"] for e in res["timeline"]} >= {"add", "steps", "remove"}
    assert (res["placement"], res["resident_planes"]) == ("pinned_host", 1)  # issue 47's layout by default
    assert len(res["disk_write_gb_s"]) == len(res["disk_read_gb_s"]) == 3 and min(res["disk_read_gb_s"]) > 0
    assert "| the disk beside it: write + fsync" in (tmp_path / "pool_t.md").read_text()
    assert "| fixed batch of 2" in (tmp_path / "pool_t.md").read_text() and (tmp_path / "pool_t.png").stat().st_size


def test_the_placement_flags_default_to_the_issues_layout_and_fail_by_name(capsys):
    import argparse

    import pytest

    place = lambda **kw: bench_pool.placement(argparse.Namespace(**{"resident_planes": None, **kw}))  # noqa: E731
    assert place(placement="pinned_host").resident_planes == 1 and place(placement="device").resident_planes == 0
    with pytest.raises(SystemExit):
        bench_pool.main(["--placement", "device", "--resident-planes", "1"])
    assert "--resident-planes: placement resident_planes keeps planes" in capsys.readouterr().err


def test_the_disk_rate_writes_and_reads_back_its_bytes(tmp_path):
    write, read = bench_pool.disk_rate(str(tmp_path), (3 << 20) + 5, block=1 << 20)
    assert write > 0 and read > 0 and not list(tmp_path.iterdir())  # its file is gone
