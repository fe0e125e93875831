"""scripts/bench_offload.py and its modules (offload_setup, offload_measure, offload_report): --merge (the newest run
of a measurement wins; errors name their run; notes once), the variants and their labels, drifting queries and the
row-cache table."""

import copy
import json

import numpy as np
import pytest

from pallas_kernels.topk import TopkConfig
from fathom_jax.decode import StepConfig
from scripts import bench_offload, offload_measure, offload_report, offload_runs, offload_setup
from tests.support import bench_offload_rows, offload_file


def part(date: str, median: float, notes: list[str], errors: list[dict]) -> dict:
    machine = {"device": "NVIDIA H200", "devices": 1, "backend": "gpu", "host": "vm", "jax": "0.11.2",
               "commit": "abc1234", "date": date}
    row = {"kind": "attention", "method": "Fathom 48", "context": 131072, "batch": 1, "memory": "pinned_host",
           "mesh": 1, "shared_kv": False, "tag": "", "median_ms": median, "min_ms": median, "max_ms": median,
           "bits_per_token": 57.7, "scan_bytes": 2.7e8, "row_bytes_max": 3.0e8, "link_floor_ms": float("nan")}
    return {"machine": machine, "command": f"bench at {date}", "config": {"read": "staged", "mesh": 1, "link_bytes": 2**31},
            "rows": [row], "errors": errors, "notes": notes, "link": {"device0": {"GBps": 50.0}}}


def test_merge_keeps_the_newest_row_and_dates_errors(tmp_path):
    old = part("2026-11-29T10:00:00+00:00", 22.0, ["bulk cache arrays in pinned_host memory"],
               [{"section": "batch 4", "error": "skipped: time budget spent"}])
    new = part("2026-11-30T10:00:00+00:00", 20.6, ["bulk cache arrays in pinned_host memory"], [])
    paths = []
    for name, p in (("old", old), ("new", new)):
        paths.append(str(tmp_path / f"{name}.json"))
        json.dump(p, open(paths[-1], "w"))
    offload_report.merge(paths, str(tmp_path / "merged"))
    res = json.load(open(tmp_path / "merged.json"))
    (row,) = res["rows"]
    assert row["median_ms"] == 20.6 and row["run_date"] == new["machine"]["date"]
    assert res["machine"]["date"] == new["machine"]["date"]
    assert res["notes"].count("bulk cache arrays in pinned_host memory") == 1
    assert res["errors"] == [{"section": "batch 4", "error": "skipped: time budget spent",
                              "run_date": old["machine"]["date"]}]
    report = (tmp_path / "merged.md").read_text()
    assert "- batch 4 (run of 2026-11-29T10:00): skipped" in report
    # Merging the merged file again keeps what each error recorded.
    again = copy.deepcopy(res)
    json.dump(again, open(tmp_path / "again.json", "w"))
    offload_report.merge([str(tmp_path / "again.json")], str(tmp_path / "merged2"))
    merged2 = json.load(open(tmp_path / "merged2.json"))
    assert merged2["errors"][0]["run_date"] == old["machine"]["date"]
    # ... and one count of the rows superseded over all its merges, not one note per merge.
    json.dump(new | {"machine": {**new["machine"], "date": "2026-12-01T10:00:00+00:00"}}, open(tmp_path / "newer.json", "w"))
    offload_report.merge([str(tmp_path / "merged2.json"), str(tmp_path / "newer.json")], str(tmp_path / "merged3"))
    notes = [n for n in json.load(open(tmp_path / "merged3.json"))["notes"] if "superseded" in n]
    assert notes == ["2 rows of earlier runs superseded by later runs of the same measurement"]


def step_configs(**options) -> list[StepConfig]:
    """The step configurations a run gets from the option flags ``options`` (in order)."""
    run = offload_runs.OffloadRun()
    for key, text in options.items():
        run = run.set(key, text)
    return list(run.configs)


