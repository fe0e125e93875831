import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import select as sel


def numpy_selection(scores, length, k, sink=4, local=32):
    """Independent reference: forced sink/local positions, then the best of the rest."""
    forced = [p for p in range(length) if p < sink or p >= length - local]
    rest = [p for p in np.argsort(-scores[:length], kind="stable") if p not in forced]
    return set(forced) | set(int(p) for p in rest[: max(k - len(forced), 0)])


@pytest.mark.parametrize("n,length,k", [(256, 256, 64), (256, 200, 64), (300, 50, 64), (128, 40, 40), (64, 64, 36)])
def test_select_matches_reference(rng, n, length, k):
    scores = rng.standard_normal((2, 3, n)).astype(np.float32)
    idx, mask = sel.select_topk(scores, np.full(2, length), k)
    assert idx.shape == (2, 3, k) and mask.shape == (2, 3, k)
    for b in range(2):
        for h in range(3):
            got = set(np.asarray(idx[b, h])[np.asarray(mask[b, h])].tolist())
            assert got == numpy_selection(scores[b, h], length, k)
            assert len(got) == int(mask[b, h].sum())  # no slot selected twice


def test_per_sequence_lengths_and_nan(rng):
    scores = rng.standard_normal((2, 1, 128)).astype(np.float32)
    scores[0, 0, 50] = np.nan
    idx, mask = sel.select_topk(scores, np.array([128, 60]), 40)
    chosen0 = set(np.asarray(idx[0, 0]).tolist())
    assert 50 not in chosen0
    chosen1 = set(np.asarray(idx[1, 0])[np.asarray(mask[1, 0])].tolist())
    assert max(chosen1) < 60 and set(range(4)) <= chosen1 and set(range(28, 60)) <= chosen1


def test_bad_k():
    scores = np.zeros((1, 100), np.float32)
    with pytest.raises(ValueError, match="larger than the context"):
        sel.select_topk(scores, 100, 101)
    with pytest.raises(ValueError, match="sink \\+ local"):
        sel.select_topk(scores, 100, 20)
    with pytest.raises(ValueError, match="positive"):
        sel.select_topk(scores, 100, 0)


def test_group_union(rng):
    idx = np.array([[[1, 2, 3, 9], [3, 4, 9, 0]]], np.int32)
    mask = np.array([[[True, True, True, False], [True, True, True, True]]])
    union, umask, member = sel.group_union(idx, mask)
    assert union.shape == (1, 8)
    assert set(np.asarray(union[0])[np.asarray(umask[0])].tolist()) == {0, 1, 2, 3, 4, 9}
    u = np.asarray(union[0])
    for h in range(2):
        got = set(u[np.asarray(member[0, h])].tolist())
        assert got == set(idx[0, h][mask[0, h]].tolist())


@pytest.mark.parametrize("g,ties", [(1, False), (4, False), (4, True), (5, True)])
def test_group_union_of_selections_against_numpy(rng, g, ties):
    """On select_topk's own output (ragged lengths, tied scores): one union slot per distinct token, and each
    head's member slots are exactly its selected tokens (numpy sets)."""
    scores = rng.standard_normal((3, g, 300)).astype(np.float32)
    scores = np.round(scores) if ties else scores
    idx, mask = sel.select_topk(scores, np.array([300, 120, 50]), 64)
    union, umask, member = (np.asarray(x) for x in sel.group_union(idx, mask))
    idx, mask = np.asarray(idx), np.asarray(mask)
    for b in range(3):
        chosen = [set(idx[b, h][mask[b, h]].tolist()) for h in range(g)]
        kept = union[b][umask[b]]
        assert len(kept) == len(set(kept.tolist())) and set(kept.tolist()) == set().union(*chosen)
        for h in range(g):
            assert set(union[b][member[b, h]].tolist()) == chosen[h]
            assert not np.any(member[b, h] & ~umask[b])


def test_sparse_attention_equals_dense_when_all_selected(rng):
    q = rng.standard_normal((3, 2, 16)).astype(np.float32)
    k = rng.standard_normal((3, 80, 16)).astype(np.float32)
    v = rng.standard_normal((3, 80, 16)).astype(np.float32)
    idx, mask = sel.select_topk(np.einsum("hgd,hnd->hgn", q, k), np.array([80, 70, 40]), 80)
    got = sel.sparse_attention(q, k, v, idx, mask)
    want = sel.dense_attention(q, k, v, np.array([80, 70, 40]))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    # Plain numpy softmax attention for the third sequence (40 valid keys).
    logits = q[2] @ k[2, :40].T / 4.0
    w = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(want[2]), (w / w.sum(-1, keepdims=True)) @ v[2, :40], rtol=2e-5, atol=2e-6)


def test_attend_over_union_equals_per_head_sparse_attention(rng):
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 300, 8)).astype(np.float32)
    v = rng.standard_normal((2, 300, 8)).astype(np.float32)
    scores = rng.standard_normal((2, 4, 300)).astype(np.float32)
    idx, mask = sel.select_topk(scores, 300, 64)
    union, umask, member = sel.group_union(idx, mask)
    rows_k = jnp.take_along_axis(k, union[..., None], axis=-2)
    rows_v = jnp.take_along_axis(v, union[..., None], axis=-2)
    got = sel.attend(q, rows_k, rows_v, member)
    want = sel.sparse_attention(q, k, v, idx, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_select_jits_with_traced_length(rng):
    scores = rng.standard_normal((4, 256)).astype(np.float32)
    fn = jax.jit(sel.select_topk, static_argnums=2)
    for length in (256, 100):
        idx, mask = fn(scores, length, 64)
        idx2, mask2 = sel.select_topk(scores, length, 64)
        np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx2))


