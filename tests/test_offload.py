"""The offloaded step (gather + plane scan + top-k + row fetch kernels) equals the plain reference path."""

import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import offload, planner, select, store
from tests.conftest import random_keys


def reference(q, keys, values, variance, lengths, budget, k):
    st = store.build_store(keys, length=lengths)
    plan = planner.plan_bisection(planner.importance(q, variance), budget)
    scores = jnp.einsum("bgd,bnd->bgn", q, store.dequantize(st, plan.depths))[..., : keys.shape[1]]
    idx, mask = select.select_topk(scores, lengths, k)
    return select.sparse_attention(q, keys, values, idx, mask), plan.bits_per_token


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_offload_attention_matches_reference(rng, implementation):
    bh, g, d, n, budget, k = 3, 4, 16, 300, 24, 64
    keys = random_keys(rng, (bh, n, d))
    values = rng.standard_normal((bh, n, d)).astype(np.float32)
    q = random_keys(rng, (bh, g, d))
    variance = keys.var(axis=1)
    lengths = np.array([300, 257, 100], np.int32)
    host = offload.to_host(store.build_store(keys, length=lengths), keys, values)
    assert offload.host_memory_kind() is None  # CPU: the same code on device memory
    got, bits = offload.offload_attention(q, host, variance, budget=budget, k=k, implementation=implementation)
    want, want_bits = reference(q, keys, values, variance, lengths, budget, k)
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(want_bits))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_offload_bad_inputs(rng):
    keys = random_keys(rng, (2, 64, 8))
    st = store.build_store(keys)
    with pytest.raises(ValueError, match="like the store"):
        offload.to_host(st, keys[:1], keys[:1])
    host = offload.to_host(st, keys, keys)
    with pytest.raises(ValueError, match="larger than"):
        offload.offload_attention(np.zeros((2, 2, 8), np.float32), host, np.ones((2, 8), np.float32), budget=8, k=65)


@pytest.mark.gpu
def test_offload_attention_from_pinned_host(rng):
    """On a GPU: the index and K/V rows live in pinned_host memory and the kernels read them there."""
    import jax

    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")
    bh, g, d, n = 8, 4, 128, 4096
    keys = random_keys(rng, (bh, n, d))
    values = rng.standard_normal((bh, n, d)).astype(np.float32)
    q = random_keys(rng, (bh, g, d))
    variance = keys.var(axis=1)
    lengths = np.full(bh, n, np.int32)
    host = offload.to_host(store.build_store(keys), jnp.asarray(keys, jnp.bfloat16), jnp.asarray(values, jnp.bfloat16))
    assert host.planes.sharding.memory_kind == "pinned_host"
    got, _ = offload.offload_attention(q, host, variance, budget=48, k=256)
    want, _ = reference(q, np.asarray(jnp.asarray(keys, jnp.bfloat16), np.float32),
                        np.asarray(jnp.asarray(values, jnp.bfloat16), np.float32), variance, lengths, 48, 256)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=2e-3)
