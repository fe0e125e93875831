"""Code sessions from the standard library and the word-level step agreement."""

import pathlib

import pytest

from fathom_jax.eval import agreement


def test_step_agreement_is_difflibs_word_ratio():
    assert agreement.step_agreement("a b c d", "a b c d") == 1.0
    assert agreement.step_agreement("a b c d", "a b x d") == pytest.approx(0.75)
    assert agreement.step_agreement("a  b\nc", "a b c") == 1.0  # words, not whitespace
    assert agreement.step_agreement("", "") == 1.0 and agreement.step_agreement("a", "") == 0.0


def test_sessions_are_windows_of_real_code_with_the_next_span(smollm2_path):
    from fathom_jax.models.hub import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    sessions, info = agreement.make_sessions(tokenizer, count=6, prompt_tokens=512, steps=32)
    assert len(sessions) == 6 and len({s.package for s in sessions}) == 6  # round-robin over packages
    assert info["packages"] == sorted(s.package for s in sessions)
    for s in sessions:
        assert len(s.prompt) == 512 and len(s.target) == 32
        assert "# file: " in tokenizer.decode(list(s.prompt[:40])) or s.start > 0
    with pytest.raises(ValueError, match="fewer than the 100000 asked for"):
        agreement.make_sessions(tokenizer, count=100_000, prompt_tokens=512, steps=32)
    with pytest.raises(ValueError, match="sessions must be >= 1"):
        agreement.make_sessions(tokenizer, count=0, prompt_tokens=512, steps=32)


RESULTS = pathlib.Path(__file__).resolve().parents[2] / "results"


@pytest.mark.parametrize("name", sorted(p.stem for p in RESULTS.glob("agreement_*.json"))
                         + ["ruler_smollm2_4k_shared_cpu", "ruler_gemma3_8k_shared_cpu"])
def test_committed_tables_render_from_their_json(name):
    """A committed step-agreement (every one) or RULER table is its JSON rendered by today's report, bit for bit."""
    import json

    from fathom_jax.eval.downstream_report import render_markdown

    assert render_markdown(json.loads((RESULTS / f"{name}.json").read_text())) == (RESULTS / f"{name}.md").read_text()