def test_variants_and_their_labels():
    """--index-writes x --pipeline (``--read`` for all): "auto" where a part is not given; every variant a valid step
    configuration."""
    got = step_configs(read="staged", index_writes="full_blocks", pipeline="auto,1/0,8/66,4")
    assert got == [StepConfig(index_writes="full_blocks", pipeline=p, gather_programs=g)
                   for p, g in (("auto", "auto"), (1, 0), (8, 66), (4, "auto"))]
    # the kernels' options: row-fetch programs x top-k x extra XLA option sets
    got = step_configs(fetch_programs="auto,0", topk="auto,single",
                       xla_options="none;xla_gpu_enable_triton_gemm=false,xla_foo=3")
    assert len(got) == 8 and {v.fetch_programs for v in got} == {"auto", 0}
    assert {v.xla_options for v in got} == {(), (("xla_foo", "3"), ("xla_gpu_enable_triton_gemm", False))}
    # a value may hold commas (a list of enums); layers per loop iteration: one row each
    got = step_configs(xla_options="xla_gpu_enable_command_buffer=FUSION,WHILE,xla_foo=3", layer_unroll="1,2")
    assert [v.layer_unroll for v in got] == [1, 2]
    assert got[0].xla_options == (("xla_foo", "3"), ("xla_gpu_enable_command_buffer", "FUSION,WHILE"))
    with pytest.raises(ValueError, match="--layer-unroll"):
        step_configs(layer_unroll="0")
    assert "2 layers per loop iteration" in offload_report.split_text({"layer_unroll": 2}) and offload_report.split_text({"layer_unroll": 1}) == ""
    assert [v.row_cache for v in step_configs(row_cache="0,4096")] == [0, 4096]
    assert offload_report.split_text({"row_cache": 4096}) == "row cache 4096 slots"
    with pytest.raises(ValueError, match="--row-cache"):
        step_configs(row_cache="-1")
    with pytest.raises(ValueError, match="--topk entries"):
        step_configs(topk="sorted")
    got = step_configs(topk="b8t4,bautot8")
    assert [v.topk for v in got] == [TopkConfig(bucket_splits=8, token_splits=4), TopkConfig(bucket_splits="auto",
                                                                                            token_splits=8)]
    assert offload_setup.topk_config("b8t4") == TopkConfig(bucket_splits=8, token_splits=4)
    assert [offload_setup.topk_name(offload_setup.topk_config(n)) for n in ("auto", "single", "b8t4", "bautot8")] == \
        ["auto", "single", "b8t4", "bautot8"]
    with pytest.raises(ValueError, match="power of two"):
        step_configs(topk="b3t4")
    # the plane scan's arithmetic: one row each; named back from the configuration a bound hook runs
    assert [offload_setup.scan_name(v.scan) for v in step_configs(scan="default,f16x2")] == ["default", "f16x2"]
    assert offload_setup.scan_name(offload_setup.scan_config("f16x2")) == "f16x2"
    assert offload_setup.scan_name(None) == "default" and offload_report.split_text({"scan": "f16x2"}) == "scan f16x2"
    with pytest.raises(ValueError, match="--scan entries"):
        step_configs(scan="bf16")
    with pytest.raises(ValueError, match="index_writes must be one of"):  # StepConfig checks every variant
        step_configs(index_writes="sometimes")
    assert offload_report.writes_text({"index_writes": "every_step", "scan_writes": True}) == "every_step in scan"
    assert offload_report.writes_text({}) == "every_step"
    text = offload_report.split_text  # (rows of the deleted GPU streams option still render)
    assert text({"streams": 2}) == "streams 2" and text({"pipeline": 8, "gather_programs": 66}) == "pipeline 8 (gather 66)"
    assert text({"pipeline": 1, "gather_programs": 66}) == "gather 66" and text({}) == ""
    assert text({"pipeline": 2, "gather_programs": 66, "fetch_programs": 66, "topk": "auto", "xla_options": "a=1"}) == \
        "pipeline 2 (gather 66); fetch 66; top-k split; xla: a=1"
    # rows of the deleted two-kernel selection and chained chunk order still render, named as they ran
    assert text({"pipeline": 8, "gather_programs": 66, "selection": "fused", "order": "chained"}) == \
        "pipeline 8 (gather 66); selection fused; order chained"
    assert text({"selection": "topk_union", "order": "xla"}) == ""


def test_drifting_queries_are_an_ar1_sequence():
    q = np.random.default_rng(0).standard_normal((4, 8, 4, 128)).astype(np.float32)
    seq = [np.asarray(x) for x in offload_setup.drifting_queries(q, 0.95, count=40)]
    assert len(seq) == 40 and all(x.shape == q.shape for x in seq)
    lag1 = np.mean([np.corrcoef(a.ravel(), b.ravel())[0, 1] for a, b in zip(seq, seq[1:])])
    assert abs(lag1 - 0.95) < 0.01 and abs(np.std(seq[-1]) - 1) < 0.05  # stationary: the variance stays 1


