"""``fathom compare A B``: one line, exit status 0 when the measurements agree, 1 when they differ, 2 for a file that
is no results file (fathom_jax/cli/compare_command.py)."""

import json

from fathom_jax.cli import app as cli

COMMITTED = "results/fidelity_smollm2_4k_64pos.json"


def test_compare_says_whether_a_run_reproduced_the_committed_file(capsys, tmp_path, monkeypatch):
    from fathom_jax.eval import compare

    monkeypatch.chdir(compare.COMMITTED + "/..")
    run = json.loads(open(COMMITTED).read())
    run["meta"] = {"command": "fathom sweep --positions 64", "commit": "0000000-dirty"}  # another run's record
    same = tmp_path / "same.json"
    same.write_text(json.dumps(run))
    assert cli.main(["compare", str(same), COMMITTED]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(f"{same} measures what {COMMITTED} does: its ")
    run["rows"][0]["bits"] += 1.0
    (tmp_path / "other.json").write_text(json.dumps(run))
    assert cli.main(["compare", str(tmp_path / "other.json"), COMMITTED]) == 1
    assert "1 of " in capsys.readouterr().out
    assert cli.main(["compare", str(tmp_path / "missing.json"), COMMITTED]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fathom compare: error: argument a: cannot read") and err.count("\n") == 1
