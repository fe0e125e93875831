"""Slot moves: a session written into a slot comes back out bit for bit, and the other slots are untouched."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax.serve import slots
from fathom_jax.models.attention import CacheShape


def _filled(attention, batch, seed, dtype=jnp.float32):
    shape = CacheShape(layers=2, batch=batch, kv_heads=2, capacity=128, head_dim=8, dtype=dtype)
    attn = attention.bind(shape)
    cache = attn.start_decode(attn.init_cache(shape), np.zeros(batch, np.int32))
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray(rng.integers(0, 100, x.shape).astype(x.dtype)) for x in jax.tree.leaves(cache)]
    return jax.tree.unflatten(jax.tree.structure(cache), leaves), attn


def test_insert_then_extract_is_exact_and_touches_one_slot(attention):
    pool, attn = _filled(attention, 3, 0)
    one = slots.session_of(_filled(attention, 1, 1)[0])
    before = jax.device_get(pool)
    pool = slots.insert(pool, one, 1, attn.placement)
    for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(slots.extract(pool, 1, 2))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for s in (0, 2):
        for x, y in zip(jax.tree.leaves(slots.extract(before, s, 2)), jax.tree.leaves(slots.extract(pool, s, 2))):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(pool.writes), before.writes)
    assert int(slots.clear(pool, 1).length[1]) == 0


def test_a_leaf_without_its_groups_on_axis_1_is_refused(attention):
    pool, _ = _filled(attention, 2, 0)
    index = dataclasses.replace(pool.index, length=pool.index.length[:, :3])
    with pytest.raises(ValueError, match=r"cache leaf .index.length has shape \(2, 3\); .* R = 4 groups"):
        slots.check_layout(dataclasses.replace(pool, index=index))
    with pytest.raises(ValueError, match="a session is one sequence"):
        slots.session_of(pool)


@pytest.mark.parametrize("warm", [0, 3])
def test_the_kernel_moves_of_an_offloaded_pool_equal_the_xla_moves_bit_for_bit(tiny_model, warm):
    """Issue 47's layout (plane 0 resident, k8v8 rows; device memory standing in for pinned_host on CPU, the real
    thing on a GPU), with warm planes too: the slot_copy kernels move every bulk leaf, resident or not, exactly as
    XLA's slices do."""
    from fathom_jax import decode
    from fathom_jax.placement import Placement

    placement = Placement("pinned_host", resident_planes=1, warm_planes=warm)
    attention = decode.from_spec("fathom:32", k=40, rows="k8v8", implementation="triton", placement=placement)
    pool, attn = _filled(attention, 3, 0, dtype=jnp.bfloat16)
    one = slots.session_of(_filled(attention, 1, 1, dtype=jnp.bfloat16)[0])
    assert "device" in jax.tree.leaves(pool.bulk()) and True in jax.tree.leaves(pool.bulk())
    by_xla = slots.insert(jax.tree.map(jnp.copy, pool), one, 2, Placement(), "xla")  # every leaf in device memory
    by_kernel = slots.insert(placement.put(pool, pool.bulk()), one, 2, placement, "triton")
    for x, y in zip(jax.tree.leaves(by_xla), jax.tree.leaves(by_kernel)):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    for s in (1, 2):
        for x, y in zip(jax.tree.leaves(slots.extract(by_xla, s, 2, Placement(), "xla")),
                        jax.tree.leaves(slots.extract(by_kernel, s, 2, placement, "triton"))):
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def test_a_pinned_host_pool_over_a_mesh_is_refused_by_name(monkeypatch):
    from fathom_jax.placement import Placement
    from fathom_jax.placement import placement as placement_lib

    monkeypatch.setattr(placement_lib, "host_memory_available", lambda: True)  # a GPU's pinned_host memory
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    with pytest.raises(ValueError, match="pinned_host memory moves its slots by the slot_copy kernels"):
        slots.check_moves(Placement("pinned_host", mesh=mesh), "triton")
    assert slots.check_moves(Placement("pinned_host"), "triton") is True
    assert slots.check_moves(Placement(), "triton") is False


def test_the_models_own_state_moves_by_its_sequence_axes_and_a_state_without_them_is_refused():
    from fathom_jax.models.gemma3.windows import Windows
    from tests.support import TINY_GEMMA3 as CFG

    rng = np.random.default_rng(0)
    fill = lambda w: jax.tree.map(lambda x: jnp.asarray(rng.integers(0, 100, x.shape).astype(x.dtype)), w)  # noqa: E731
    pool, one = fill(Windows.init(CFG, 3, jnp.float32)), fill(Windows.init(CFG, 1, jnp.float32))
    axes = slots.own_axes(pool, 3)
    before = jax.device_get(pool)
    pool = slots.insert_own(pool, one, jnp.int32(2), axes=axes)
    for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(slots.extract_own(pool, jnp.int32(2), axes=axes))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y, a in zip(jax.tree.leaves(before), jax.tree.leaves(pool), axes):  # slots 0 and 1 untouched
        np.testing.assert_array_equal(np.take(np.asarray(x), [0, 1], axis=a), np.take(np.asarray(y), [0, 1], axis=a))
    assert slots.slot_bytes(*_filled_bytes(), model_state=pool)["hbm"]["model_state"] == sum(
        x.nbytes for x in jax.tree.leaves(one))
    with pytest.raises(ValueError, match="without a sequence_axes"):
        slots.own_axes({"rings": pool.k}, 3)
    with pytest.raises(ValueError, match=r"model state leaf \.k of shape .* has no axis 1 of the 2 sequences"):
        slots.own_axes(pool, 2)


def _filled_bytes():
    from fathom_jax import decode

    pool, attn = _filled(decode.from_spec("fathom:32", k=40), 3, 0)
    return pool, 3, attn.placement
