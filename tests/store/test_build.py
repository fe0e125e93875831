import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from fathom_jax import format as fmt
from fathom_jax import store as S


def direct_quantize(keys, scale, t):
    """Independent t-bit mid-rise quantizer of [-a, a) with the given (fp16) scale, in numpy."""
    a = np.asarray(scale, np.float32)
    half = 2 ** (t - 1)
    step = a / half
    with np.errstate(divide="ignore", invalid="ignore"):
        cell = np.where(step > 0, np.floor(keys / np.where(step > 0, step, 1)), 0)
    cell = np.where((keys < 0) & (cell >= 0) & (step > 0), -1, cell)  # floor of a negative is <= -1
    cell = np.clip(cell, -half, half - 1)
    return ((cell + 0.5) * step).astype(np.float32)


def error_bound(keys, scales):
    """4-bit error bound: half a cell (a / 16), plus whatever fp16 rounding cut off the scale."""
    scales = np.asarray(scales, np.float32)
    return scales / 16 * (1 + 1e-5) + np.maximum(np.abs(keys) - scales, 0) + 1e-6


def test_appendix_codes_and_scale(appendix):
    store = S.build_store(appendix.keys)
    assert store.capacity == 64 and int(store.length) == 6
    np.testing.assert_array_equal(np.asarray(S.read_codes(store))[:6, 2], [4, 12, 9, 14, 0, 3])
    assert float(store.scales[2, 0]) == 0.5
    # The sign plane of channel 2 alone: -0.25 for t0, t4, t5 and +0.25 for t1, t2, t3.
    one = np.asarray(S.dequantize(store, jnp.array([0, 0, 1, 0])))[:6, 2]
    np.testing.assert_array_equal(one, [-0.25, 0.25, 0.25, 0.25, -0.25, -0.25])


def test_appendix_approximate_scores(appendix):
    store = S.build_store(appendix.keys)
    keys = np.asarray(S.dequantize(store, jnp.array([4, 3, 1, 0])))[:6]
    scores = appendix.q @ keys.T
    np.testing.assert_allclose(scores[0], [5.01, -1.79, 0.46, 4.96, -2.34, 3.59], atol=0.005)
    np.testing.assert_allclose(scores[1], [2.84, 0.24, -2.01, 2.49, -0.61, 3.36], atol=0.005)
    exact = appendix.q @ appendix.keys.T
    np.testing.assert_allclose(exact[0], [5.40, -1.80, -0.10, 5.10, -3.10, 3.19], atol=0.005)
    np.testing.assert_allclose(exact[1], [2.81, 0.40, -2.19, 2.20, -0.69, 3.39], atol=0.005)
    assert set(np.argsort(-scores[0])[:2]) == {0, 3}  # head A: {t0, t3}
    assert set(np.argsort(-scores[1])[:2]) == {5, 0}  # head B: {t5, t0}


_dequantize = jax.jit(S.dequantize)


@settings(max_examples=12, deadline=None)
@given(
    # A few shapes (one token, a partial block, one exact block, two and a partial; one or six channels): each
    # shape compiles the store's programs once, the values are drawn fresh every example.
    keys=hnp.arrays(np.float32, st.tuples(st.sampled_from([1, 37, 64, 150]), st.sampled_from([1, 6])),
                    elements=st.floats(-1e3, 1e3, width=32)),
    t=st.integers(0, 4),
)
def test_prefix_read_is_the_t_bit_quantizer(keys, t):
    """Bit for bit: t planes == direct t-bit quantization under the same stored scale (the read as one program per
    shape: eagerly, every op compiles for every drawn shape)."""
    store = S.build_store(keys)
    n, d = keys.shape
    got = np.asarray(_dequantize(store, jnp.int32(t)))[:n]
    scales = np.repeat(np.asarray(store.scales, np.float32).T, fmt.BLOCK_TOKENS, axis=0)[:n]
    want = direct_quantize(keys, scales, t) if t > 0 else np.zeros_like(keys)
    np.testing.assert_array_equal(got, want)


@settings(max_examples=30, deadline=None)
@given(codes=hnp.arrays(np.int32, st.tuples(st.integers(1, 3).map(lambda w: 32 * w), st.integers(1, 5)),
                        elements=st.integers(0, 15)))
def test_pack_unpack_round_trip(codes):
    planes = jax.jit(S.pack_planes)(jnp.asarray(codes))
    unpack = jax.jit(S.unpack_planes)
    np.testing.assert_array_equal(np.asarray(unpack(planes)), codes)
    for t in range(5):
        np.testing.assert_array_equal(np.asarray(unpack(planes, jnp.int32(t))), codes >> (4 - t))


