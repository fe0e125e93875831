"""The log of finished units (fathom_jax/eval/resume.py): written as they finish, read back on resume, refused
for another configuration, robust to a line cut short by an interrupt."""

import json

import pytest

from fathom_jax.eval import resume


def test_units_read_back_and_another_configuration_is_refused(tmp_path):
    path = str(tmp_path / "run.partial.jsonl")
    header = {"kind": "agreement", "config": {"context": 512, "ks": (64,)}}
    log = resume.UnitLog(path, header, resume=True)  # nothing to resume: a fresh log
    log.add("0:dense", {"tokens": [[1, 2]]})
    log.add("0:exact@64", {"tokens": [[3, 4]]})
    again = resume.UnitLog(path, header, resume=True)
    assert again.get("0:dense") == {"tokens": [[1, 2]]} and len(again.saved) == 2
    assert resume.UnitLog(path, header, resume=False).saved == {}  # without --resume: starts over
    resume.UnitLog(path, header, resume=False).add("0:dense", {"tokens": [[1, 2]]})
    other = {"kind": "agreement", "config": {"context": 1024, "ks": (64,)}}
    with pytest.raises(ValueError, match=r"another configuration \(context: 512 there, 1024 now\); delete it"):
        resume.UnitLog(path, other, resume=True)


def test_a_line_cut_short_is_dropped(tmp_path):
    path = tmp_path / "run.partial.jsonl"
    header = {"kind": "ruler", "config": {}}
    resume.UnitLog(str(path), header, resume=False).add("0:dense", {"tokens": [[1]]})
    with open(path, "a") as f:
        f.write('{"unit": "0:exact@64", "data": {"tok')  # Ctrl-C mid-write
    log = resume.UnitLog(str(path), header, resume=True)
    assert list(log.saved) == ["0:dense"]
    log.add("0:exact@64", {"tokens": [[2]]})
    assert list(resume.UnitLog(str(path), header, resume=True).saved) == ["0:dense", "0:exact@64"]


def test_finished_compares_the_recorded_configuration(tmp_path):
    path = tmp_path / "res.json"
    path.write_text(json.dumps({"meta": {"config": {"context": 512, "ks": [64]}}}))
    assert resume.finished(str(path), {"context": 512, "ks": (64,)})
    assert not resume.finished(str(path), {"context": 512, "ks": (128,)})
    assert not resume.finished(str(tmp_path / "missing.json"), {})


def test_interrupt_is_one_line_naming_what_was_saved_and_the_resume_command(capsys):
    with pytest.raises(SystemExit) as stop, resume.stop_on_interrupt("ruler", lambda: "3 decodes in x.jsonl",
                                                                      ["ruler", "--context", "512"]):
        raise KeyboardInterrupt
    assert stop.value.code == 130
    err = capsys.readouterr().err.strip()
    assert err == ("[ruler] interrupted: 3 decodes in x.jsonl; to continue where it stopped, run: "
                   "fathom ruler --context 512 --resume")


def test_a_damaged_or_other_results_file_is_recomputed_and_said_so(tmp_path):
    """``--resume`` recomputed a context whose saved JSON was damaged without a word; now one line says why."""
    path, config = tmp_path / "fidelity.json", {"context": 512, "ks": [64]}
    said = []
    assert not resume.finished(str(path), config, said.append) and said == []  # nothing saved: nothing to say
    path.write_text(json.dumps({"meta": {"config": config}, "rows": []}))
    assert resume.finished(str(path), config, said.append) and said == []
    for damaged in ('{"meta": {"config": {"context": 5', "[1, 2]", "{}"):
        path.write_text(damaged)
        assert not resume.finished(str(path), config, said.append)
        assert len(said) == 1 and said.pop().startswith(f"{path} is damaged (")
    path.write_text(json.dumps({"meta": {"config": {**config, "context": 1024}}}))
    assert not resume.finished(str(path), config, said.append)
    assert said == [f"{path} holds results of another configuration (context: 1024 there, 512 now); computing this "
                    "one, to overwrite it"]
