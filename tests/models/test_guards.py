"""models.generate's checks (fathom_jax/models/guards.py): the CLI's rules, before any work (issue 30: an
8,300-token prompt ran 95 s past SmolLM2's 8192 positions, token id 1,000,000 decoded [0 0 0 0], token id -5 and
float prompts were accepted)."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from fathom_jax import decode
from fathom_jax.checks import CheckError
from fathom_jax.cli import args as cli_args
from fathom_jax.models import generate, generation, guards
from fathom_jax.models import sizing
from fathom_jax.models.llama import LlamaForCausalLM

PROMPT = np.arange(1, 13, dtype=np.int32)  # 12 tokens of the tiny model's 97


@pytest.fixture
def no_work(monkeypatch):
    """Any generation work past the checks fails the test."""
    def work(*args, **kwargs):
        raise AssertionError("generate started work before checking its arguments")

    monkeypatch.setattr(generation, "generate_program", work)  # a fused attention's whole generation
    monkeypatch.setattr(generation, "prefill", work)  # a streaming attention's first program


@pytest.mark.parametrize("prompt, message", [
    (np.array([5, 1_000_000, 7]), r"prompt_ids: token id 1000000 at \[1\] is outside the model's vocabulary \[0, 97\)"),
    (np.array([[3, 4], [-5, 2]]), r"token id -5 at \[1, 0\] is outside the model's vocabulary"),
    (np.array([1.0, 2.0], np.float32), "prompt_ids must be integer token ids, got dtype float32"),
    (np.zeros((0,), np.int32), r"non-empty \[T\] or \[B, T\] array of token ids, got shape \[0\]"),
    (np.zeros((1, 2, 3), np.int32), r"got shape \[1, 2, 3\]"),
])
@pytest.mark.parametrize("sparse_hook", [False, True])
def test_bad_prompts_are_refused_before_any_work(tiny_model, no_work, prompt, message, sparse_hook):
    kwargs = {"attention_fn": decode.from_spec("fathom:8", k=40)} if sparse_hook else {}
    with pytest.raises(CheckError, match=message):
        generate(tiny_model, prompt, 4, **kwargs)


def test_lengths_and_counts(tiny_model, no_work):
    prompts = np.stack([PROMPT, PROMPT])
    for lengths, message in ([np.array([12, 13]), r"lengths must lie in \[1, 12\]"],
                             [np.array([0, 12]), r"lengths must lie in \[1, 12\]"],
                             [np.array([12]), r"lengths must be \[B\] = \[2\]"],
                             [np.array([12.0, 3.0]), "lengths must be integer"]):
        with pytest.raises(CheckError, match=message):
            generate(tiny_model, prompts, 4, lengths=lengths, attention_fn=decode.from_spec("exact", k=40))
    with pytest.raises(CheckError, match="max_new_tokens must be an int >= 1, got 0"):
        generate(tiny_model, PROMPT, 0)
    with pytest.raises(CheckError, match="exceeds cache capacity 14"):
        generate(tiny_model, PROMPT, 4, capacity=14)


def test_positions_past_the_model_need_the_same_opt_in_as_the_cli(tiny_config, no_work):
    short = LlamaForCausalLM(dataclasses.replace(tiny_config, max_position_embeddings=14), rngs=nnx.Rngs(0))
    want = (r"the prompt \(12 tokens\) \+ max_new_tokens 4 = 16 tokens, more than the model's 14 positions "
            r"\(max_position_embeddings\); shorten it, or pass allow_long_context=True")
    with pytest.raises(CheckError, match=want):
        generate(short, PROMPT, 4)
    with pytest.raises(AssertionError, match="started work"):  # past the checks: the run itself
        generate(short, PROMPT, 4, allow_long_context=True)
    # the CLI states the same rule with its own flag
    assert guards.positions_message(16, 14, "x", "--allow-long-context").endswith(
        "pass --allow-long-context to run past the trained length anyway")


def test_memory_uses_the_cli_sizing(tiny_model, monkeypatch, no_work):
    """The check the CLI makes (sizing.peak_bytes against the available memory), shared: with 1 MiB free the
    tiny run does not fit; memory_check=False (the CLI's --no-memory-check) tries anyway."""
    monkeypatch.setattr(sizing, "available_bytes", lambda: 1 << 20)
    need = sizing.peak_bytes(tiny_model.config, 1000 + 8, weights=False)
    with pytest.raises(CheckError, match=r"generate over 1008 tokens x 1 prompt\(s\) needs about .* GiB of memory and "
                                         r"0.0 GiB is available; .*memory_check=False"):
        generate(tiny_model, np.ones(1000, np.int32), 8, allow_long_context=True)
    assert need > 1 << 20
    with pytest.raises(AssertionError, match="started work"):
        generate(tiny_model, np.ones(1000, np.int32), 8, memory_check=False)
    monkeypatch.setattr(cli_args, "available_bytes", lambda: 1 << 20)
    with pytest.raises(cli_args.UsageError, match="needs about .* --no-memory-check to try anyway"):
        cli_args.check_memory(need, "x", skip=False)