def test_channel_major_runs_are_contiguous(rng, random_keys):
    """The first t planes of channel j are one contiguous slice of the flat word array."""
    keys = random_keys(rng, (2, 256, 8))
    store = S.build_store(keys)
    flat = np.asarray(store.planes).reshape(-1)
    w = store.capacity // 32
    for b, j, t in [(0, 0, 1), (1, 5, 3), (1, 7, 4)]:
        start = (b * 8 + j) * 4 * w
        np.testing.assert_array_equal(flat[start:start + t * w], np.asarray(store.planes[b, j, :t]).reshape(-1))
    assert store.plane_run_bytes() == 256 // 8


def test_tail_block_and_length(rng, random_keys):
    keys = random_keys(rng, (3, 100, 4))
    store = S.build_store(keys, capacity=200)
    assert store.capacity == 256 and store.num_blocks == 4
    # Rows past the length are zero and never reach a scale.
    deq = np.asarray(_dequantize(store))
    assert np.all(deq[:, 100:] == 0)
    short = S.build_store(keys, length=np.array([100, 70, 0]))
    np.testing.assert_array_equal(np.asarray(_dequantize(short))[1, 70:], 0)
    np.testing.assert_array_equal(np.asarray(short.scales)[2], 0)
    ref = S.build_store(keys[1, :70])
    np.testing.assert_array_equal(np.asarray(short.scales)[1], np.asarray(ref.scales))


@pytest.mark.parametrize("split", [0, 1, 63, 64, 65, 130])
def test_append_equals_build(rng, split, random_keys):
    keys = random_keys(rng, (2, 3, 150, 8))
    full = S.build_store(keys, capacity=256)
    part = S.append(S.build_store(keys[..., :split, :], capacity=256), keys[..., split:, :])
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(part)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_append_under_jit_and_rotation(rng, random_keys):
    keys = random_keys(rng, (2, 70, 4))
    basis = np.linalg.qr(rng.standard_normal((4, 4)))[0].astype(np.float32)
    rot = S.KeyRotation(mean=jnp.asarray(keys.mean(1)), basis=jnp.broadcast_to(basis, (2, 4, 4)))
    full = S.build_store(keys, capacity=128, rotation=rot)
    step = jax.jit(lambda s, k: S.append(s, k))
    part = S.build_store(keys[:, :60], capacity=128, rotation=rot)
    for i in range(60, 70):
        part = step(part, keys[:, i:i + 1])
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(part)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The rotated store holds (k - mu) V.
    want = np.einsum("bnd,de->bne", keys - keys.mean(1, keepdims=True), basis)
    assert np.all(np.abs(np.asarray(S.dequantize(full))[:, :70] - want) <= error_bound(want, S.token_scales(full)[:, :70]))


def test_append_past_capacity_is_an_error(rng, random_keys):
    store = S.build_store(random_keys(rng, (64, 4)))
    with pytest.raises(ValueError, match="past capacity"):
        S.append(store[None] if False else store, jnp.zeros((1, 4)))
    jitted = jax.jit(lambda s, k: S.append(s, k))
    with pytest.raises(Exception, match="past capacity"):
        jax.block_until_ready(jitted(store, jnp.zeros((1, 4))))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_keys_rejected(rng, bad, random_keys):
    keys = random_keys(rng, (10, 4))
    keys[3, 1] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        S.build_store(keys)
    store = S.build_store(np.zeros((4, 4), np.float32), capacity=64)
    with pytest.raises(ValueError, match="NaN or inf"):
        S.append(store, keys[3:4])


def test_bad_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"\[..., n, D\]"):
        S.build_store(np.zeros(5, np.float32))
    with pytest.raises(TypeError, match="floating"):
        S.build_store(np.zeros((4, 4), np.int32))
    with pytest.raises(ValueError, match="capacity"):
        S.build_store(np.zeros((100, 4), np.float32), capacity=64)
    store = S.build_store(np.zeros((2, 8, 4), np.float32))
    with pytest.raises(ValueError, match="shape"):
        S.append(store, np.zeros((2, 1, 5), np.float32))
    with pytest.raises(ValueError, match="fp16"):
        S.build_store(np.full((2, 2), 1e6, np.float32))


def test_zero_block_and_extreme_values():
    keys = np.zeros((70, 3), np.float32)
    keys[65:, 1] = [1e-3, -2.0, 65000.0, -65000.0, 7.0]
    store = S.build_store(keys)
    deq = np.asarray(S.dequantize(store))[:70]
    assert np.all(deq[:64] == 0) and np.all(np.isfinite(deq))
    assert np.all(np.abs(deq[65:, 1] - keys[65:, 1]) <= error_bound(keys[65:, 1], np.asarray(store.scales)[1, 1]))