@pytest.mark.parametrize("length", [300, 120, 50])
def test_pallas_selection_is_the_same_set(rng, length):
    """The Pallas top-k kernel (interpret mode on CPU) selects the same set as lax.top_k."""
    scores = rng.standard_normal((2, 3, 300)).astype(np.float32)
    lengths = np.array([length, length - 7])
    idx_x, mask_x = sel.select_topk(scores, lengths, 48)
    idx_p, mask_p = sel.select_topk(scores, lengths, 48, implementation="triton")
    for b in range(2):
        for h in range(3):
            want = set(np.asarray(idx_x[b, h])[np.asarray(mask_x[b, h])].tolist())
            got = set(np.asarray(idx_p[b, h])[np.asarray(mask_p[b, h])].tolist())
            assert got == want


def test_attention_shapes_are_checked_even_under_jit():
    """Values shorter than keys were clamped by the gather and gave NaN attention."""
    q, keys, values = jnp.ones((2, 4)), jnp.ones((10, 4)), jnp.ones((5, 4))
    idx, mask = jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3), bool)
    for fn in (sel.sparse_attention, jax.jit(sel.sparse_attention)):
        with pytest.raises(ValueError, match="values must have one row per key row"):
            fn(q, keys, values, idx, mask)
    with pytest.raises(ValueError, match="share head_dim"):
        sel.dense_attention(jnp.ones((2, 8)), keys, keys, 10)
    with pytest.raises(ValueError, match="indices and mask"):
        sel.sparse_attention(q, keys, keys, jnp.zeros((3, 3), jnp.int32), jnp.ones((3, 3), bool))


# ----------------------------------------------------------------------------------------------
# Issue 30: lengths past the context and indices past the keys, eagerly, under jit and in checkify mode


def test_length_past_the_scores_eagerly_jitted_and_checked(rng):
    """Jitted select_topk with length 5000 over n = 1000 scores kept 9 of the 32 most recent tokens. Eagerly and
    under checks.checked a CheckError; under plain jit (the decode hot path) the length is clamped to n."""
    from fathom_jax import checks

    scores = jnp.asarray(rng.standard_normal((1, 2, 300)).astype(np.float32))
    message = r"select_topk: length must lie in \[0, 300\] \(the scored positions\), got values in \[5000, 5000\]"
    with pytest.raises(checks.CheckError, match=message):
        sel.select_topk(scores, 5000, k=64, implementation="xla")
    top = jax.jit(functools.partial(sel.select_topk, implementation="xla"), static_argnames="k")
    idx, mask = top(scores, jnp.int32(5000), k=64)
    want_idx, want_mask = top(scores, jnp.int32(300), k=64)
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(mask, want_mask)
    assert set(range(268, 300)) <= set(np.asarray(idx[0, 0]).tolist())  # the 32 most recent tokens
    with pytest.raises(checks.CheckError, match=message):
        checks.checked(top)(scores, jnp.int32(5000), k=64)
    with pytest.raises(checks.CheckError, match=r"got values in \[-1, -1\]"):
        sel.select_topk(scores, -1, k=64, implementation="xla")
    with pytest.raises(TypeError, match=r"length must be integer token counts \[\*B\], got dtype float"):
        sel.select_topk(scores, 300.0, k=64, implementation="xla")
    with pytest.raises(checks.CheckError, match=r"broadcast to the batch \[\*B\] = \[1\] .* got shape \[2\]"):
        sel.select_topk(scores, jnp.array([300, 300]), k=64, implementation="xla")


def test_indices_past_the_keys_eagerly_jitted_and_checked(rng):
    """``sparse_attention`` with indices past n gave all-NaN outputs eagerly and without a word. Eagerly and under
    checks.checked a CheckError; under plain jit (the decode hot path) a head that selects such a row outputs
    NaN, the documented default, while the other heads and unselected out-of-range slots are unaffected."""
    from fathom_jax import checks

    q = jnp.asarray(rng.standard_normal((1, 2, 8)).astype(np.float32))
    keys, values = (jnp.asarray(rng.standard_normal((1, 50, 8)).astype(np.float32)) for _ in range(2))
    idx = jnp.asarray(np.stack([np.arange(40), np.arange(40) + 5])[None].astype(np.int32))
    mask = jnp.ones((1, 2, 40), bool)
    good = np.asarray(sel.sparse_attention(q, keys, values, idx, mask))
    bad_idx = idx.at[0, 1, 3].set(2000)
    message = r"sparse_attention: indices must lie in \[0, 50\) .* where mask is set, got 1 outside, in \[2000, 2000\]"
    with pytest.raises(checks.CheckError, match=message):
        sel.sparse_attention(q, keys, values, bad_idx, mask)
    out = np.asarray(jax.jit(sel.sparse_attention)(q, keys, values, bad_idx, mask))
    np.testing.assert_array_equal(out[0, 0], good[0, 0])
    assert np.all(np.isnan(out[0, 1]))
    with pytest.raises(checks.CheckError, match=message):
        checks.checked(jax.jit(sel.sparse_attention))(q, keys, values, bad_idx, mask)
    # masked-out slots may hold anything (the Pallas top-k marks them -1): never read, never an error
    unused = np.asarray(sel.sparse_attention(q, keys, values, idx.at[0, 1, 3].set(-1), mask.at[0, 1, 3].set(False)))
    assert np.all(np.isfinite(unused))
    with pytest.raises(TypeError, match=r"indices must be integer \[..., G, k\], got dtype float32"):
        sel.sparse_attention(q, keys, values, idx.astype(jnp.float32), mask)
