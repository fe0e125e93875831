"""scripts/soak_pool.py on the tiny random decoder (CPU): through churn every session decodes its uninterrupted
tokens, the step compiles once and memory is flat; a session that decoded differently fails the soak."""

import json

from scripts import pool_trace, soak_pool

ARGV = ["--model", "tiny", "--events", "24", "--sessions", "4", "--slots", "2", "--burst", "3", "--prompt-tokens", "128",
        "--k", "40"]


def test_the_soak_passes_with_churn(tmp_path):
    assert soak_pool.main(ARGV + ["--out", str(tmp_path), "--tag", "t"]) == 0
    res = json.loads((tmp_path / "soak_pool_t.json").read_text())["soak"]
    assert res["passed"] and res["step_compiles_in_trace"] == 0 and len(res["session_checks"]) == 4
    assert res["ops"]["save"] >= 1 and res["ops"]["load"] >= 1 and res["ops"]["pause"] >= 1
    assert abs(res["memory_vs_before"]["live_bytes"] - 1) <= 0.01
    assert "Passed: **True**" in (tmp_path / "soak_pool_t.md").read_text()


def test_a_session_that_decoded_differently_fails_the_soak(tmp_path, monkeypatch):
    lone = pool_trace.lone_tokens
    monkeypatch.setattr(pool_trace, "lone_tokens", lambda pool, prompt, n: lone(pool, prompt, n)[:-1] + [-1])
    assert soak_pool.main(ARGV + ["--out", str(tmp_path), "--tag", "t"]) == 1
    res = json.loads((tmp_path / "soak_pool_t.json").read_text())["soak"]
    assert not any(s["equal"] for s in res["session_checks"])
