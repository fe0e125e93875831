"""Shared test base of the kernel suites: implementations, seeded inputs, tolerances, proof that a kernel ran.

Every kernel op has one suite (a ``Test*`` class deriving :class:`KernelTestBase`) whose tests run over
every implementation through the ``impl`` fixture: ``xla`` (the jnp reference, checked against an
independent numpy oracle), ``interpret`` (the Pallas kernel in interpret mode, on the CPU in CI) and
``gpu`` (the compiled Triton kernel; marked ``gpu``, skipped without a GPU; ``pytest -m gpu`` on the
device).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backend

HAS_GPU = backend.on_gpu()


@dataclasses.dataclass(frozen=True)
class Impl:
    implementation: str
    interpret: bool | None

    @property
    def kw(self) -> dict:
        return {"implementation": self.implementation, "interpret": self.interpret}

    @property
    def is_kernel(self) -> bool:
        return self.implementation == "triton"

    @property
    def on_gpu(self) -> bool:
        return self.is_kernel and not self.interpret


IMPLS = [
    pytest.param(Impl("xla", None), id="xla"),
    pytest.param(Impl("triton", True), id="interpret"),
    pytest.param(Impl("triton", False), id="gpu",
                 marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")]),
]

TOLERANCE = {jnp.dtype(jnp.float32): 2e-6, jnp.dtype(jnp.bfloat16): 8e-3, jnp.dtype(jnp.float16): 1e-3}


class KernelTestBase:
    """Base of a kernel suite: ``impl`` runs each test over every implementation."""

    @pytest.fixture(params=IMPLS)
    def impl(self, request) -> Impl:
        return request.param

    @pytest.fixture
    def rng(self, request) -> np.random.Generator:
        """A seeded generator per test (seed from the test id: fresh inputs per test, reproducible)."""
        return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def host(x, impl: Impl):
    """On the GPU: a pinned_host copy (the real offload path: kernels read it in place). Else unchanged."""
    if not impl.on_gpu:
        return x
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))


def random_store_arrays(rng, batch, d, n_cap, *, length=None):
    """Random planes/scales/length in the store layout (any bits are valid codes)."""
    w = n_cap // 32
    planes = jnp.asarray(rng.integers(0, 2**32, (*batch, d, 4, w), dtype=np.uint32))
    scales = jnp.asarray(rng.uniform(0.1, 3.0, (*batch, d, n_cap // 64)).astype(np.float16))
    if length is None:
        length = rng.integers(0, n_cap + 1, batch)
    return planes, scales, jnp.asarray(np.broadcast_to(length, batch), jnp.int32)


def assert_scores_close(got, want, dtype=jnp.float32):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.all(np.isfinite(got))
    tol = TOLERANCE[jnp.dtype(dtype)]
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


def assert_equal(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def assert_staged(got_planes, got_scales, want_planes, want_scales, depths, first_plane=0):
    """A gather's staging buffers equal the oracle's where the scan reads them: each slot's planes ``first_plane <=
    i < t`` and the scales of the slots of depth > 0 (the rest is left unwritten)."""
    depths = np.asarray(depths)
    plane = np.arange(4)[None, None, :]
    got_p, want_p, got_s, want_s = (np.asarray(x) for x in (got_planes, want_planes, got_scales, want_scales))
    assert got_p.shape == want_p.shape and got_p.dtype == want_p.dtype
    assert got_s.shape == want_s.shape and got_s.dtype == want_s.dtype
    np.testing.assert_array_equal(got_p[(plane >= first_plane) & (plane < depths[..., None])], want_p[
        (plane >= first_plane) & (plane < depths[..., None])])
    assert_equal(got_s[depths > 0], want_s[depths > 0])


def assert_ran(fn, *args, name: str, impl: Impl, **kwargs):
    """With the kernel implementation, the named pallas_call is in the jaxpr (and the compiled HLO on GPU)."""
    from tests.support import count_pallas_calls

    calls = count_pallas_calls(fn, *args, name=name, **impl.kw, **kwargs)
    assert calls >= 1 if impl.is_kernel else calls == 0
    if impl.on_gpu:
        assert name in jax.jit(lambda *a: fn(*a, **impl.kw, **kwargs)).lower(*args).as_text()
