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
    from fathom_jax.models import generation

    out = []
    for prompt in PROMPTS:
        ids = np.zeros((1, 128), np.int32)
        ids[0, :prompt.size] = prompt
        logits, state, attn = generation.prefill(tiny_model, ids, np.array([prompt.size]), attention, CAPACITY)
        tok = generation.first_token(logits)
        tokens = [int(tok[0])]
        for _ in range(12):
            tok, _, state = generation.decode_step(tiny_model, tok, state, attn)
            tokens.append(int(tok[0]))
        out.append(tokens)
    return out
