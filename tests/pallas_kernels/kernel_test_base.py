"""Shared test base of the kernel tests: execution modes, seeded inputs, proof that a kernel ran.

Every kernel test is parametrized over ``mode``: ``"interpret"`` (Pallas interpret mode, runs on the
CPU in CI) and ``"gpu"`` (the compiled Triton kernel; marked ``gpu``, skipped cleanly without a GPU;
run on the device with ``pytest -m gpu``).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _common as C

HAS_GPU = C.on_gpu()

MODES = [
    pytest.param("interpret", id="interpret"),
    pytest.param(
        "gpu", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")]
    ),
]


def interpret_flag(mode: str) -> bool:
    return mode == "interpret"


def fresh_rng(request) -> np.random.Generator:
    """A seeded generator per test (seed from the test id: fresh inputs per test, reproducible)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


def random_store_arrays(rng, batch, d, n_cap, *, length=None):
    """Random planes/scales/length in the store layout (any bits are valid codes)."""
    w = n_cap // 32
    planes = jnp.asarray(rng.integers(0, 2**32, (*batch, d, 4, w), dtype=np.uint32))
    scales = jnp.asarray(rng.uniform(0.1, 3.0, (*batch, d, n_cap // 64)).astype(np.float16))
    if length is None:
        length = rng.integers(0, n_cap + 1, batch)
    return planes, scales, jnp.asarray(np.broadcast_to(length, batch), jnp.int32)


def assert_scores_close(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.all(np.isfinite(got))
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * scale)


def assert_ran(fn, *args, name: str, **kwargs):
    """The named pallas_call is in the jaxpr (and, on the GPU, in the compiled HLO)."""
    assert C.count_pallas_calls(fn, *args, name=name, **kwargs) >= 1
    if HAS_GPU and kwargs.get("interpret") is False:
        text = jax.jit(lambda *a: fn(*a, **kwargs)).lower(*args).as_text()
        assert name in text
