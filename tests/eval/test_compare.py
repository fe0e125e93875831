"""Results files compared number by number, their run records left out (fathom_jax/eval/compare.py; the command:
``fathom compare``, tests/cli/test_compare_command.py)."""

import json
import os

import pytest

from fathom_jax.eval import compare

RESULT = {"meta": {"commit": "abc1234", "wall_seconds": 155.0}, "rows": [{"name": "Fathom 48", "error": 0.25, "k": 128},
                                                                       {"name": "SparQ r=16", "error": 0.5, "k": 128}]}


def test_the_same_measurements_in_another_run_compare_equal():
    other = json.loads(json.dumps(RESULT))
    other["meta"] = {"commit": "def5678-dirty", "wall_seconds": 309.0, "host": {"cpus": 2}}
    c = compare.compare(RESULT, other, "a.json", "b.json")
    assert c.same() and c.numbers == 4
    assert c.line() == "a.json measures what b.json does: its 4 numbers equal (the run records, meta/command/machine, " \
                       "left out)"


def test_numbers_and_fields_that_differ_are_named():
    other = json.loads(json.dumps(RESULT))
    other["rows"][1]["error"] = 0.5 * (1 + 1e-6)
    c = compare.compare(RESULT, other, "a", "b")
    assert not c.same() and (c.differing, c.where) == (1, "rows[1].error") and c.largest == pytest.approx(1e-6, rel=1e-3)
    assert c.line().startswith("a differs from b: 1 of 4 numbers differ, by up to 1e-06 (relative) at rows[1].error")
    assert compare.compare(RESULT, other, rtol=1e-5).same()  # within a tolerance
    other["rows"][0]["name"] = "Fathom 64"
    other["extra"] = 1
    other["rows"].append({})
    c = compare.compare(RESULT, other, "a", "b")
    assert c.other == ["extra (only in b)", "rows (2 against 3 entries)", "rows[0].name"], c.other
    assert compare.compare({"x": float("nan")}, {"x": float("nan")}).same()
    assert not compare.compare({"x": True}, {"x": 1}).same()  # a flag is not a number


def test_a_run_has_the_committed_file_of_its_name_as_twin(tmp_path):
    name = "fidelity_smollm2_4k_64pos.json"  # the README's main job, committed
    committed = os.path.join(compare.COMMITTED, name)
    assert os.path.isfile(committed)
    assert compare.committed_twin(str(tmp_path / name)) == committed
    assert compare.committed_twin(committed) is None and compare.committed_twin(str(tmp_path / "other.json")) is None
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ValueError, match="is no results file"):
        compare.load(str(tmp_path / "bad.json"))
