"""The sparse decode step over a mesh of devices (CPU: two host devices) equals the unsharded step."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from fathom_jax import decode
from fathom_jax.decode import StepConfig
from fathom_jax.models import LlamaForCausalLM, generate
from fathom_jax.models import generation
from fathom_jax.placement import Placement, device_mesh

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (the CPU tests force 2 host devices)")


@pytest.fixture(scope="module")
def mesh():
    return device_mesh(2)


def test_device_mesh():
    assert device_mesh(1) is None
    m = device_mesh(2)
    assert m.axis_names == ("x",) and list(m.devices) == jax.devices()[:2]
    with pytest.raises(ValueError, match=r"devices asked for"):
        device_mesh(len(jax.devices()) + 1)
    with pytest.raises(ValueError, match="devices must be an int >= 1"):
        device_mesh(0)


@pytest.fixture(scope="module")
def smol_like(tiny_config):
    """3 KV heads (as SmolLM2): groups = batch x 3, split over 2 devices by whole groups."""
    import dataclasses

    cfg = dataclasses.replace(tiny_config, n_heads=9, n_kv_heads=3, qk_norm=False)
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("spec,memory,implementation,batch,split", [
    ("fathom_klt:12", "pinned_host", "xla", 1, {}), ("sparq:2", "pinned_host", "triton", 2, dict(pipeline=2, row_cache=16)),
    ("landmark", "device", "xla", 1, {})])
def test_sharded_decode_equals_unsharded(tiny_model, mesh, spec, memory, implementation, batch, split):
    """2 KV heads: each device scans, selects and fetches for its own KV head(s) (with the kernels, under
    shard_map, each on its own shard); at batch 2 each device's two groups also run as two pipelined chunks
    (the second chunk's transfer chained to the first's, at its group offset within the device's shard), with a row
    cache sharded like the groups."""
    prompt = np.random.default_rng(5).integers(0, 97, (batch, 30)).astype(np.int32)
    if jax.default_backend() == "gpu":  # real pinned_host memory is read by the kernels only
        implementation = "triton"
    common = dict(k=12, sink=2, local=4, implementation=implementation)
    steps = 2 if implementation == "triton" else 4
    want = np.asarray(generate(tiny_model, prompt, steps, capacity=48, attention_fn=decode.from_spec(spec, **common)))
    attn = decode.from_spec(spec, placement=Placement(memory, mesh=mesh), step=StepConfig(**split), **common)
    got = np.asarray(generate(tiny_model, prompt, steps, capacity=48, attention_fn=attn))
    np.testing.assert_array_equal(got, want)


def test_uneven_heads_split_by_groups_and_cache_is_sharded(smol_like, mesh):
    """3 KV heads x batch 2 = 6 groups, 3 per device (a batch split). From the same prefilled cache, the
    sharded decode step gives the unsharded step's logits and tokens, and the cache stays sharded."""
    rng = np.random.default_rng(6)
    prompt = rng.integers(0, 97, (2, 28)).astype(np.int32)
    lengths = np.array([28, 21])
    local = decode.from_spec("fathom:12", k=12, sink=2, local=4, calibration="session")
    sharded = decode.from_spec("fathom:12", k=12, sink=2, local=4, calibration="session",
                               placement=Placement("pinned_host", mesh=mesh))
    logits, want_cache, want_attn = generation.prefill(smol_like, prompt, lengths, local, 48)
    got_logits, prefilled, got_attn = generation.prefill(smol_like, prompt, lengths, sharded, 48)
    assert prefilled.kv.sharding.spec == P(None, "x") and prefilled.index["raw"].planes.sharding.spec == P(None, "x")
    assert prefilled.kv.addressable_shards[0].data.shape[1] == 3  # each device holds 3 of the 6 groups
    # On a GPU f32 GEMMs run as TF32 and the partitioned program picks other algorithms: 3e-4 of the logit
    # scale was seen between the two prefills on two H200s; on the CPU they agree to 2e-6.
    tol = 1e-5 if jax.default_backend() == "cpu" else 2e-3
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(logits), rtol=0, atol=tol * np.abs(logits).max())
    # the same prefilled cache (and its session statistics) on the mesh: the step itself is compared
    cache = jax.tree.map(np.asarray, want_cache)
    cache = sharded.placement.put(cache, cache.bulk())
    tokens = np.argmax(np.asarray(logits), -1).astype(np.int32)
    for _ in range(4):
        want_tokens, want, want_cache = generation.decode_step(smol_like, tokens, want_cache, want_attn)
        got_tokens, got, cache = generation.decode_step(smol_like, tokens, cache, got_attn)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=tol * np.abs(want).max())
        np.testing.assert_array_equal(np.asarray(got_tokens), np.asarray(want_tokens))
        tokens = np.asarray(got_tokens)
    assert cache.kv.sharding.spec == P(None, "x")  # still sharded after the in-place writes
    with pytest.raises(ValueError, match="multiple of 2"):
        generate(smol_like, prompt[:1], 2, capacity=48, attention_fn=sharded)


def test_warm_planes_are_sharded_like_the_groups(tiny_model, mesh):
    """Warm planes over a mesh: each device chooses and holds its own groups' warm planes (the tier and its map split
    on the group axis like the planes), and the decode equals the unsharded one without them."""
    prompt = np.random.default_rng(7).integers(0, 97, (2, 30)).astype(np.int32)
    common = dict(k=12, sink=2, local=4, implementation="xla")
    want = np.asarray(generate(tiny_model, prompt, 4, capacity=48, attention_fn=decode.from_spec("fathom:12", **common)))
    attn = decode.from_spec("fathom:12", placement=Placement("pinned_host", mesh=mesh, resident_planes=1,
                                                             warm_planes=3), **common)
    got = np.asarray(generate(tiny_model, prompt, 4, capacity=48, attention_fn=attn))
    np.testing.assert_array_equal(got, want)
    lengths = np.array([30, 30])
    _, cache, _ = generation.prefill(tiny_model, prompt, lengths, attn, 48)
    store = cache.index["raw"]
    assert store.warm.sharding.spec == P(None, "x") and store.warm_map.sharding.spec == P(None, "x")
    assert int((np.asarray(store.warm_map) > 0).sum()) == 3 * 3 * 4  # 3 warm planes per layer (3) and group (4)
