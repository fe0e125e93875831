"""Slot moves: a session written into a slot comes back out bit for bit, and the other slots are untouched."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax.serve import slots
from fathom_jax.models.attention import CacheShape


def _filled(attention, batch, seed):
    shape = CacheShape(layers=2, batch=batch, kv_heads=2, capacity=128, head_dim=8, dtype=jnp.float32)
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
