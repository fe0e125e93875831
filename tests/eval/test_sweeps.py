"""The sweeps through the CLI (fathom_jax/eval/sweeps.py, cli/study_commands.py, cli/model_commands.py): every
command with ``--resume`` (agreement, ruler, sweep), interrupted and resumed, gives the uninterrupted run's results
without computing a finished unit again; repeated values are refused."""

import dataclasses
import json

import pytest

from fathom_jax import cli
from fathom_jax.eval import downstream as ds

ARGV = ["agreement", "--context", "512", "--sessions", "2", "--batch", "1", "--steps", "4", "--k-fraction", "0.125",
        "--methods", "dense", "exact", "--baseline", "exact", "--calib-tokens", "256", "--quiet"]
RULER_ARGV = ["ruler", "--context", "512", "--tasks", "niah_single", "--per-task", "2", "--batch", "1", "--k", "64",
              "--methods", "dense", "exact", "--calib-tokens", "256", "--quiet"]


def _results(path):
    res = json.loads(path.read_text())
    timing = {k: res["meta"].pop(k) for k in ("wall_s", "prefill_s", "decode_s", "compile_s", "command", "date")}
    return res, timing


@pytest.mark.parametrize("argv", [ARGV, RULER_ARGV], ids=["agreement", "ruler"])
def test_interrupted_sweep_resumes_to_the_uninterrupted_results(capsys, monkeypatch, tmp_path, tiny_smollm2,  # noqa: F811
                                                                argv):
    """Two batches x two branches (dense, exact@64): Ctrl-C during the third decode keeps batch 0's two; --resume
    skips batch 0 (no prefill), decodes batch 1's two and writes what one run writes."""
    kind = argv[0]
    assert cli.main([*argv, "--out", str(tmp_path / "whole")]) == 0
    want, _ = _results(tmp_path / "whole" / f"{kind}_smollm2_512.json")

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
        cli.main([*argv, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    partial = out / f"{kind}_smollm2_512.partial.jsonl"
    assert stop.value.code == 130 and len(err) == 1
    assert err[0] == (f"[{kind}] interrupted: 2 finished decodes in {partial}; to continue where it stopped, run: "
                      f"fathom {' '.join(argv)} --out {out} --resume")
    assert not (out / f"{kind}_smollm2_512.json").exists()

    calls.clear()
    stop_at[0] = None
    assert cli.main([*argv, "--out", str(out), "--resume"]) == 0
    assert len(calls) == 2 * 2 - 2 and not partial.exists()
    got, timing = _results(out / f"{kind}_smollm2_512.json")
    assert got["meta"].pop("resumed_units") == 2
    assert got == want
    assert timing["decode_s"] > 0 and timing["compile_s"] >= 0
    # resuming a finished run does nothing
    calls.clear()
    assert cli.main([*argv, "--out", str(out), "--resume"]) == 0 and not calls
    assert "holds this configuration's results already; skipped" in capsys.readouterr().out


SWEEP_ARGV = ["sweep", "--context", "512", "1024", "--positions", "16", "--quiet"]


def test_interrupted_study_sweep_resumes_without_running_a_finished_context(capsys, monkeypatch, tmp_path,
                                                                           tiny_smollm2):  # noqa: F811
    """``fathom sweep --resume`` compared the results' recorded config (its budgets resolved at the head_dim) with a
    fresh one (budgets None): never equal, so every finished context ran again. The study itself stands in here (it
    records its config as run_study always did: ``asdict(config.at_head_dim(D))``); the captures are the model's."""
    from fathom_jax.eval import study

    calls, stop_at = [], [None]

    def fake_study(eval_cap, calib_cap, config, *, meta, progress):
        calls.append(config.context)
        if len(calls) == stop_at[0]:
            raise KeyboardInterrupt
        d = eval_cap.q.shape[-1]
        return {"meta": {**meta, "config": dataclasses.asdict(config.at_head_dim(d))},
                "rows": [{"name": "capture sums", "k": float(eval_cap.k.sum()), "q": float(calib_cap.q.sum())}]}

    def write_json(res, prefix):
        with open(prefix + ".json", "w") as f:
            json.dump(res, f)
        return [prefix + ".json"]

    monkeypatch.setattr(study, "run_study", fake_study)
    monkeypatch.setattr(study, "compile_ahead", lambda *a, **k: None)
    monkeypatch.setattr(study, "write_report", write_json)
    monkeypatch.setattr(study, "render_markdown", lambda res: "")

    def results(out, context):
        res = json.loads((out / f"fidelity_smollm2_{context}_16pos.json").read_text())
        for key in ("wall_seconds", "command"):
            res["meta"].pop(key)
        return res

    assert cli.main([*SWEEP_ARGV, "--out", str(tmp_path / "whole")]) == 0 and calls == [512, 1024]
    want = [results(tmp_path / "whole", c) for c in ("512tok", "1k")]

    out = tmp_path / "split"
    calls.clear()
    stop_at[0] = 2  # Ctrl-C in the second context's study
    with pytest.raises(SystemExit) as stop:
        cli.main([*SWEEP_ARGV, "--out", str(out)])
    assert stop.value.code == 130 and (out / "fidelity_smollm2_512tok_16pos.json").exists()
    assert not (out / "fidelity_smollm2_1k_16pos.json").exists()

    calls.clear()
    stop_at[0] = None
    capsys.readouterr()
    assert cli.main([*SWEEP_ARGV, "--out", str(out), "--resume"]) == 0
    assert calls == [1024]  # the finished context is not studied again
    assert "fidelity_smollm2_512tok_16pos.json holds this context's study already; skipped" in capsys.readouterr().out
    assert [results(out, c) for c in ("512tok", "1k")] == want
    calls.clear()
    assert cli.main([*SWEEP_ARGV, "--out", str(out), "--resume"]) == 0 and calls == []
    # a damaged results file is computed again, and said so in one line
    damaged = out / "fidelity_smollm2_1k_16pos.json"
    damaged.write_text(damaged.read_text()[:40])
    capsys.readouterr()
    assert cli.main([*SWEEP_ARGV, "--out", str(out), "--resume"]) == 0 and calls == [1024]
    said = [line for line in capsys.readouterr().out.splitlines() if "damaged" in line]
    assert len(said) == 1 and said[0].startswith(f"[sweep] --resume: {damaged} is damaged (JSONDecodeError: ")
    assert said[0].endswith("computing it again, to overwrite it") and results(out, "1k") == want[1]


@pytest.mark.parametrize("argv, message", [
    (["sweep", "--context", "256", "256"], "argument --context: 256 given more than once"),
    (["ruler", "--k", "64", "64"], "argument --k: 64 given more than once"),
    (["agreement", "--k-fraction", "0.02", "0.0201"], "selection sizes repeat: k = [82, 82] at context 4096"),
])
def test_repeated_values_are_refused_before_any_work(capsys, argv, message):
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize("spec", ["fathom_tuned", "fathom_bits:55:observed", "fathom_tuned:observed"])
def test_methods_that_need_a_tuned_calibration_are_refused_by_the_checks(spec):
    """The sweeps calibrate with corpus or session statistics: a method that reads tuned budgets or plane errors
    failed after the model had loaded; the checks every run starts with (and the CLI runs first) refuse it."""
    from fathom_jax.eval import sweeps

    with pytest.raises(ValueError, match=f"{spec} reads .*; the sweeps calibrate with corpus or session statistics"):
        sweeps.check_ruler(sweeps.RulerConfig(methods=("dense", "exact", spec)))
    with pytest.raises(ValueError, match="the sweeps calibrate with corpus or session statistics"):
        sweeps.check_agreement(sweeps.AgreementConfig(methods=("dense", "exact", "sparq:16", spec)))
