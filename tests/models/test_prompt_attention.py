"""Prefill attention: the chunked XLA path equals dense causal attention."""

import jax.numpy as jnp
import numpy as np

from fathom_jax.models.prompt_attention import chunked_causal_attention


def test_chunked_causal_attention_equals_dense_causal():
    from fathom_jax.models.capture import causal_attention

    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((2, 37, 6, 8)), jnp.float32)  # T not a multiple of the chunk
    k = jnp.asarray(rng.standard_normal((2, 37, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 37, 2, 8)), jnp.float32)
    got = chunked_causal_attention(q, k, v, chunk=16)
    qg = q.reshape(2, 37, 2, 3, 8).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    want = causal_attention(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want.transpose(0, 3, 1, 2, 4).reshape(2, 37, 6, 8)),
                               rtol=1e-5, atol=1e-5)
