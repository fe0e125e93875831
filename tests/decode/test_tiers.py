"""Resident planes: a cache whose top planes live in HBM decodes the same bits as the one-tier cache, holds the same
planes after appends (each plane written to its tier), reports its bytes by tier; the HBM budget's chooser."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import decode
from fathom_jax.decode import StepConfig
from fathom_jax.index.parts import Planes
from fathom_jax.models import generation
from fathom_jax.models.attention import CacheShape
from fathom_jax.placement import Placement
from fathom_jax.placement.residency import link_bytes, plane_bytes, resident_for_budget
from fathom_jax.store.tiered import TieredPlaneStore
from tests.support import ON_GPU

LONG = np.random.default_rng(7).integers(0, 97, (2, 60)).astype(np.int32)
LENGTHS = np.array([60, 45])


def decode_run(model, resident, implementation, warm=0, **step):
    """Prefill (60 / 45 tokens) and 5 decode steps (crossing a 64-token block): (logits [6, B, V], cache, hook)."""
    attn = decode.from_spec("fathom:16", k=12, sink=2, local=4, calibration="session", implementation=implementation,
                            placement=Placement("pinned_host", resident_planes=resident, warm_planes=warm),
                            step=StepConfig(**step))
    logits, cache, attn = generation.prefill(model, LONG, LENGTHS, attn, 72)
    out = [np.asarray(logits)]
    for t in range(5):
        _, logits, cache = generation.decode_step(model, LONG[:, t], cache, attn)
        out.append(np.asarray(logits))
    return np.stack(out), cache, attn


def planes_of(cache) -> np.ndarray:
    """The one-tier planes [L, R, D, 4, W] of a cache's raw store, whichever tiers hold them."""
    store = cache.index["raw"]
    layers, groups = store.scales.shape[:2]
    return np.stack([np.asarray(store.layer_store(layer, slice(0, groups), None).planes) for layer in range(layers)])


@pytest.mark.parametrize("implementation,resident,step", [
    # CPU: the reference (one count for every layer, and per-layer counts with blocks written when full); a whole
    # decode through interpreted kernels costs ~40 s of the CPU suite, so the kernels' placements run on the GPU only
    # (each kernel has its interpreted suite in tests/pallas_kernels)
    ("xla", 1, {}), ("xla", (1, 0, 3), dict(index_writes="full_blocks")),
    pytest.param("triton", (1, 0, 3), dict(index_writes="full_blocks"), marks=ON_GPU, id="gpu-per-layer"),
    pytest.param("triton", 2, dict(pipeline=2), marks=ON_GPU, id="gpu-2-pipelined"),
    pytest.param("triton", 4, {}, marks=ON_GPU, id="gpu-4")])
def test_resident_planes_decode_the_same_bits(tiny_model, implementation, resident, step):
    """p planes of every channel in device memory (the same layout and kernels as on a GPU, where the rest is in
    pinned host memory): the logits equal the one-tier host cache's bit for bit, with every plane in its tier after the
    appends (blocks written when full: after a flush); the tiered gather ran."""
    want, want_cache, _ = decode_run(tiny_model, 0, implementation, **step)
    got, cache, attn = decode_run(tiny_model, resident, implementation, **step)
    np.testing.assert_array_equal(got, want)
    if step.get("index_writes") == "full_blocks":
        cache, want_cache = decode.flush(cache, attn), decode.flush(want_cache, attn)
    np.testing.assert_array_equal(planes_of(cache), planes_of(want_cache))
    store = cache.index["raw"]
    if resident == 4:  # every plane resident: the one-tier store, in device memory, scanned in place
        assert not isinstance(store, TieredPlaneStore) and type(attn.run.reader).__name__ == "DirectRead"
        return
    per_layer = attn.placement.resident(3)
    assert isinstance(store, TieredPlaneStore) and store.hot.shape[0] == sum(per_layer)
    assert store.cold.shape[0] == 4 * 3 - sum(per_layer)
    if implementation == "triton":
        from flax import nnx

        from tests.support import jaxpr_pallas_calls

        assert type(attn.run.reader).__name__ == "TieredRead"
        _, state = nnx.split(tiny_model)
        jaxpr = generation.decode_step_program(tiny_model, cache, attn).trace(state, jnp.asarray(LONG[:, 5]), None,
                                                                              cache=cache).jaxpr
        calls = {name: len(jaxpr_pallas_calls(jaxpr, name)) for name in ("tier_gather", "run_gather", "tier_write")}
        assert calls["tier_gather"] >= 1 and calls["run_gather"] == 0 and calls["tier_write"] >= 1, calls


@pytest.mark.parametrize("implementation,resident,step", [
    ("xla", (1, 2, 1), {}), ("xla", 0, {}),  # no resident plane: the scales and the warm planes alone in HBM
    ("triton", (0, 1, 0), dict(pipeline=2)),  # interpreted on the CPU: the warm tier read by the tiered gather and
    #                                            the scan, in two chunks of groups
    pytest.param("triton", (1, 2, 1), dict(pipeline=2, index_writes="full_blocks"), marks=ON_GPU, id="gpu")])