def test_row_cache_report_puts_each_row_beside_the_step_without_a_cache():
    base = dict(kind="attention", method="Fathom 48", context=131072, batch=8, query_drift=0.95, pipeline=2,
                index_writes="every_step", min_ms=0, max_ms=0, link_floor_ms=50.0, row_bytes_max=2e8)
    rows = [dict(base, median_ms=120.0, row_cache=0),
            dict(base, median_ms=80.0, row_cache=16384, row_hit_fraction=0.6, row_bytes_fetched=8e7,
                 link_floor_fetched_ms=40.0),
            dict(base, kind="full", query_drift=None, median_ms=130.0)]  # no cache, no drift: not a row of its own
    lines = offload_report.row_cache_lines(rows)
    table = [line for line in lines if line.startswith("| attention")]
    assert len(table) == 2 and not any(line.startswith("| full") for line in lines)
    assert "| 16384 | 60% | 80 |" in table[1] and table[1].endswith("| 40.0 | 2.00 | 1.50x |")
    assert offload_report.row_cache_lines([rows[2]]) == []


def test_resident_planes_table_compares_with_the_host_index_without_warm_planes():
    """``vs p = 0`` divides by the step with every plane on the host and none warm, whatever order the rows come in."""
    base = dict(kind="attention", method="Fathom 48", context=1 << 20, batch=1, rows="k8v8", memory="pinned_host",
                index_host_bytes=2e10, index_hbm_bytes=0, row_bytes_max=1.5e8, min_ms=0, max_ms=0, link_floor_ms=2.0)
    rows = [dict(base, resident_planes=0, warm_planes=0, median_ms=60.0, link_scan_bytes=2e9),
            dict(base, resident_planes=0, warm_planes=48, median_ms=30.0, link_scan_bytes=0),
            dict(base, resident_planes=1, warm_planes=0, median_ms=40.0, link_scan_bytes=6e8)]
    table = [line for line in offload_report.tier_lines(rows[::-1]) if line.startswith("| Fathom 48")]
    assert [line.split("|")[-3:-1] for line in table] == [[" 1.00x ", " 1.00 "], [" 2.00x ", " 0.00 "],
                                                          [" 1.50x ", " 0.30 "]]


def test_merge_keeps_an_older_profile_dated_when_the_newer_run_has_none(tmp_path):
    """A newer median of a measurement without a profile keeps the older run's breakdown, which the report dates."""
    old = part("2026-11-29T10:00:00+00:00", 22.0, [], [])
    old["rows"][0]["profile"] = {"wall_ms_per_step": 23.0, "device_span_ms_per_step": 22.5,
                                 "device_busy_ms_per_step": 22.0, "ms_per_step": {"row fetch": 6.0}}
    new = part("2026-11-30T10:00:00+00:00", 20.6, [], [])
    paths = [str(tmp_path / "old.json"), str(tmp_path / "new.json")]
    for path, p in zip(paths, (old, new)):
        json.dump(p, open(path, "w"))
    offload_report.merge(paths, str(tmp_path / "merged"))
    (row,) = json.load(open(tmp_path / "merged.json"))["rows"]
    assert row["median_ms"] == 20.6 and row["profile"]["ms_per_step"] == {"row fetch": 6.0}
    assert row["profile_run_date"] == old["machine"]["date"]
    assert "(profiled in the run of 2026-11-29T10:00; median above from 2026-11-30T10:00)" in \
        (tmp_path / "merged.md").read_text()


