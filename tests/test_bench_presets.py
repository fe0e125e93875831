"""The benchmarks' presets (``--preset NAME``: the argument list behind each committed table) pass each script's own
argument checks, write distinct files, and are each documented in results/README.md."""

import dataclasses
import pathlib
import re

import pytest

from fathom_jax.decode import StepConfig
from scripts import bench_kernels, bench_offload, offload_runs

REPO = pathlib.Path(__file__).resolve().parents[1]

RESULTS_README = (REPO / "results" / "README.md").read_text()


class Parsed(Exception):
    """Raised where bench_offload would start measuring: everything before it (parsing, checks) has passed."""


@pytest.mark.parametrize("name", sorted(offload_runs.PRESETS))
def test_offload_preset_builds_and_runs_as_the_command_line(name, tmp_path, monkeypatch):
    """Each preset is a function returning a checked run record; ``--preset NAME`` runs exactly it, and ``--set`` /
    the option flags change it field by field."""
    run = offload_runs.PRESETS[name]()
    assert isinstance(run, offload_runs.OffloadRun) and run.tag

    def stop(spec, out, placement):
        raise Parsed(spec, out)

    monkeypatch.setattr(bench_offload, "Run", stop)
    monkeypatch.setattr(bench_offload, "device_mesh", lambda n: None)  # --mesh 2 on a one-device CPU
    with pytest.raises(Parsed) as parsed:
        bench_offload.main(["--preset", name, "--out", str(tmp_path)])
    assert parsed.value.args == (run, str(tmp_path))
    with pytest.raises(Parsed) as parsed:
        bench_offload.main(["--preset", name, "--out", str(tmp_path), "--set", "time_budget=7", "--tag", "x"])
    assert parsed.value.args[0] == dataclasses.replace(run, time_budget=7.0, tag="x")


def test_options_parse_to_typed_fields():
    run = offload_runs.OffloadRun().set("pipeline", "auto,1/0").set("index-writes", "every_step,full_blocks")
    assert len(run.configs) == 4 and StepConfig(pipeline=1, gather_programs=0, index_writes="full_blocks") in run.configs
    run = run.set("config", "pipeline=8,read=direct;layer_unroll=2")
    assert run.configs == (StepConfig(pipeline=8, read="direct"), StepConfig(layer_unroll=2))
    run = run.set("rows", "k8v8@none,model").set("share_kv_from", "1m")
    assert [(r.name, r.share_kv_from) for r in run.row_sets] == [("k8v8", None), ("model", 1 << 20)]
    for key, bad in (("methods", "Fathom 47"), ("sections", "attn,lunch"), ("resident_planes", "5"), ("query_drift", "1"),
                     ("topk", "b3t4"), ("nonsense", "1")):
        with pytest.raises(ValueError):
            offload_runs.OffloadRun().set(key, bad)


def test_presets_write_distinct_files():
    tags = [fn().tag for fn in offload_runs.PRESETS.values()]
    assert len(set(tags)) == len(tags), tags
    names = [args[args.index("--name") + 1] for args in bench_kernels.PRESETS.values()]
    assert len(set(names)) == len(names), names


@pytest.mark.parametrize("name", sorted(bench_kernels.PRESETS))
def test_kernel_preset_parses_and_names_known_sections(name):
    args = bench_kernels.parser().parse_args(bench_kernels.PRESETS[name])
    assert set(args.sections.split(",")) <= set(bench_kernels.SECTIONS)


def test_every_preset_is_a_documented_command():
    """results/README.md gives each preset as the command of the table it reproduces (the names are unique over both
    scripts, so a name says which script runs it)."""
    assert not set(offload_runs.PRESETS) & set(bench_kernels.PRESETS)
    for name in [*offload_runs.PRESETS, *bench_kernels.PRESETS]:
        assert re.search(rf"--preset {re.escape(name)}(?![\w-])", RESULTS_README), f"results/README.md lacks --preset {name}"


@pytest.mark.parametrize("name", sorted(offload_runs.PRESETS))
def test_each_offload_preset_names_its_results_row(name):
    """A preset names the results file whose results/README.md row gives it as its command (or, not run yet, stands
    under "Written, not run yet")."""
    results = offload_runs.PRESET_RESULTS[name]
    cited = rf"--preset {re.escape(name)}(?![\w-])"
    if results is None:
        assert re.search(cited, RESULTS_README.split("## Written, not run yet")[1])
        return
    rows = [line for line in RESULTS_README.splitlines() if line.startswith("| `") and
            re.search(rf"`{re.escape(results)}[.{{_]", line.split("|")[1])]
    assert rows and any(re.search(cited, row) for row in rows), f"{results}'s row does not give --preset {name}"
