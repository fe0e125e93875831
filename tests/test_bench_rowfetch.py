"""scripts/bench_rowfetch.py: its index patterns touch the pages they say, and the whole script runs on CPU at a tiny
size through the row-fetch kernel (interpreted), every fetched row checked."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import row_fetch as RF
from scripts import bench_rowfetch as bench
from tests.support import count_pallas_calls

N, SLOTS, ROW = 16384, 256, 260  # a group of 16384 rows of 260 B (4 MB)


@pytest.mark.parametrize("pattern", bench.PATTERNS)
def test_patterns_are_in_range_and_sorted_but_scattered(pattern):
    idx = bench.index_sets(pattern, 3, 2, N, SLOTS, ROW)
    assert idx.shape == (3, 2, SLOTS) and idx.dtype == np.int32
    assert idx.min() >= 0 and idx.max() < N
    ordered = (np.diff(idx, axis=-1) >= 0).all()
    assert ordered != (pattern == "scattered")
    assert (idx[0] == idx[1]).all() == (pattern == "repeated")  # repeated: one set every call; else a new one


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_page_patterns_put_k_whole_rows_in_each_page(k):
    idx = bench.index_sets(f"page-{k}", 2, 2, N, SLOTS, ROW).astype(np.int64)
    start, end = idx * ROW // bench.PAGE, (idx * ROW + ROW - 1) // bench.PAGE
    assert (start == end).all()  # every row lies wholly inside one page
    for group in idx.reshape(-1, SLOTS):
        assert len(np.unique(group)) == SLOTS
        pages, rows_per_page = np.unique(group * ROW // bench.PAGE, return_counts=True)
        assert (rows_per_page == k).all() and len(pages) == SLOTS // k


def test_windows_and_runs_stay_where_they_say():
    rows = 65536 // ROW  # 252 rows per 64 KB window, 63 of them drawn
    win = bench.index_sets("window-64KB", 1, 1, N, SLOTS, ROW)[0, 0].astype(np.int64)
    windows, per = np.unique(win // rows, return_counts=True)
    assert len(np.unique(win)) == SLOTS and len(windows) == -(-SLOTS // (rows // 4)) and (per <= rows // 4).all()
    runs = bench.index_sets("run-16", 1, 1, N, SLOTS, ROW)[0, 0].reshape(-1, 16)
    assert (runs[:, 0] % 16 == 0).all() and (runs - runs[:, :1] == np.arange(16)).all()
    scattered = bench.index_sets("sorted", 1, 1, N, SLOTS, ROW)[0]
    assert bench.touched(runs.reshape(1, -1), N, ROW, bench.PAGE) < bench.touched(scattered, N, ROW, bench.PAGE) / 4


def test_bad_patterns_and_sizes_are_refused(capsys):
    with pytest.raises(ValueError, match="unknown pattern"):
        bench.index_sets("stripes", 1, 1, N, SLOTS, ROW)
    with pytest.raises(ValueError, match="rows of 260 B per page"):
        bench.index_sets("page-16", 1, 1, N, SLOTS, ROW)
    with pytest.raises(SystemExit):
        bench.main(["--gigabytes", "0.0001", "--out", "/nonexistent"])
    assert "--slots" in capsys.readouterr().err


def test_fetch_runs_the_kernel():
    kv = jnp.zeros((2, 1024, 65), jnp.uint32)
    idx = jnp.zeros((2, 64), jnp.int32)
    assert count_pallas_calls(bench.fetch, kv, idx, config=RF.RowFetchConfig(), name=RF.KERNEL_NAME) == 1


def test_the_script_runs_on_cpu_at_a_tiny_size(tmp_path):
    bench.main(["--gigabytes", "0.002", "--groups", "2", "--slots", "64", "--reps", "2", "--repeats", "1",
                "--link-bytes", "65536", "--patterns", "scattered,sorted,page-4,run-16", "--programs", "0,2",
                "--out", str(tmp_path), "--tag", "cpu", "--no-thp"])
    res = json.load(open(tmp_path / "rowfetch_pages_cpu.json"))
    got = [(r["pattern"], r["programs"], r["array"]) for r in res["rows"]]
    assert got == [("scattered", 0, "first"), ("sorted", 0, "first"), ("page-4", 0, "first"), ("run-16", 0, "first"),
                   ("sorted", 2, "first")]
    assert all(r["exact"] for r in res["rows"]) and all(r["GBps"] > 0 for r in res["rows"])
    assert "always" not in res["thp"]  # --no-thp (and on a CPU it is never tried): the setting left alone
    assert set(res["device_put"]) == {"one call's bytes", "link bytes"}
    page4 = res["rows"][2]
    assert page4["pages_4k"] <= 2 * 64 // 4  # 16 pages a group, at most
    report = (tmp_path / "rowfetch_pages_cpu.md").read_text()
    assert report.count("| True |") == 5
