"""The row cache's lookup and fill against a plain-Python model of a direct-mapped cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import decode, methods
from fathom_jax.decode import StepConfig
from fathom_jax.decode.row_cache import RowCache, RowFill, commit_rows, empty_row_cache, row_lookup, row_writes
from fathom_jax.models.attention import CacheShape

GROUPS, SLOTS, WIDTH, SELECTED = 3, 16, 4, 12


def random_step(rng, tags):
    """Selected tokens [R, S] (distinct per group, -1 padding) of which some the slots hold, some collide."""
    tokens = np.full((GROUPS, SELECTED), -1, np.int32)
    for r in range(GROUPS):
        held = [t - 1 for t in tags[r] if t > 0]
        pool = rng.choice(80, 8, replace=False).tolist() + rng.choice(held, min(3, len(held)), replace=False).tolist()
        pool = list(dict.fromkeys(pool))[: SELECTED - 2]  # two padding entries
        tokens[r, : len(pool)] = pool
        tokens[r] = tokens[r, rng.permutation(SELECTED)]
    return tokens


def model_step(tags, rows, tokens, fresh):
    """The cache after a step, by hand: every token looked up, then per slot the largest new token stored."""
    tags, rows = tags.copy(), rows.copy()
    hits = (np.zeros(GROUPS, int), np.zeros(GROUPS, int))
    for r in range(GROUPS):
        for t in tokens[r][tokens[r] >= 0]:
            hits[0 if tags[r, t % SLOTS] == t + 1 else 1][r] += 1
        for s in range(SLOTS):
            mapped = [t for t in tokens[r] if t >= 0 and t % SLOTS == s]
            if mapped and tags[r, s] != max(mapped) + 1:
                tags[r, s] = max(mapped) + 1
                rows[r, s] = fresh[max(mapped)]
    return tags, rows, hits


def test_lookup_and_fill_match_a_direct_mapped_model():
    rng = np.random.default_rng(0)
    source = rng.standard_normal((80, WIDTH)).astype(np.float32)  # the row of token t is source[t]
    cache = RowCache(rows=jnp.zeros((GROUPS, SLOTS, WIDTH)), tags=jnp.zeros((GROUPS, SLOTS), jnp.int32))
    step = jax.jit(lambda c, t, rows: RowFill(tokens=t, hit=row_lookup(c, t)[0], rows=rows))
    look = jax.jit(row_lookup)
    seen_hit = False
    for _ in range(6):
        tags, rows = np.asarray(cache.tags), np.asarray(cache.rows)
        tokens = random_step(rng, tags)
        hit, cached = look(cache, jnp.asarray(tokens))
        hit = np.asarray(hit)
        want_hit = (tokens >= 0) & (np.take_along_axis(tags, np.maximum(tokens, 0) % SLOTS, 1) == tokens + 1)
        np.testing.assert_array_equal(hit, want_hit)
        np.testing.assert_array_equal(np.asarray(cached)[hit], source[tokens[hit]])  # a hit is the token's row
        seen_hit |= hit.any()
        fill = step(cache, jnp.asarray(tokens), jnp.asarray(source[np.maximum(tokens, 0)]))
        written = np.asarray(row_writes(SLOTS, fill.tokens, fill.hit)[0])
        for r in range(GROUPS):  # one writer per slot: the scatter's order cannot matter
            kept = written[r][written[r] < SLOTS]
            assert len(kept) == len(set(kept.tolist()))
        stacked = jax.tree.map(lambda a: a[None], fill)
        new = commit_rows(jax.tree.map(lambda a: a[None], cache), stacked)
        want_tags, want_rows, (hits, misses) = model_step(tags, rows, tokens, source)
        np.testing.assert_array_equal(np.asarray(new.tags[0]), want_tags)
        np.testing.assert_array_equal(np.asarray(new.rows[0]), want_rows)
        np.testing.assert_array_equal(np.asarray(new.hits[0]), hits)
        np.testing.assert_array_equal(np.asarray(new.fetched[0]), misses)
        cache = RowCache(rows=new.rows[0], tags=new.tags[0])
    assert seen_hit


def test_colliding_tokens_keep_the_largest():
    cache = RowCache(rows=jnp.zeros((1, 4, 2)), tags=jnp.asarray([[0, 2, 0, 0]], jnp.int32))  # slot 1 holds token 1
    tokens = jnp.asarray([[9, 1, 5, -1]], jnp.int32)  # all three map to slot 1 of 4
    hit, _ = row_lookup(cache, tokens)
    assert np.asarray(hit).tolist() == [[False, True, False, False]]
    slot, hits, fetched = row_writes(4, tokens, hit)
    assert np.asarray(slot).tolist() == [[1, 4, 4, 4]]  # only token 9 writes (slot 1); the rest drop
    assert np.asarray(hits).tolist() == [1] and np.asarray(fetched).tolist() == [2]


def test_step_config_and_hook_check_the_row_cache():
    with pytest.raises(ValueError, match="row_cache must be an int >= 0 or .last."):
        StepConfig(row_cache=-1)
    with pytest.raises(ValueError, match="selects every row"):
        decode.SparseAttention(methods.parse("dense"), k=64, step=StepConfig(row_cache=8))
    attn = decode.from_spec("sparq:4", k=8, sink=2, local=4, step=StepConfig(row_cache=8))
    cache = attn.init_cache(CacheShape(layers=2, batch=1, kv_heads=2, capacity=64, head_dim=8, dtype=jnp.bfloat16))
    assert cache.row_cache.rows.shape == (2, 2, 8, 16) and cache.row_cache.tags.dtype == jnp.int32
    assert int(cache.row_cache.tags.max()) == 0  # empty


def test_prefill_of_a_layer_empties_its_slots():
    attn = decode.from_spec("sparq:4", k=8, sink=2, local=4, step=StepConfig(row_cache=8))
    cache = attn.init_cache(CacheShape(layers=2, batch=1, kv_heads=2, capacity=64, head_dim=8, dtype=jnp.float32))
    full = empty_row_cache(lambda s, d: jnp.ones(s, d), n_layers=2, groups=2, slots=8, width=16, dtype=jnp.float32)
    cache = cache.__class__(**{**cache.__dict__, "row_cache": full})
    keys = jnp.asarray(np.random.default_rng(1).standard_normal((1, 2, 16, 8)), jnp.float32)  # [B, Hkv, T, D]
    out = attn.write_prompt(cache, 1, keys, keys, jnp.full((1,), 16, jnp.int32))
    assert int(out.row_cache.tags[0].min()) == 1 and int(out.row_cache.tags[1].max()) == 0


def test_stacked_lookup_reads_its_layer_and_groups_in_place():
    rng = np.random.default_rng(3)
    tags = jnp.asarray(rng.integers(0, 40, (2, 5, SLOTS)), jnp.int32)
    rows = jnp.asarray(rng.standard_normal((2, 5, SLOTS, WIDTH)), jnp.float32)
    tokens = jnp.asarray(rng.integers(-1, 40, (3, SELECTED)), jnp.int32)
    got = row_lookup(RowCache(rows=rows, tags=tags), tokens, layer=1, group_start=2)
    want = row_lookup(RowCache(rows=rows[1, 2:5], tags=tags[1, 2:5]), tokens)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_last_step_rows_found_by_search():
    """``mode="last"``: a token is a hit exactly where the previous step's union held it (its sorted slots, masked
    duplicates as zero tags), and the hit's row is that slot's; the commit keeps the new union whole."""
    rng = np.random.default_rng(5)
    source = rng.standard_normal((200, WIDTH)).astype(np.float32)
    union = lambda: np.where(rng.random(SELECTED) < 0.8, np.sort(rng.choice(200, SELECTED, replace=False)), -1)  # noqa: E731
    previous = np.stack([union() for _ in range(GROUPS)]).astype(np.int32)
    cache = RowCache(rows=jnp.asarray(source[np.maximum(previous, 0)] * (previous >= 0)[..., None]),
                     tags=jnp.asarray(np.where(previous >= 0, previous + 1, 0)), mode="last")
    tokens = np.stack([np.where(rng.random(SELECTED) < 0.5, previous[r], rng.integers(0, 200, SELECTED))
                       for r in range(GROUPS)]).astype(np.int32)
    tokens = np.sort(np.where(rng.random(tokens.shape) < 0.1, -1, tokens), axis=-1)  # unsorted holes are fine
    hit, cached = jax.jit(row_lookup)(cache, jnp.asarray(tokens))
    hit = np.asarray(hit)
    want = np.stack([np.isin(tokens[r], previous[r][previous[r] >= 0]) & (tokens[r] >= 0) for r in range(GROUPS)])
    np.testing.assert_array_equal(hit, want)
    np.testing.assert_array_equal(np.asarray(cached)[hit], source[tokens[hit]])
    fill = RowFill(tokens=jnp.asarray(tokens), hit=jnp.asarray(hit), rows=jnp.asarray(source[np.maximum(tokens, 0)]))
    new = commit_rows(jax.tree.map(lambda a: a[None], cache), jax.tree.map(lambda a: a[None], fill))
    np.testing.assert_array_equal(np.asarray(new.tags[0]), np.where(tokens >= 0, tokens + 1, 0))
    assert new.mode == "last" and np.asarray(new.hits[0]).tolist() == hit.sum(-1).tolist()


def test_last_step_rows_decode_the_same_bits(tiny_model):
    """``row_cache="last"``: a step takes the rows the previous step selected from device memory and fetches only the
    others: the same logits, bit for bit, as fetching every row; most rows come from the slots."""
    from fathom_jax.models import generation
    from fathom_jax.placement import Placement

    rng = np.random.default_rng(2)
    prompt, tokens = rng.integers(0, 97, (2, 200)).astype(np.int32), rng.integers(0, 97, (2, 4)).astype(np.int32)

    def run(step):
        attn = decode.from_spec("fathom:16", k=40, implementation="triton", placement=Placement("pinned_host"),
                                step=step)
        logits, cache, attn = generation.prefill(tiny_model, prompt, np.array([200, 170]), attn, 256)
        out = [np.asarray(logits)]
        for t in range(tokens.shape[1]):
            _, logits, cache = generation.decode_step(tiny_model, tokens[:, t], cache, attn)
            out.append(np.asarray(logits))
        return np.stack(out), cache

    want, _ = run(StepConfig())
    got, cache = run(StepConfig(row_cache="last"))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert cache.row_cache.mode == "last" and cache.row_cache.tags.shape[-1] == 3 * 40  # G x k slots
    hits, fetched = int(cache.row_cache.hits.sum()), int(cache.row_cache.fetched.sum())
    assert hits > fetched  # the last step reselected most of its rows