def test_rows_formats_run_side_by_side_on_cpu(tmp_path, monkeypatch):
    """``--rows model,k8v8``: one set of attention-only rows per format over a cache of its own (tiny shapes with the
    benchmark's head_dim 128, XLA kernels), each recording its format, its row bytes (bf16 K and V: 512 B per token;
    k8v8: the layout's words), its host bytes per token and tokens per second; the report puts them side by side.
    (The full step's rows go through the same row bookkeeping; tests/rows/test_layout.py decodes every format.)"""
    import jax.numpy as jnp

    from fathom_jax.rows.layout import RowLayout

    res, cfg = bench_offload_rows(tmp_path, monkeypatch, "rows", "--sections", "attn", "--rows", "model,k8v8")
    assert res["config"]["rows"] == [{"name": "model", "share_kv_from": None}, {"name": "k8v8", "share_kv_from": None}]
    got = {(r["kind"], r["rows"]): r for r in res["rows"]}
    assert set(got) == {("attention", rows) for rows in ("model", "k8v8")}
    k8v8 = RowLayout.of("k8v8", 128, jnp.bfloat16).row_bytes
    assert k8v8 == 260  # 128 8-bit codes and an fp16 scale for K, the same for V, in whole words
    index = 4 * 128 / 8 + 2 * 128 / 64  # 4-bit planes and fp16 block scales per token
    for (kind, rows), r in got.items():
        row_bytes = 512 if rows == "model" else k8v8
        assert r["row_bytes_per_token"] == row_bytes and r["shared_kv"] is False
        assert r["index_bytes_per_token"] == pytest.approx(index)
        assert r["host_bytes_per_token"] == r["host_bytes_per_token_own"] == pytest.approx(row_bytes + index)
        # the selected rows of a step (the union's upper bound): layers x groups x min(G k, context) rows
        assert r["row_bytes_max"] == 2 * 2 * min(2 * 64, 128) * row_bytes
        assert r["tokens_per_s"] == pytest.approx(1e3 / r["median_ms"])
    assert got["attention", "model"]["host_bytes_per_token"] == 580  # the figure at Dh = 128
    report = offload_file(tmp_path, "rows", "md").read_text()
    table = report.split("## K/V row formats")[1].split("\n## ")[0]
    lines = [line for line in table.splitlines() if line.startswith(("| attention", "| full"))]
    assert [line.split(" | ")[4] for line in lines] == ["model", "k8v8"]
    assert "| 328 | 328 | 260 |" in lines[1] and "| 580 | 580 | 512 |" in lines[0]
    assert "rows k8v8" in report  # the step tables' split column names the format
    # One row buffer for every layer (shared_kv) is counted once as held; "own" is every layer's own rows.
    from fathom_jax.placement import Placement

    calib, _ = offload_setup.synthetic_calibration(cfg)
    attn = offload_setup.hook("fathom:48", calib, 64, Placement("pinned_host"), "xla", rows="k8v8")
    shared = attn.init_cache(offload_setup.cache_shape(cfg, 1, 128), shared_kv=True)
    fields = offload_measure.host_fields(shared, Placement("pinned_host"))
    assert fields["host_bytes_per_token"] == pytest.approx(k8v8 / cfg.n_layers + index)
    assert fields["host_bytes_per_token_own"] == pytest.approx(k8v8 + index) == 328
    assert offload_measure.host_fields(shared, Placement("device"))["host_bytes_per_token"] is None


def test_rows_entries_and_their_errors(capsys):
    run = offload_runs.OffloadRun(share_kv_from=1 << 20)
    rows = run.set("rows", "k8v8@none, model@512k").row_sets
    assert [(r.name, r.share_kv_from) for r in rows] == [("k8v8", None), ("model", 524288)]
    assert rows[0].format.spec == "k8v8" and rows[1].format is None
    assert [r.share_kv_from for r in run.set("rows", "model,k8v4g32a").row_sets] == [1 << 20, 1 << 20]
    for bad, match in (("k9v8", "unknown row format"), ("k4c64av8", "per block of tokens"), ("model,model", "twice")):
        with pytest.raises(ValueError, match=match):
            run.set("rows", bad)
        with pytest.raises(SystemExit):
            bench_offload.main(["--smoke", "--rows", bad, "--out", "/nonexistent"])
        assert "--rows:" in capsys.readouterr().err


