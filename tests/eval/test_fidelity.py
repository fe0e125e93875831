import numpy as np
import pytest

from fathom_jax import calibrate as cal
from fathom_jax import methods as M
from fathom_jax.eval import fidelity as fid


def make_capture(random_keys, rng, layers=2, heads=4, kv=2, tokens=160, d=16):
    q = random_keys(rng, (layers, heads, tokens, d))
    k = random_keys(rng, (layers, kv, tokens, d))
    v = rng.standard_normal((layers, kv, tokens, d)).astype(np.float32)
    return fid.Capture(q=q, k=k, v=v)


def reference_error(cap, layer, head, p, k_sel):
    """Plain numpy: exact top-k (4 sink + 32 local + best of the rest) vs dense, one query."""
    g = cap.group_size
    q = np.asarray(cap.q[layer, head, p])
    keys = np.asarray(cap.k[layer, head // g, : p + 1])
    vals = np.asarray(cap.v[layer, head // g, : p + 1])
    s = keys @ q
    forced = {i for i in range(p + 1) if i < 4 or i > p - 32}
    rest = [i for i in np.argsort(-s, kind="stable") if i not in forced][: k_sel - len(forced)]
    chosen = sorted(forced | set(rest))

    def attn(idx):
        logit = s[idx] / np.sqrt(q.size)
        w = np.exp(logit - logit.max())
        return (w / w.sum()) @ vals[idx]

    dense = attn(np.arange(p + 1))
    return np.linalg.norm(attn(np.array(chosen)) - dense) / np.linalg.norm(dense)


def test_oracle_error_matches_plain_reference(rng, random_keys):
    cap = make_capture(random_keys, rng)
    positions = np.array([100, 130, 159])
    err, bits = fid.attention_errors(fid.method_score_fn(M.Exact()), cap, 48, positions=positions)
    assert err.shape == (2, 3, 2, 2) and np.all(bits == 16 * 16)
    for layer in range(2):
        for pi, p in enumerate(positions):
            for h in range(4):
                want = reference_error(cap, layer, h, p, 48)
                np.testing.assert_allclose(err[layer, pi, h // 2, h % 2], want, rtol=1e-4, atol=1e-6)


def test_selecting_everything_is_exact(rng, random_keys):
    cap = make_capture(random_keys, rng, tokens=64)
    err, _ = fid.attention_errors(fid.method_score_fn(M.SparQ(2)), cap, 64, positions=np.array([63]))
    assert np.max(err) < 1e-5


def test_methods_order_by_bits(rng, random_keys):
    """More bits, closer to the oracle: full 4-bit vs a 1-channel SparQ on loud-channel keys."""
    cap = make_capture(random_keys, rng, tokens=256, d=32)
    calib = cal.calibrate(cap.k[:, :, :128], cap.q[:, :, :128])
    pos = np.arange(200, 256, 8)
    run = lambda m: fid.mean_attention_error(fid.method_score_fn(m), cap, 48, positions=pos, layer_states=calib)
    oracle, _ = run(M.Exact())
    full, full_bits = run(M.Full4())
    sparq1, _ = run(M.SparQ(1))
    fathom, fathom_bits = run(M.Fathom(64))
    assert full_bits == 4 * 32 + 32 / 4
    assert 16 <= fathom_bits - 0 and fathom_bits <= 64 + 32 / 4
    assert oracle <= full <= sparq1
    assert fathom <= sparq1


def test_bad_inputs(rng, random_keys):
    cap = make_capture(random_keys, rng, tokens=64)
    with pytest.raises(ValueError, match="larger than the captured context"):
        fid.attention_errors(fid.method_score_fn(M.Exact()), cap, 65)
    with pytest.raises(ValueError, match="positions"):
        fid.attention_errors(fid.method_score_fn(M.Exact()), cap, 40, positions=np.array([64]))
    with pytest.raises(ValueError, match="Capture"):
        fid.Capture(q=np.zeros((2, 4, 8, 4)), k=np.zeros((2, 3, 8, 4)), v=np.zeros((2, 3, 8, 4)))


def test_several_k_and_per_layer_functions(rng, random_keys):
    cap = make_capture(random_keys, rng, tokens=128)
    pos = np.array([90, 127])
    exact = fid.method_score_fn(M.Exact())
    both, _ = fid.attention_errors(exact, cap, (40, 64), positions=pos)
    one, _ = fid.attention_errors(exact, cap, 64, positions=pos)
    np.testing.assert_array_equal(both[1], one)
    per_layer = [fid.method_score_fn(M.SparQ(2)), exact]
    err, bits = fid.attention_errors(per_layer, cap, 40, positions=pos)
    np.testing.assert_array_equal(err[1], both[0][1])
    assert np.all(bits[0] == 2 * 4 + 2 / 4) and np.all(bits[1] == 16 * 16)
    with pytest.raises(ValueError, match="per-layer"):
        fid.attention_errors([exact], cap, 40, positions=pos)


def _definition(method, cap, ks, positions, calib):
    """The protocol as first written (the rebuild-per-position path this module had): per position the index
    is built with length p + 1, every k selects on its own, dense attention is recomputed per method."""
    import jax
    import jax.numpy as jnp

    from fathom_jax.index import build_index
    from fathom_jax.scan import scan_scores
    from fathom_jax.select import dense_attention, select_topk, sparse_attention

    def one(q_p, keys, values, p, c):
        length = p + 1
        lengths = jnp.broadcast_to(length, keys.shape[:1])
        result = scan_scores(method, q_p, build_index(keys, c, method.parts, length=lengths), c)
        ref = dense_attention(q_p, keys, values, lengths)
        ref_norm = jnp.maximum(jnp.linalg.norm(ref, axis=-1), 1e-30)
        errs = []
        for k in ks:
            idx, mask = select_topk(result.scores, lengths, k)
            errs.append(jnp.linalg.norm(sparse_attention(q_p, keys, values, idx, mask) - ref, axis=-1) / ref_norm)
        return jnp.stack(errs), jnp.broadcast_to(result.bits_per_token, lengths.shape)

    run = jax.jit(lambda q, k, v, pos, c: jax.lax.map(lambda a: one(a[0], k, v, a[1], c), (q, pos)))
    n_layers, n_heads, _, d = cap.q.shape
    n_kv = cap.k.shape[1]
    errors, bits = [], []
    for layer in range(n_layers):
        q = jnp.moveaxis(jnp.asarray(cap.q[layer])[:, positions].reshape(n_kv, n_heads // n_kv, len(positions), d), 2, 0)
        c = None if calib is None else jax.tree.map(lambda x: x[layer], calib)
        e, b = run(q, jnp.asarray(cap.k[layer]), jnp.asarray(cap.v[layer]), jnp.asarray(positions), c)
        errors.append(np.moveaxis(np.asarray(e), 1, 0))
        bits.append(np.asarray(b))
    return np.stack(errors, axis=1), np.stack(bits)


def test_fast_path_equals_the_rebuild_per_position_definition(rng, random_keys):
    """The sweep's fast path gives the definition's numbers exactly, at full float precision, at positions on both
    sides of block boundaries and in the window's partial last block: every position scored in one product against
    the window's index (one build per layer and parts, the requantized block scored per position), budgets as data
    (one program for Fathom 16 and 24), a repeated (method, layer) computed once, the faster exact ranking, one
    gather for every k. So does the rebuild-per-position path of the module."""
    cap = make_capture(random_keys, rng, tokens=200, d=16)
    corpus = cal.calibrate(cap.k[:, :, :128], cap.q[:, :, :128])
    session = cal.calibrate_session(cap.k[:, :, :100])
    positions = np.array([63, 64, 127, 199])  # both sides of block boundaries; 199: the partial last block
    ks = (48, 40, 64)
    rows = [(M.Fathom(24), corpus), (M.Fathom(16), corpus), (M.FathomKLT(16), corpus), (M.FathomKLT(16), session),
            (M.Loki(4), corpus), (M.SparQ(4), None), (M.Landmark(), None), (M.Quest(), None), (M.Quest(8), None),
            (M.Exact(), None)]
    want = [_definition(m, cap, ks, positions, c) for m, c in rows]
    # Fathom 16 at layer 0 and Fathom 24 at layer 1: the same (method, layer) pairs as two rows above.
    per_layer = [fid.method_score_fn(M.Fathom(16)), fid.method_score_fn(M.Fathom(24))]
    want.append((np.stack([want[1][0][:, 0], want[0][0][:, 1]], axis=1), np.stack([want[1][1][0], want[0][1][1]])))
    evaluations = [fid.Evaluation(fid.method_score_fn(m), c) for m, c in rows] + [fid.Evaluation(per_layer, corpus)]
    refs = fid.dense_references(cap, positions)
    fast = fid.attention_errors_many(evaluations, cap, ks, positions=positions, references=refs)
    rebuilt = fid.attention_errors_many(evaluations[::3], cap, ks, positions=positions, references=refs,
                                        reuse_blocks=False)
    for (err, bits), (want_err, want_bits) in zip(fast + rebuilt, want + want[::3]):
        np.testing.assert_array_equal(err, want_err)
        np.testing.assert_array_equal(bits, want_bits)
    with pytest.raises(ValueError, match="other positions"):
        fid.attention_errors(fid.method_score_fn(M.Exact()), cap, ks, positions=positions[:2], references=refs)
