"""The benchmarks' presets (``--preset NAME``: the argument list behind each committed table) pass each script's own
argument checks, write distinct files, and are each documented in results/README.md."""

import pathlib
import re

import pytest

from scripts import bench_kernels, bench_offload

REPO = pathlib.Path(__file__).resolve().parents[1]

RESULTS_README = (REPO / "results" / "README.md").read_text()


class Parsed(Exception):
    """Raised where bench_offload would start measuring: everything before it (parsing, checks) has passed."""


@pytest.mark.parametrize("name", sorted(bench_offload.PRESETS))
def test_offload_preset_passes_the_benchmarks_checks(name, tmp_path, monkeypatch):
    def stop(args):
        raise Parsed(args)

    monkeypatch.setattr(bench_offload, "Run", stop)
    monkeypatch.setattr(bench_offload, "device_mesh", lambda n: None)  # --mesh 2 on a one-device CPU
    with pytest.raises(Parsed) as parsed:
        bench_offload.main(["--preset", name, "--out", str(tmp_path)])
    (args,) = parsed.value.args
    assert args.out == str(tmp_path) and args.tag == bench_offload.PRESETS[name][1]


def test_presets_write_distinct_files():
    for table, flag in ((bench_offload.PRESETS, "--tag"), (bench_kernels.PRESETS, "--name")):
        names = [args[args.index(flag) + 1] for args in table.values()]
        assert len(set(names)) == len(names), names


@pytest.mark.parametrize("name", sorted(bench_kernels.PRESETS))
def test_kernel_preset_parses_and_names_known_sections(name):
    args = bench_kernels.parser().parse_args(bench_kernels.PRESETS[name])
    assert set(args.sections.split(",")) <= set(bench_kernels.SECTIONS)


def test_every_preset_is_a_documented_command():
    """results/README.md gives each preset as the command of the table it reproduces (the names are unique over both
    scripts, so a name says which script runs it)."""
    assert not set(bench_offload.PRESETS) & set(bench_kernels.PRESETS)
    for name in [*bench_offload.PRESETS, *bench_kernels.PRESETS]:
        assert re.search(rf"--preset {re.escape(name)}(?![\w-])", RESULTS_README), f"results/README.md lacks --preset {name}"
