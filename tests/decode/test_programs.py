"""The programs over a sparse cache that need no model of their own: the attention-only step, the layer scan's
unroll, and a sparse cache branched from one dense prefill."""

import jax
import jax.numpy as jnp
import numpy as np

from fathom_jax import decode
from fathom_jax.decode import StepConfig
from fathom_jax.models import generation


def test_attention_only_step_matches_the_layers_attention(tiny_model):
    """attention_step (the benchmark's no-GEMM step) runs each layer's sparse attention and writes the cache
    like the decode step's commit: the index after it holds one more token."""
    cfg = tiny_model.config
    attn = decode.from_spec("sparq:4", k=16, sink=2, local=4, implementation="xla")
    prompt = np.random.default_rng(1).integers(0, 97, (2, 40)).astype(np.int32)
    _, cache, attn = generation.prefill(tiny_model, prompt, np.array([40, 33]), attn, 64)
    rng = np.random.default_rng(2)
    r = 2 * cfg.n_kv_heads
    q = jnp.asarray(rng.standard_normal((cfg.n_layers, r, cfg.group_size, cfg.head_dim)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, cfg.n_layers, r, cfg.head_dim)), jnp.float32)
    # each layer's attention as the decode step's layer scan runs it: one program, the layer traced
    by_batch = lambda x: x.reshape(2, cfg.n_kv_heads, *x.shape[1:])  # noqa: E731  [R, ...] -> [B, Hkv, ...]
    attend = jax.jit(lambda q, key, value, cache, layer: attn.attend(cache, layer, by_batch(q), by_batch(key),
                                                                       by_batch(value))[0].reshape(q.shape))
    want = [attend(q[layer], kv[0, layer], kv[1, layer], cache, jnp.int32(layer)) for layer in range(cfg.n_layers)]
    out, cache = decode.attention_step(q, kv[0], kv[1], cache, attn)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.stack(want)), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(cache.length, [41, 34])
    np.testing.assert_array_equal(np.asarray(cache.k[:, 0, 40]), np.asarray(kv[0, :, 0]))


def test_layers_per_loop_iteration_change_no_number(tiny_model):
    """``StepConfig(layer_unroll=N)`` only regroups the layer scan's iterations (3 layers: 2 leaves a remainder):
    the decode step's logits and cache and the attention-only step's outputs equal one layer per iteration, bit
    for bit, and the attention-only step still chains each layer to the previous one's output."""
    import dataclasses

    from fathom_jax.decode.programs import _attention_layers

    unroll = 2
    cfg = tiny_model.config
    base = decode.from_spec("fathom:16", k=16, sink=2, local=4, calibration="session", implementation="xla")
    prompt = np.random.default_rng(3).integers(0, 97, (2, 40)).astype(np.int32)
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((cfg.n_layers, 2 * cfg.n_kv_heads, cfg.group_size, cfg.head_dim)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, cfg.n_layers, 2 * cfg.n_kv_heads, cfg.head_dim)), jnp.float32)
    got = {}
    for n in (1, unroll):
        attn = dataclasses.replace(base, step=StepConfig(layer_unroll=n))
        logits, cache, attn = generation.prefill(tiny_model, prompt, np.array([40, 33]), attn, 64)
        nxt, logits, cache = generation.decode_step(tiny_model, jnp.argmax(logits, -1).astype(jnp.int32), cache, attn)
        out, cache = decode.attention_step(q, kv[0], kv[1], cache, attn)
        got[n] = jax.tree.map(np.asarray, (nxt, logits, out, cache.kv, cache.index["raw"].planes, cache.length))
        hlo = jax.jit(lambda q, c: _attention_layers(attn, q, kv[0], kv[1], c)[0]).lower(q, cache).as_text()
        assert "optimization_barrier" in hlo, "the attention-only step's layers are not chained"
    for want, have in zip(jax.tree.leaves(got[1]), jax.tree.leaves(got[unroll])):
        np.testing.assert_array_equal(have, want)


def test_a_shared_selection_branches_on_no_layer(tiny_model):
    """The attention-only step of a shared selection scans each run of layers of one kind apart (layer_runs): its
    compiled program has no conditional more than the per-layer step's (on a GPU each would block the host on its
    predicate, once per layer), and it computes what the layer-by-layer attention does."""
    import re

    from fathom_jax.decode.programs import attention_program

    cfg = tiny_model.config
    prompt = np.random.default_rng(3).integers(0, 97, (2, 40)).astype(np.int32)
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((cfg.n_layers, 2 * cfg.n_kv_heads, cfg.group_size, cfg.head_dim)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((2, cfg.n_layers, 2 * cfg.n_kv_heads, cfg.head_dim)), jnp.float32)
    conditionals = {}
    for spec in ("fathom:16", "fathom:16@share=0,2@budget=44"):
        attn = decode.from_spec(spec, k=40, calibration="session", implementation="xla")
        _, cache, attn = generation.prefill(tiny_model, prompt, np.array([40, 33]), attn, 64)
        text = attention_program(attn, cache).lower(q, kv[0], kv[1], cache=cache).compile().as_text()
        conditionals[spec] = len(re.findall(r"\bconditional\(", text))
    assert conditionals["fathom:16@share=0,2@budget=44"] == conditionals["fathom:16"]
    by_batch = lambda x: x.reshape(2, cfg.n_kv_heads, *x.shape[1:])  # noqa: E731  [R, ...] -> [B, Hkv, ...]
    attend = jax.jit(lambda q, key, value, cache, layer, carry: attn.attend(cache, layer, by_batch(q), by_batch(key),
                                                                              by_batch(value), carry))
    carry, want = attn.decode_carry(cache), []
    for layer in range(cfg.n_layers):  # the traced layer's conditional, layer by layer
        out, _, carry = attend(q[layer], kv[0, layer], kv[1, layer], cache, jnp.int32(layer), carry)
        want.append(out.reshape(q.shape[1:]))
    out, _ = decode.attention_step(q, kv[0], kv[1], cache, attn)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.stack(want)))


def test_cache_from_dense_prefill_branches_methods_from_one_prefill(tiny_model):
    """A sparse cache built from one dense prefill decodes like the sparse path's own prefill."""
    from fathom_jax.models import DenseCache

    prompt = np.random.default_rng(3).integers(0, 97, (2, 30)).astype(np.int32)
    lengths = np.array([30, 30])
    logits, kv, _ = generation.prefill(tiny_model, prompt, lengths, DenseCache(), 48)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    # jitted, as the downstream sweeps run it (fathom_jax/eval/downstream.py); eagerly it is op by op (~4x slower)
    from_dense = jax.jit(decode.cache_from_dense)
    for spec in ("fathom_klt:12", "landmark"):
        attn = decode.from_spec(spec, k=12, sink=2, local=4)
        cache, branched = from_dense(kv, lengths, attn)
        got, _ = generation.decode_loop(tiny_model, first, cache, branched, 5)
        want_logits, want_cache, want_attn = generation.prefill(tiny_model, prompt, lengths, attn, 48)
        want, _ = generation.decode_loop(tiny_model, jnp.argmax(want_logits, -1).astype(jnp.int32), want_cache,
                                         want_attn, 5)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