def test_warm_planes_decode_the_same_bits(tiny_model, implementation, resident, step):
    """Warm channel planes beside the resident ones: the logits equal the cache's without them bit for bit; every warm
    row holds the plane its map names after the appends (a block crossed), the map gives each group its 5 channel
    planes past the resident ones, following them with no gap; and the step's tiered gather and scan read them."""
    want, want_cache, want_attn = decode_run(tiny_model, resident, implementation, **step)
    got, cache, attn = decode_run(tiny_model, resident, implementation, warm=5, **step)
    np.testing.assert_array_equal(got, want)
    assert isinstance(cache.index["raw"], TieredPlaneStore)
    if step.get("index_writes") == "full_blocks":
        cache = decode.flush(cache, attn)
    store, planes = cache.index["raw"], planes_of(cache)
    warm, warm_map = np.asarray(store.warm), np.asarray(store.warm_map)
    per_layer = attn.placement.resident(3)
    for layer, p in enumerate(per_layer):
        for r in range(warm_map.shape[1]):
            mapped = np.argwhere(warm_map[layer, r] > 0)
            assert len(mapped) == 5 and np.all(mapped[:, 1] >= p)
            for c, i in mapped:
                np.testing.assert_array_equal(warm[layer, r, warm_map[layer, r, c, i] - 1], planes[layer, r, c, i])
                assert i == p or warm_map[layer, r, c, i - 1] > 0  # right after the resident planes, no gap
    if implementation == "triton":
        from flax import nnx

        from tests.support import jaxpr_pallas_calls

        _, state = nnx.split(tiny_model)

        def operands(cache, attn, name):
            jaxpr = generation.decode_step_program(tiny_model, cache, attn).trace(
                state, jnp.asarray(LONG[:, 5]), None, cache=cache).jaxpr
            return sorted(len(eqn.invars) for eqn in jaxpr_pallas_calls(jaxpr, name))

        # the gather takes each slot's first cold plane, the scan the warm tier and each slot's warm rows
        gathers, scans = operands(cache, attn, "tier_gather"), operands(cache, attn, "fathom_plane_scan")
        assert gathers and gathers == [n + 1 for n in operands(want_cache, want_attn, "tier_gather")]
        assert scans and scans == [n + 2 for n in operands(want_cache, want_attn, "fathom_plane_scan")]