def test_bits_per_token_convention():
    assert float(fmt.bits_per_token(np.full(128, 4))) == 544
    assert float(fmt.bits_per_token(np.r_[np.full(32, 4), np.zeros(96)])) == 136
    assert float(fmt.bits_per_token(np.r_[np.full(16, 4), np.zeros(112)])) == 68
    assert float(fmt.bits_per_token(np.full(128, 2))) == 288
    assert float(fmt.bits_per_token(np.array([4, 3, 1, 0]))) == 8.75


@pytest.mark.parametrize("jit", [False, True])
def test_subnormal_negative_key_takes_a_negative_cell(jit):
    """Eq. 2 puts every strictly negative key in a negative cell; XLA's fusion flushed -1e-42 to -0 under jit."""
    keys = np.zeros((64, 3), np.float32)
    keys[0] = 1.0
    keys[1] = [-1e-42, 1e-42, -0.0]
    build = jax.jit(S.build_store) if jit else S.build_store
    codes = np.asarray(S.read_codes(build(keys)))
    np.testing.assert_array_equal(codes[1], [7, 8, 8])  # -tiny: cell -1; +tiny and -0.0: cell 0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_keys_rejected_under_jit(bad):
    """Under jit the NaN became a NaN block scale and the inf a finite 65504 one, silently."""
    keys = jnp.zeros((64, 4)).at[3, 1].set(bad)
    with pytest.raises(jax.errors.JaxRuntimeError, match="build_store: keys contains 1 NaN or inf"):
        jax.block_until_ready(jax.jit(S.build_store)(keys))


def test_append_overflow_under_jit_reads_as_its_value_error(caplog):
    store = S.build_store(np.zeros((64, 4), np.float32), capacity=64)
    with caplog.at_level("ERROR"), pytest.raises(jax.errors.JaxRuntimeError) as err:
        jax.block_until_ready(jax.jit(S.append)(store, jnp.zeros((1, 4))))
    assert str(err.value).rstrip().endswith(
        "ValueError: append: 1 token(s) past capacity (length 64, capacity 64); build the store with a larger capacity")
    assert not caplog.records, "JAX logged a second copy of the traceback"


def test_checked_append_under_vmap_raises_only_on_overflow():
    """vmap turns the check's cond into a select that runs the callback for every sequence."""
    stores = jax.vmap(lambda k: S.build_store(k, capacity=128))(jnp.ones((3, 64, 4)))
    grown = jax.jit(jax.vmap(S.append))(stores, jnp.ones((3, 1, 4)))
    np.testing.assert_array_equal(grown.length, [65, 65, 65])
    full = jax.vmap(lambda k: S.build_store(k, capacity=64))(jnp.ones((3, 64, 4)))
    with pytest.raises(jax.errors.JaxRuntimeError, match="past capacity"):
        jax.block_until_ready(jax.jit(jax.vmap(S.append))(full, jnp.ones((3, 1, 4))))


@pytest.mark.parametrize("depth", [7, -1])
def test_depth_outside_the_four_planes(depth):
    """Depth 7 read garbage and -1 zeros; concrete depths raise, traced ones come out NaN."""
    store = S.build_store(np.ones((64, 4), np.float32))
    with pytest.raises(ValueError, match=r"dequantize: depth must lie in \[0, 4\]"):
        S.dequantize(store, depth)
    with pytest.raises(ValueError, match=r"depth must lie in \[0, 4\]"):
        S.read_codes(store, depth)
    read = np.asarray(jax.jit(S.dequantize)(store, jnp.array([0, 2, 4, depth])))
    assert np.all(np.isnan(read[:, 3])) and np.all(np.isfinite(read[:, :3]))


def test_cells_are_exact_when_the_division_rounds_one_ulp_off():
    """bf16 keys sit on cell boundaries often; a quotient one ulp low or high (a GPU dividing by a reciprocal
    multiply) still gives floor(key / width), the cell of the exact quotient (float64 here)."""
    rng = np.random.default_rng(11)
    keys = np.asarray(jnp.asarray(rng.standard_normal((4096,)), jnp.bfloat16), np.float32)
    width = np.asarray(jnp.asarray(rng.uniform(0.05, 0.5, (4096,)), jnp.float16), np.float32) / 8
    keys = np.concatenate([keys, np.arange(-8, 8, dtype=np.float32) * width[:16]])  # exactly on boundaries
    width = np.concatenate([width, width[:16]])
    want = np.floor(keys.astype(np.float64) / width.astype(np.float64))
    ratio = keys / width
    on_boundary = ratio == np.round(ratio)
    assert on_boundary.sum() >= 16
    for nudged in (ratio, np.nextafter(ratio, -np.inf), np.nextafter(ratio, np.inf)):
        got = np.asarray(S.exact_cell(jnp.asarray(keys), jnp.asarray(width), jnp.asarray(nudged)))
        np.testing.assert_array_equal(got, want)
    assert np.asarray(S.exact_cell(jnp.float32(-1e-3), jnp.float32(0.0), jnp.float32(0.0))) == 0  # zero width
