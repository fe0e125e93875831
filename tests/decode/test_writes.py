"""Writing a stacked cache (fathom_jax.decode.writes): in place, every write's completion token comes back to the
caller, in the order of the writes, and nothing is kept in the writer."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import decode
from fathom_jax.decode import writes as W
from fathom_jax.decode.cache import LayerUpdate, allocate
from fathom_jax.models.attention import CacheShape

SHAPE = CacheShape(layers=2, batch=1, kv_heads=2, capacity=128, head_dim=16, dtype=jnp.float32)


@pytest.fixture
def numbered_kernels(monkeypatch):
    """The in-place kernels (GPU only) replaced by ones that write nothing and return their call's number."""
    count = itertools.count(1)
    token = lambda *args, **kw: jnp.full((1,), next(count), jnp.int32)  # noqa: E731
    monkeypatch.setattr(W, "cache_write_in_place", token)
    monkeypatch.setattr(W, "tier_write_in_place", token)


def _cache_and_update(placement):
    attn = decode.from_spec("fathom:8", k=40, placement=placement)
    cache = allocate(lambda dims, dtype, bulk=True: jnp.zeros(dims, dtype), attn.cache_parts(SHAPE.layers), SHAPE)
    position = jnp.full((SHAPE.groups,), 70, jnp.int32)
    key = jnp.asarray(np.random.default_rng(0).standard_normal((SHAPE.groups, SHAPE.head_dim)), jnp.float32)
    blocks = {part.name: part.add_token(data, 0, position, key)[1]
              for part, data in zip(cache.index.parts, cache.index.data)}
    update = jax.tree.map(lambda a: a[None], LayerUpdate(key=key, value=key, blocks=blocks))
    return cache, update, position


@pytest.mark.parametrize("placement, writes", [
    (decode.Placement("pinned_host"), 3),  # the K/V row, the planes, the scales
    (decode.Placement("pinned_host", resident_planes=1, warm_planes=2), 4),  # the tiers in one write, the warm rows
], ids=["one_tier", "two_tiers_warm"])
def test_in_place_writes_return_their_tokens_in_order(numbered_kernels, placement, writes):
    cache, update, position = _cache_and_update(placement)
    writer = W.Writer(True, "xla")
    kv, data, tokens = W.write_token(cache, update, position, 0, writer, "every_step")
    assert kv is cache.kv and all(a is b for a, b in zip(jax.tree.leaves(data), jax.tree.leaves(cache.index.data)))
    assert [int(t[0]) for t in tokens] == list(range(1, writes + 1))  # one token per bulk write
    assert cache.writes.shape == (writes,)  # allocated as many as a step returns: the step's signature stays
    committed = W.commit(cache, update, position, writer, "every_step")
    np.testing.assert_array_equal(committed.writes, np.arange(len(tokens) + 1, 2 * len(tokens) + 1))
    assert committed.kv is cache.kv
    flushed = W.flush(committed, writer)  # the plane store's newest blocks: its own writes' tokens
    assert flushed.writes.shape[0] == len(tokens) - 1 and int(flushed.writes[0]) == 2 * len(tokens) + 1


def test_functional_writes_return_no_token_and_new_arrays():
    cache, update, position = _cache_and_update(decode.Placement())
    kv, data, tokens = W.write_token(cache, update, position, 0, W.Writer(False, "xla"), "every_step")
    assert tokens == () and kv is not cache.kv
    committed = W.commit(cache, update, position, W.Writer(False, "xla"), "every_step")
    assert committed.writes is cache.writes  # no in-place write: the previous tokens stay
    np.testing.assert_array_equal(committed.kv, kv)
