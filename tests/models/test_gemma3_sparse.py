"""Sparse decoding on Gemma 3's global layers (tiny model): Fathom and SparQ select k of the global layers' tokens
from a cache in device memory and in the offloaded layout (``placement="pinned_host"``: on the CPU the same layout
and code in device memory), through ``models.generate`` (one fused program, or the streaming drivers) and through
``generation.prefill`` / ``decode_step``; the local layers keep their window rings beside the sparse cache."""

import jax
import numpy as np
import pytest
from flax import nnx

from fathom_jax import decode
from fathom_jax import models
from fathom_jax.models import gemma3 as G
from fathom_jax.models import generation
from tests.models.test_gemma3 import CFG

PROMPT = np.random.default_rng(5).integers(0, CFG.vocab, (2, 40)).astype(np.int32)
LENGTHS = np.array([40, 40])
STEPS = 5
CAPACITY = 48
SPARSE = dict(k=12, sink=2, local=4, implementation="xla")  # 12 of 40+ tokens per query head


@pytest.fixture(scope="module")
def model():
    return G.Gemma3ForCausalLM(CFG, rngs=nnx.Rngs(3))


def stream(model, attention):
    """Prefill, then decode steps fed the greedy tokens: (tokens [B, STEPS], logits [STEPS, B, V], state)."""
    logits, state, attention = generation.prefill(model, PROMPT, LENGTHS, attention, CAPACITY)
    tokens, out = [], []
    for _ in range(STEPS):
        nxt = generation.first_token(logits)
        tokens.append(np.asarray(nxt))
        out.append(np.asarray(logits))
        _, logits, state = generation.decode_step(model, nxt, state, attention)
    return np.stack(tokens, 1), np.stack(out), state


@pytest.mark.parametrize("spec", ["fathom:16", "sparq:2"])
def test_sparse_global_layers_in_device_memory_and_offloaded(model, spec):
    """models.generate in device memory (one fused program) and offloaded (the streaming drivers: generation.prefill,
    then decode_step per token) decode the same tokens; step by step, the offloaded state holds the global layers'
    sparse cache beside the local layers' rings, and the logits are not dense decoding's."""
    device = decode.from_spec(spec, **SPARSE)
    host = decode.from_spec(spec, placement="pinned_host", **SPARSE)
    assert device.fused and not host.fused
    want = np.asarray(models.generate(model, PROMPT, STEPS, capacity=CAPACITY, attention_fn=device))
    np.testing.assert_array_equal(models.generate(model, PROMPT, STEPS, capacity=CAPACITY, attention_fn=host), want)

    tokens, logits, state = stream(model, host)  # the same programs generate ran, driven here
    np.testing.assert_array_equal(tokens, want)
    windows, cache = model.split_state(state)
    assert cache.n_layers == len(CFG.global_layers) and cache.groups == 2 * CFG.n_kv_heads
    assert windows.k.shape == (len(CFG.local_layers), 2, CFG.n_kv_heads, CFG.sliding_window, CFG.head_dim)
    np.testing.assert_array_equal(cache.length, LENGTHS + STEPS)
    assert int(windows.length) == PROMPT.shape[1] + STEPS
    # really sparse: 12 of 40+ tokens per head change the logits (dense prefill teacher-forced with the same tokens)
    forced = np.concatenate([PROMPT, tokens[:, :-1]], 1)
    full, _ = model.prefill(forced, G.Gemma3Cache.init(CFG, 2, CAPACITY))
    dense = np.moveaxis(np.asarray(full[:, PROMPT.shape[1] - 1:]), 1, 0)
    np.testing.assert_allclose(logits[0], dense[0], rtol=0, atol=1e-5 * np.abs(dense).max())  # the prefill's
    assert np.abs(logits[1:] - dense[1:]).max() > 1e-3 * np.abs(dense).max()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec,rows", [("fathom:16", None), ("fathom:16", "k8v8"), ("sparq:2", None)])
def test_gpu_kernels_over_pinned_host_equal_device_memory(model, spec, rows):
    """On the GPU, with the Pallas kernels: the global layers' cache in pinned host memory (streamed step by step)
    decodes the tokens and logits of the same cache in HBM, and its K/V rows really live on the host."""
    kernels = dict(SPARSE, implementation="pallas", rows=rows)
    device = decode.from_spec(spec, **kernels)
    host = decode.from_spec(spec, placement="pinned_host", **kernels)
    want = np.asarray(models.generate(model, PROMPT, STEPS, capacity=CAPACITY, attention_fn=device))
    np.testing.assert_array_equal(models.generate(model, PROMPT, STEPS, capacity=CAPACITY, attention_fn=host), want)
    tokens, logits, state = stream(model, host)
    np.testing.assert_array_equal(tokens, want)
    _, cache = model.split_state(state)
    assert cache.kv.sharding.memory_kind == "pinned_host"
    _, device_logits, _ = stream(model, device)
    np.testing.assert_allclose(logits, device_logits, rtol=0, atol=1e-5 * np.abs(device_logits).max())