def test_warm_planes_rows_on_cpu(tmp_path, monkeypatch):
    """``--resident-planes 0,1 --warm-planes 0,8``: rows with warm planes beside ones without (tiny shapes, XLA
    kernels): the warm tier's HBM bytes counted, fewer plane bytes over the link (the step's queries chose them), the
    report's tier table naming them."""
    res, _ = bench_offload_rows(tmp_path, monkeypatch, "warm", "--sections", "attn", "--resident-planes", "0,1",
                                "--warm-planes", "0,8")
    got = {(r["resident_planes"], r["warm_planes"]): r for r in res["rows"]}
    assert set(got) == {(0, 0), (0, 8), (1, 0), (1, 8)}
    cold, warm = got[1, 0], got[1, 8]
    words = (128 + 64) // 32  # the cache's room: the context and 64 more tokens
    # the warm tier's words [L, R, S, W] and its map [L, R, D, 4] int32
    assert warm["index_hbm_bytes"] - cold["index_hbm_bytes"] == 2 * 2 * 8 * words * 4 + 2 * 2 * 128 * 4 * 4
    assert 0 < warm["link_scan_bytes"] < cold["link_scan_bytes"]
    # no resident plane: the scales, one unread hot row and the warm planes in HBM; neither scales nor warm planes
    # cross the link
    assert got[0, 8]["index_hbm_bytes"] == 2 * 2 * 128 * (words // 2) * 2 + 1 * 2 * 128 * words * 4 + \
        2 * 2 * 8 * words * 4 + 2 * 2 * 128 * 4 * 4  # scales [L, R, D, NB] f16, the hot row, the warm tier, its map
    assert 0 < got[0, 8]["link_scan_bytes"] < got[0, 0]["link_scan_bytes"]
    report = offload_file(tmp_path, "warm", "md").read_text()
    assert "| 1 + 8 warm |" in report and "| 0 + 8 warm |" in report
    with pytest.raises(SystemExit):
        bench_offload.main(["--smoke", "--warm-planes", "-1", "--out", str(tmp_path)])


def test_shared_selection_rows_on_cpu(tmp_path, monkeypatch):
    """A selection shared across layers beside per-layer Fathom in one run: only its selection layer's planes count,
    over the link too, and its sharing layer fetches the shared set's rows."""
    from scripts import offload_setup

    monkeypatch.setitem(offload_setup.METHODS, "Fathom 48 shared", "fathom:48@share=0@budget=96")
    res, _ = bench_offload_rows(tmp_path, monkeypatch, "shared", "--sections", "attn", "--methods",
                                "Fathom 48,Fathom 48 shared")
    got = {r["method"]: r for r in res["rows"]}
    per_layer, shared = got["Fathom 48"], got["Fathom 48 shared"]
    # of 2 layers layer 0 selects (its plan reads about half the step's bits)
    assert 0.3 < shared["scan_bytes"] / per_layer["scan_bytes"] < 0.7
    assert shared["link_scan_bytes"] / shared["scan_bytes"] == per_layer["link_scan_bytes"] / per_layer["scan_bytes"]
    # rows: layer 1 fetches its 96 shared positions, each layer of the other min(G k, context) = 128
    assert shared["row_bytes_max"] / per_layer["row_bytes_max"] == (128 + 96) / (2 * 128)


def test_batch_rows_of_every_method_and_input_set_on_cpu(tmp_path, monkeypatch):
    """``attnbatch`` measures every method and input set at each batch, as ``attn`` does (issue 57's 128k x 8 row:
    the shared selection beside per-layer Fathom, honest inputs); ``dense`` runs (its method reads no planes)."""
    from scripts import offload_setup

    monkeypatch.setitem(offload_setup.METHODS, "Fathom 48 shared", "fathom:48@share=0@budget=96")
    res, _ = bench_offload_rows(tmp_path, monkeypatch, "batch", "--sections", "attnbatch,dense", "--batches", "2",
                                "--methods", "Fathom 48,Fathom 48 shared", "--inputs", "today,honest")
    got = {(r["method"], r["batch"], r["inputs"]) for r in res["rows"] if r["method"] != "dense"}
    assert got == {(m, 2, i) for m in ("Fathom 48", "Fathom 48 shared") for i in ("today", "honest")}
    assert [r["batch"] for r in res["rows"] if r["method"] == "dense"] == [1]


def test_committed_results_render_through_the_migration(tmp_path):
    """Every committed offload results file renders through :func:`offload_report.migrate` (old rows upgraded to
    today's fields, no live defaults in the report): migrating twice changes nothing, and the tables today's report
    wrote re-render from their JSON bit for bit (every table was re-rendered by it once: older reports had worded
    the notes and columns differently; the numbers are the JSON's)."""
    import pathlib

    results = pathlib.Path(__file__).resolve().parents[1] / "results"
    files = sorted(results.glob("offload_h200*.json"))
    assert len(files) >= 19
    for path in files:
        res = json.load(open(path))
        once = [offload_report.migrate(r, res["config"]) for r in res["rows"]]
        assert [offload_report.migrate(r, res["config"]) for r in once] == once
        assert set(offload_report.OLD_ROW_FIELDS) <= set.intersection(*(set(r) for r in once))
    # every committed table, the H100 selection runs' rows of the deleted threshold selection among them
    for path in sorted(results.glob("offload_h*.json")):
        offload_report.write_report(json.load(open(path)), str(tmp_path / path.stem))
        assert (tmp_path / f"{path.stem}.md").read_text() == path.with_suffix(".md").read_text(), path.name
