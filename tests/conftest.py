"""Shared fixtures: the paper's Appendix A example and seeded random keys."""

import os

# Tests run on the CPU with several virtual devices off; keep XLA from grabbing every core twice.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import jax
import numpy as np
import pytest

jax.config.update("jax_enable_x64", False)

# Appendix A (reconstructed in DESIGN.md): six keys, four channels, one block.
APPENDIX_KEYS = np.array(
    [
        [1.8, 0.4, -0.2, 0.05],
        [-1.1, 0.9, 0.3, -0.02],
        [0.3, -1.2, 0.1, 0.04],
        [1.2, 0.7, 0.4, 0.01],
        [-0.6, -0.3, -0.5, 0.03],
        [0.9, 1.1, -0.3, -0.05],
    ],
    np.float32,
)
APPENDIX_VAR = np.array([1.222, 0.755, 0.127, 0.001], np.float32)
APPENDIX_Q = np.array([[3.0, 1.0, 2.0, 0.1], [1.0, 2.0, -1.0, 0.2]], np.float32)  # heads A, B


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


def random_keys(rng, shape, *, lognormal_channels=True):
    """Keys with log-normal per-channel scales, like real post-RoPE keys (a few loud channels)."""
    keys = rng.standard_normal(shape).astype(np.float32)
    if lognormal_channels:
        keys *= np.exp(rng.normal(0.0, 1.0, size=shape[-1])).astype(np.float32)
    return keys
