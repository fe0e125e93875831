"""The serve tests' pool: the tiny decoder, Fathom with each session's own statistics, two slots."""

import numpy as np
import pytest

from fathom_jax import decode

CAPACITY = 256
PROMPTS = tuple(np.random.default_rng(0).integers(0, 97, n).astype(np.int32) for n in (70, 50, 90))


@pytest.fixture(scope="session")
def attention():
    return decode.from_spec("fathom:32", k=40)  # session calibration: it travels with each session


@pytest.fixture(scope="session")
def lone_tokens(tiny_model, attention):
    """Each prompt's greedy tokens decoded alone (prefill + decode steps, batch 1): 13 per prompt."""
    return [decode_alone(tiny_model, attention, prompt, padded=128, capacity=CAPACITY, count=13) for prompt in PROMPTS]


def decode_alone(model, attention, prompt, *, padded: int, capacity: int, count: int) -> list[int]:
    """``count`` greedy tokens of ``prompt`` decoded alone: its prefill right-padded to ``padded`` tokens, then
    decode steps, batch 1 (what a pool's session must decode)."""
    from fathom_jax.models import generation

    ids = np.zeros((1, padded), np.int32)
    ids[0, :prompt.size] = prompt
    logits, state, attn = generation.prefill(model, ids, np.array([prompt.size]), attention, capacity)
    tok = generation.first_token(logits)
    tokens = [int(tok[0])]
    for _ in range(count - 1):
        tok, _, state = generation.decode_step(model, tok, state, attn)
        tokens.append(int(tok[0]))
    return tokens