def test_cache_bytes_by_tier():
    """The bytes a tiered cache holds, by tier, equal what cache_bytes predicts; the hot planes and scales are in
    device memory."""
    attn = decode.from_spec("fathom:16", k=40, placement=Placement("pinned_host", resident_planes=(1, 2, 0)))
    shape = CacheShape(layers=3, batch=2, kv_heads=3, capacity=200, head_dim=16, dtype=jnp.bfloat16)
    cache = attn.init_cache(shape)
    rows = attn.row_layout(shape)
    want = decode.cache_bytes(attn.cache_parts(3), rows, n_layers=3, groups=6, capacity=200)
    assert cache.nbytes() == want
    cold = decode.from_spec("fathom:16", k=40, placement=Placement("pinned_host", warm_planes=5))
    held = cold.init_cache(shape)
    assert held.nbytes() == decode.cache_bytes(cold.cache_parts(3), rows, n_layers=3, groups=6, capacity=200)
    assert held.index["raw"].hot.shape[0] == 1  # no resident plane: one unread hot row
    plane = plane_bytes(groups=6, capacity=200, head_dim=16)
    assert want["planes"] == 9 * plane and want["planes_hbm"] == 3 * plane + 3 * 6 * 16 * (256 // 64) * 2
    assert decode.cache_bytes(attn.index_parts, rows, n_layers=3, groups=6, capacity=200)[
        "planes"] == 12 * plane + 3 * 6 * 16 * 4 * 2
    warm = decode.from_spec("fathom:16", k=40, placement=Placement("pinned_host", resident_planes=(1, 2, 0),
                                                                     warm_planes=5))
    cache = warm.init_cache(shape)
    got = decode.cache_bytes(warm.cache_parts(3), rows, n_layers=3, groups=6, capacity=200)
    assert cache.nbytes() == got and got["planes"] == want["planes"]
    # the warm tier [L, R, S, W] words and its map [L, R, D, 4] int32
    assert got["planes_hbm"] == want["planes_hbm"] + 3 * 6 * 5 * (256 // 32) * 4 + 3 * 6 * 16 * 4 * 4


def test_placement_checks_warm_planes():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="warm_planes must be an int >= 0"):
            Placement("pinned_host", resident_planes=1, warm_planes=bad)
    with pytest.raises(ValueError, match="warm_planes=4 keeps channel planes of a pinned_host index"):
        Placement("device", warm_planes=4)
    with pytest.raises(ValueError, match="holds rotated keys"):
        decode.from_spec("fathom_klt:8", k=40, placement=Placement("pinned_host", resident_planes=1,
                                                                   warm_planes=4)).cache_parts(2)
    attn = decode.from_spec("fathom:8", k=40, placement=Placement("pinned_host", resident_planes=1, warm_planes=4))
    shape = CacheShape(layers=2, batch=1, kv_heads=2, capacity=128, head_dim=16, dtype=jnp.bfloat16)
    attn = attn.bind(shape)
    cache = attn.init_cache(shape)
    keys = jnp.ones((1, 2, 64, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="chosen from the prompt's queries: pass queries"):
        attn.write_prompt(cache, 0, keys, keys, jnp.full((1,), 64, jnp.int32))


def test_placement_checks_resident_planes():
    for bad in (5, -1, 1.5, (1, 7), ()):
        with pytest.raises(ValueError, match="resident_planes must be an int in \\[0, 4\\]"):
            Placement("pinned_host", resident_planes=bad)
    with pytest.raises(ValueError, match="use it with memory='pinned_host'"):
        Placement("device", resident_planes=1)
    with pytest.raises(ValueError, match="has 2 entries, the cache has 3 layers"):
        Placement("pinned_host", resident_planes=(1, 2)).resident(3)
    assert Placement("pinned_host", resident_planes=2).resident(3) == (2, 2, 2)
    [part] = decode.from_spec("fathom:8", k=40, placement=Placement("pinned_host", resident_planes=1)).cache_parts(2)
    assert isinstance(part, Planes) and part.resident == (1, 1) and type(part.stacking).__name__ == "TwoTiers"


def test_resident_planes_for_a_budget():
    """Scales first, then planes by read frequency, each layer's a prefix; bad budgets raise before allocating."""
    reads = np.array([[0.9, 0.3, 0.05, 0.0], [0.6, 0.5, 0.2, 0.1], [0.2, 0.1, 0.0, 0.0]])
    dims = dict(groups=8, capacity=1 << 16, head_dim=128)
    plane = plane_bytes(**dims)
    scales = 3 * 8 * 128 * (1 << 16) // 64 * 2
    assert resident_for_budget(0, reads, **dims) == (0, 0, 0)
    assert resident_for_budget(scales + plane - 1, reads, **dims) == (0, 0, 0)
    assert resident_for_budget(scales + plane, reads, **dims) == (1, 0, 0)
    assert resident_for_budget(scales + 3 * plane, reads, **dims) == (1, 2, 0)  # 0.9, 0.6, 0.5 (not 0.3)
    assert resident_for_budget(scales + 12 * plane, reads, **dims) == (4, 4, 4)
    assert link_bytes((1, 2, 0), reads, **dims) == pytest.approx((0.3 + 0.05 + 0.2 + 0.1 + 0.2 + 0.1) * plane)
    for bad, match in ((-1, "budget must be an int >= 0"), (scales + 12 * plane + 1, "more than the whole index"),
                       (1.5, "budget must be an int")):
        with pytest.raises(ValueError, match=match):
            resident_for_budget(bad, reads, **dims)
    with pytest.raises(ValueError, match="device memory left beside the model"):
        resident_for_budget(scales + plane, reads, hbm_free=scales, **dims)
    with pytest.raises(ValueError, match="reads must be \\[layers, 4\\]"):
        resident_for_budget(0, reads[:, :3], **dims)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_resident_planes_live_in_hbm_and_the_rest_in_host_memory(tiny_model):
    """On a GPU the hot planes and scales are device arrays and the cold planes pinned host ones; the decode equals
    the one-tier host cache's bit for bit and the compiled step copies no host array."""
    from fathom_jax.hlo import device_copies, host_array_copies

    want, _, _ = decode_run(tiny_model, 0, "triton", pipeline=1)
    got, cache, attn = decode_run(tiny_model, 1, "triton", pipeline=1)
    np.testing.assert_array_equal(got, want)
    store = cache.index["raw"]
    assert store.hot.sharding.memory_kind == "device" and store.scales.sharding.memory_kind == "device"
    assert store.cold.sharding.memory_kind == "pinned_host" and cache.kv.sharding.memory_kind == "pinned_host"
    from flax import nnx

    _, state = nnx.split(tiny_model)
    text = generation.decode_step_program(tiny_model, cache, attn).lower(state, jnp.asarray(LONG[:, 5]), None,
                                                                        cache=cache).compile().as_text()
    assert host_array_copies(text, min_bytes=1 << 10) == []
    # the resident planes are written in place too (a copy would take the new blocks' writes away from the cache)
    assert device_copies(text, min_bytes=store.hot.nbytes) == []
    assert cache.writes.shape == (1 + 2,)  # K/V row, the planes (each to its tier, one launch), the scales
    assert "tier_write" in text
