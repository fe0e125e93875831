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
from tests.support import TINY_GEMMA3 as CFG
from tests.support import forced_logits

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
    np.testing.assert_array_equal(windows.length, LENGTHS + STEPS)
    # really sparse: 12 of 40+ tokens per head change the logits (dense prefill teacher-forced with the same tokens)
    forced = np.concatenate([PROMPT, tokens[:, :-1]], 1)
    full, _ = forced_logits(model, forced, CAPACITY)
    dense = np.moveaxis(full[:, PROMPT.shape[1] - 1:], 1, 0)
    np.testing.assert_allclose(logits[0], dense[0], rtol=0, atol=1e-5 * np.abs(dense).max())  # the prefill's
    assert np.abs(logits[1:] - dense[1:]).max() > 1e-3 * np.abs(dense).max()


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec,rows", [("fathom:16", None), ("fathom:16", "k8v8"), ("sparq:2", None)])
def test_gpu_kernels_over_pinned_host_equal_device_memory(model, spec, rows):
    """On the GPU, with the Pallas kernels: the global layers' cache in pinned host memory (streamed step by step)
    decodes the tokens and logits of the same cache in HBM, and its K/V rows really live on the host."""
    kernels = dict(SPARSE, implementation="triton", rows=rows)
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


@pytest.fixture(scope="module")
def gemma3_real(gemma3_path):
    """(model, tokenizer, config): the real Gemma 3 270M, f32."""
    from fathom_jax.models import hub

    return hub.load_model("gemma3-270m")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("context,spec,rows", [(8192, "fathom:128", None), (32768, "fathom:128", None),
                                               (32768, "fathom:128", "k8v8"), (32768, "sparq:64", None)])
def test_gemma3_offloaded_decoding_equals_hbm_decoding(gemma3_real, context, spec, rows):
    """Gemma 3 270M on real code, up to its 32k positions: 32 greedy tokens with the global layers' cache and index
    in pinned_host memory equal the same sparse decode in HBM (tokens, and logits within 1e-5 of their scale), with
    bf16 and k8v8 rows, Fathom 128 (at D = 256 the paper's Fathom 64) and SparQ r = D/4; the local layers' windows stay
    in HBM."""
    from fathom_jax.eval import texts
    from fathom_jax.models.tokenizer import encode_prompt

    model, tok, _ = gemma3_real
    text, _ = texts.evaluation_text()
    ids = encode_prompt(tok, "") + texts.token_window(tok.encode(text), context - 32 - 1)
    prompt, lengths = np.asarray(ids, np.int32)[None], np.array([len(ids)])
    out = {}
    for memory in ("device", "pinned_host"):
        attn = decode.from_spec(spec, k=512, placement=memory, rows=rows, implementation="triton")
        logits, state, attn = generation.prefill(model, prompt, lengths, attn, context)
        tokens, all_logits = [], []
        for _ in range(32):
            tokens.append(np.asarray(generation.first_token(logits)))
            all_logits.append(np.asarray(logits))
            _, logits, state = generation.decode_step(model, jax.numpy.asarray(tokens[-1]), state, attn)
        out[memory] = np.stack(tokens, 1), np.stack(all_logits)
        _, cache = model.split_state(state)
        assert cache.kv.sharding.memory_kind == memory
        assert cache.n_layers == 3 and int(cache.length[0]) == len(ids) + 32
    (host_tokens, host_logits), (hbm_tokens, hbm_logits) = out["pinned_host"], out["device"]
    scale = np.abs(hbm_logits).max()
    print(f"{context} {spec} {rows}: tokens {host_tokens[0, :12].tolist()}..., max |host - HBM| "
          f"{np.abs(host_logits - hbm_logits).max():.3g} of scale {scale:.3g}")
    np.testing.assert_array_equal(host_tokens, hbm_tokens)
    np.testing.assert_allclose(host_logits, hbm_logits, rtol=0, atol=1e-5 * scale)


def test_a_ragged_batch_decodes_what_each_prompt_decodes_alone(model):
    """Right-padded prompts of different lengths (the rings written with each sequence's real tokens only, RoPE at
    each one's own position) decode the tokens and logits of each prompt alone, unpadded."""
    attention = decode.from_spec("fathom:16", **SPARSE)
    lengths = np.array([40, 27])
    logits, state, attn = generation.prefill(model, PROMPT, lengths, attention, CAPACITY)
    batch = [np.asarray(logits)]
    for _ in range(3):
        _, logits, state = generation.decode_step(model, generation.first_token(logits), state, attn)
        batch.append(np.asarray(logits))
    np.testing.assert_array_equal(model.split_state(state)[0].length, lengths + 3)
    for i, n in enumerate(lengths):
        logits, state, attn = generation.prefill(model, PROMPT[i:i + 1, :n], lengths[i:i + 1], attention, CAPACITY)
        alone = [np.asarray(logits)]
        for _ in range(3):
            _, logits, state = generation.decode_step(model, generation.first_token(logits), state, attn)
            alone.append(np.asarray(logits))
        for b, a in zip(batch, alone):
            assert b[i].argmax() == a[0].argmax()
            np.testing.assert_allclose(b[i], a[0], rtol=0, atol=1e-5 * np.abs(a).max())
