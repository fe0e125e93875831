"""The downstream sweeps through the CLI (fathom_jax/eval/sweeps.py, commands.py): an interrupted ``fathom
agreement`` run resumed gives the uninterrupted run's results, and repeated values are refused."""

import json

import pytest

from fathom_jax import cli
from fathom_jax.eval import downstream as ds

ARGV = ["agreement", "--context", "512", "--sessions", "2", "--batch", "1", "--steps", "4", "--k-fraction", "0.125",
        "--methods", "dense", "exact", "--baseline", "exact", "--calib-tokens", "256", "--quiet"]


def _results(path):
    res = json.loads(path.read_text())
    timing = {k: res["meta"].pop(k) for k in ("wall_s", "prefill_s", "decode_s", "compile_s", "command", "date")}
    return res, timing


def test_interrupted_agreement_resumes_to_the_uninterrupted_results(capsys, monkeypatch, tmp_path, tiny_smollm2):  # noqa: F811
    """Two batches x two branches (dense, exact@64): Ctrl-C during the third decode keeps batch 0's two; --resume
    skips batch 0 (no prefill), decodes batch 1's two and writes what one run writes."""
    assert cli.main([*ARGV, "--out", str(tmp_path / "whole")]) == 0
    want, _ = _results(tmp_path / "whole" / "agreement_smollm2_512.json")

    decode, calls, stop_at = ds.decode_branch, [], [3]

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == stop_at[0]:
            raise KeyboardInterrupt
        return decode(*args, **kwargs)

    monkeypatch.setattr(ds, "decode_branch", interrupted)
    out = tmp_path / "split"
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        cli.main([*ARGV, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    partial = out / "agreement_smollm2_512.partial.jsonl"
    assert stop.value.code == 130 and len(err) == 1
    assert err[0] == (f"[agreement] interrupted: 2 finished decodes in {partial}; to continue where it stopped, run: "
                      f"fathom {' '.join(ARGV)} --out {out} --resume")
    assert not (out / "agreement_smollm2_512.json").exists()

    calls.clear()
    stop_at[0] = None
    assert cli.main([*ARGV, "--out", str(out), "--resume"]) == 0
    assert len(calls) == 2 * 2 - 2 and not partial.exists()
    got, timing = _results(out / "agreement_smollm2_512.json")
    assert got["meta"].pop("resumed_units") == 2
    assert got == want
    assert timing["decode_s"] > 0 and timing["compile_s"] >= 0
    # resuming a finished run does nothing
    calls.clear()
    assert cli.main([*ARGV, "--out", str(out), "--resume"]) == 0 and not calls
    assert "holds this configuration's results already; skipped" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["sweep", "--context", "256", "256"], "argument --context: 256 given more than once"),
    (["ruler", "--k", "64", "64"], "argument --k: 64 given more than once"),
    (["agreement", "--k-fraction", "0.02", "0.0201"], "selection sizes repeat: k = [82, 82] at context 4096"),
])
def test_repeated_values_are_refused_before_any_work(capsys, argv, message):
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
