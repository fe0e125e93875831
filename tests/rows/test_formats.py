import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import store as S
from fathom_jax.rows import formats as rf

# One of each kind: bf16 rows, mixed bf16/int sides, per-token absmax and min/max (whole row and groups),
# per-(channel, block) K at 64 and 16 tokens, 4-bit both sides, the store's codes.
SPECS = ("bf16", "k16v8", "k8v8", "k8av8a", "k8g32v4g32a", "k8c64v8", "k4c16av4g32a", "kstorev16")
D = 64


def kv(shape, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal(shape) * scale).astype(np.float32)
    v = (rng.standard_normal(shape) * scale).astype(np.float32)
    # A few exact ties on quantizer boundaries and zeros: where a division's rounding would show.
    k[..., :3, :4] = np.array([0.5, -0.5, 0.0, 2.0], np.float32)
    return k, v


def encoder(f, capacity=None):
    """``f.encode`` compiled once per shape (eagerly, each of its many small ops compiles on its own: slower)."""
    return jax.jit(lambda k, v, length=None: f.encode(k, v, capacity=capacity, length=length))


def round_trip(f, k, v):
    return jax.jit(lambda k, v: f.decode(f.encode(k, v)))(k, v)


def bits(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_same_bits(a, b):
    la, lb = bits(a), bits(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint8) if x.dtype.kind == "f" else x,
                                      y.view(np.uint8) if y.dtype.kind == "f" else y)


def test_parse_and_specs():
    for spec in rf.STUDY_FORMATS:
        f = rf.parse(spec)
        assert f.spec == spec and rf.parse(f) is f
        assert hash(f) == hash(rf.parse(spec))  # hashable, equal by value: a static jit argument
    assert rf.parse("k16v16") == rf.parse("bf16") and rf.parse(" K8V8 ").spec == "k8v8"
    f = rf.parse("k4c16av4g32a")
    assert (f.key.bits, f.key.block, f.key.asym, f.value.group, f.value.asym) == (4, 16, True, 32, True)


@pytest.mark.parametrize("spec, message", [
    ("k8", "unknown row format"), ("k3v8", "unknown row format"), ("k8v8x", "unknown row format"),
    ("k8vstore", "only be the keys"), ("k8v8c64", "keys only"), ("k8c48v8", "must divide 64"), ("", "unknown"),
])
def test_parse_rejects(spec, message):
    with pytest.raises(ValueError, match=message):
        rf.parse(spec)
    with pytest.raises(ValueError, match="must be a string"):
        rf.parse(8)


def test_bytes_per_token():
    # Today's rows: 512 B of bf16 K and V plus the index's 64 B of planes and 4 B of block scales at Dh = 128.
    assert rf.parse("bf16").bytes_per_token(128) == 580
    assert rf.parse("bf16").bytes_per_token(128, index=False) == 512
    assert rf.parse("k8v8").row_bytes(128) == 128 + 2 + 128 + 2
    assert rf.parse("k8g32v8g32").bytes_per_token(128) == 256 + 2 * 4 * 2 + 68  # 340: exactly the target
    assert rf.parse("k8av8a").row_bytes(64) == 64 + 4 + 64 + 4
    # K per (channel, 64 tokens), asymmetric: two fp16 per channel per 64 tokens in a separate array.
    f = rf.parse("k4c64av4g32a")
    assert f.row_bytes(128) == 64 + 64 + 4 * 4 and f.block_scale_bytes(128) == 128 * 4 / 64
    assert rf.parse("k4c16av16").block_scale_bytes(64) == 64 * 4 / 16
    # The store's codes are the index's: only the V row and the index count.
    assert rf.parse("kstorev16").bytes_per_token(128) == 256 + 68


@pytest.mark.parametrize("spec", SPECS)
def test_append_equals_encode(spec):
    """Appending token by token (across blocks, from a partial one) gives the bits of encoding at once."""
    f = rf.parse(spec)
    k, v = kv((2, 150, D))
    enc = encoder(f, capacity=192)
    full = enc(k, v)
    assert_same_bits(f.append(enc(k[:, :37], v[:, :37]), k[:, 37:], v[:, 37:]), full)
    if spec in ("bf16", "k8g32v4g32a", "k4c16av4g32a"):  # under jit and vmap (one sequence at a time), from empty
        appended = jax.jit(jax.vmap(lambda r, a, b: f.append(r, a, b, check=False)))(enc(k[:, :0], v[:, :0]), k, v)
        assert_same_bits(appended, full)


@pytest.mark.parametrize("spec", ("k8av8a", "k8c64v8", "k4c16av4g32a", "kstorev16"))
def test_encode_with_length_and_slices(spec):
    """A length masks the tokens past it out of every scale; a block's rows encode the same on their own."""
    f = rf.parse(spec)
    k, v = kv((2, 128, D), seed=1)
    rows = encoder(f)(k, v, np.array([70, 0], np.int32))
    assert_same_bits(jax.tree.map(lambda x: x[0], rows), encoder(f, capacity=128)(k[0, :70], v[0, :70]))
    assert not np.any(np.asarray(rows.data[1])) and not np.any(np.asarray(rows.block_scales[1]))
    # The rows of the block [64, 128) of a cache of 70 tokens: the block's tokens alone, with length 6.
    block = encoder(f)(k[0, 64:], v[0, 64:], 6)
    np.testing.assert_array_equal(np.asarray(rows.data[0, 64:]), np.asarray(block.data))


def test_bf16_round_trip_is_exact():
    f = rf.parse("bf16")
    k, v = kv((2, 100, D))
    k, v = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    rows = f.encode(k, v)
    assert rows.data.dtype == jnp.bfloat16 and rows.data.shape == (2, 128, 2 * D)  # today's [n, 2 Dh] layout
    dk, dv = f.decode(rows)
    np.testing.assert_array_equal(np.asarray(dk[:, :100]), np.asarray(k, np.float32))
    np.testing.assert_array_equal(np.asarray(dv[:, :100]), np.asarray(v, np.float32))
    assert not np.any(np.asarray(dk[:, 100:])) and not np.any(np.asarray(dv[:, 100:]))


def reference_token_quant(x, bits, group, asym):
    """Independent numpy quantizer: per-token groups, fp16 scales, round half up."""
    n, d = x.shape
    g = x.reshape(n, d // group, group).astype(np.float64)
    if asym:
        q = 2 ** bits - 1
        zero = g.min(-1, keepdims=True).astype(np.float16).astype(np.float64)
        s = ((g.max(-1, keepdims=True) - zero).astype(np.float32) * np.float32(1 / q)).astype(np.float16).astype(np.float64)
        c = np.clip(np.floor(np.divide(g - zero, s, out=np.zeros_like(g), where=s > 0) + 0.5), 0, q)
        return (c * s + zero).reshape(n, d)
    q = 2 ** (bits - 1) - 1
    s = (np.abs(g).max(-1, keepdims=True).astype(np.float32) * np.float32(1 / q)).astype(np.float16).astype(np.float64)
    c = np.clip(np.floor(np.divide(g, s, out=np.zeros_like(g), where=s > 0) + 0.5), -q, q)
    return (c * s).reshape(n, d)


@pytest.mark.parametrize("spec, kref, vref", [
    ("k8v8", (8, D, False), (8, D, False)), ("k8av8a", (8, D, True), (8, D, True)),
    ("k8g32v4g32a", (8, 32, False), (4, 32, True)),
])
def test_per_token_values_match_reference(spec, kref, vref):
    f = rf.parse(spec)
    k, v = kv((40, D), seed=2, scale=3.0)
    dk, dv = (np.asarray(x[:40]) for x in round_trip(f, k, v))
    np.testing.assert_allclose(dk, reference_token_quant(k, *kref), rtol=0, atol=1e-5)
    np.testing.assert_allclose(dv, reference_token_quant(v, *vref), rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec", ("k8g32v4g32a", "k8c64v8", "k4c16av4g32a", "kstorev16"))  # per-token: exact above
def test_error_bounds(spec):
    """Each value lies within half a quantizer step of its input (plus fp16 scale rounding)."""
    f = rf.parse(spec)
    k, v = kv((2, 200, D), seed=3, scale=2.0)
    dk, dv = (np.asarray(x[:, :200]) for x in round_trip(f, k, v))
    for x, y, c in ((k, dk, f.key), (v, dv, f.value)):
        if c.bits == 16:
            np.testing.assert_array_equal(y, np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32))
            continue
        if c.block:  # per (channel, block): the block's range over each channel
            xb = x.reshape(2, -1, c.block, D) if x.shape[1] % c.block == 0 else np.pad(
                x, ((0, 0), (0, -x.shape[1] % c.block), (0, 0)), mode="edge").reshape(2, -1, c.block, D)
            spread = (xb.max(2) - xb.min(2)) if c.asym else np.abs(xb).max(2)
            spread = np.repeat(spread, c.block, axis=1)[:, :200]
        else:
            xg = x.reshape(2, 200, -1, c.group or D)
            spread = (xg.max(-1) - xg.min(-1)) if c.asym else np.abs(xg).max(-1)
            spread = np.repeat(spread, c.group or D, axis=-1)
        levels = (2 ** c.bits - 1) if c.asym else (2 ** (c.bits - 1) - 1)
        half_step = spread / 16 if c.store else spread / levels / 2  # the store: a / 8 cells, midpoints
        fp16 = np.abs(x).max() * 2.0 ** -10  # what rounding the scale (and zero) to fp16 can add
        assert np.all(np.abs(y - x) <= half_step + fp16 + 1e-6), spec
        assert np.mean(np.abs(y - x)) < np.mean(half_step), spec  # and most values sit well inside


def test_store_codes_match_the_plane_store():
    f = rf.parse("kstorev16")
    k, v = kv((2, 150, D), seed=4)
    dk, _ = round_trip(f, k, v)
    store = jax.jit(lambda k: S.dequantize(S.build_store(k, capacity=192)))(k)
    np.testing.assert_array_equal(np.asarray(dk), np.asarray(store))


@pytest.mark.parametrize("spec", ("bf16", "k8av8a", "k4c16av4g32a"))
def test_gather_and_decode_rows(spec):
    """What a row fetch reads (rows and their blocks' scales) decodes to the same values as the whole cache."""
    f = rf.parse(spec)
    k, v = kv((2, 130, D), seed=5)
    rows = encoder(f)(k, v)
    tokens = jnp.array([[0, 17, 64, 129], [5, 5, 127, 80]])
    dk, dv = jax.jit(f.decode)(rows)
    gk, gv = jax.jit(lambda r, t: f.decode_rows(*f.gather(r, t)))(rows, tokens)
    np.testing.assert_array_equal(np.asarray(gk), np.take_along_axis(np.asarray(dk), np.asarray(tokens)[..., None], 1))
    np.testing.assert_array_equal(np.asarray(gv), np.take_along_axis(np.asarray(dv), np.asarray(tokens)[..., None], 1))


def test_bad_input():
    f = rf.parse("k8c64v8")
    k, v = kv((2, 10, D))
    with pytest.raises(ValueError, match="both be"):
        f.encode(k, v[:, :5])
    with pytest.raises(ValueError, match="both be"):
        f.encode(k[0, 0], v[0, 0])
    with pytest.raises(TypeError, match="floating point"):
        f.encode(k.astype(np.int32), v)
    with pytest.raises(ValueError, match="capacity=64 is smaller"):
        f.encode(np.zeros((70, D), np.float32), np.zeros((70, D), np.float32), capacity=64)
    with pytest.raises(ValueError, match=r"length must lie in \[0, 10\]"):
        f.encode(k, v, length=11)
    with pytest.raises(ValueError, match="not a multiple of the group"):
        rf.parse("k8g32v8").encode(np.zeros((4, 48), np.float32), np.zeros((4, 48), np.float32))
    bad = k.copy()
    bad[1, 3, 5] = np.nan
    with pytest.raises(ValueError, match="keys contains 1 NaN"):
        f.encode(bad, v)
    with pytest.raises(ValueError, match="values has"):
        f.encode(k, v * 1e5)
    rows = f.encode(k, v)
    with pytest.raises(ValueError, match="past capacity"):
        f.append(rows, np.zeros((2, 60, D), np.float32), np.zeros((2, 60, D), np.float32))
    with pytest.raises(ValueError, match=r"\[\*batch, m, Dh\]"):
        f.append(rows, np.zeros((2, 1, 32), np.float32), np.zeros((2, 1, 32), np.float32))
    with pytest.raises(ValueError, match="block scales"):
        f.decode_rows(rows.data)
    with pytest.raises(ValueError, match="do not match row format"):
        rf.parse("k8v8").decode_rows(jnp.zeros((3, 7), jnp.uint8))
    # Under jit a bad value is reported at run time.
    with pytest.raises(Exception, match="keys contains"):
        jax.jit(lambda a, b: f.encode(a, b).data)(bad, v).block_until_ready()


def test_extreme_values():
    """Values up to the fp16 limit (and exact zeros) keep finite scales and the error bound."""
    f = rf.parse("k4c16av4g32a")
    k, v = kv((1, 64, D), seed=6)
    k, v = k * 6e4 / np.abs(k).max(), v * 6e4 / np.abs(v).max()
    k[:, :16] = 0.0  # an all-zero K block: scale 0, values 0
    dk, dv = (np.asarray(x[:, :64]) for x in round_trip(f, k, v))
    assert np.all(np.isfinite(dk)) and np.all(np.isfinite(dv)) and not np.any(dk[:, :16])
    assert np.max(np.abs(dk - k)) <= 1.2e5 / 15 / 2 * 1.01 and np.max(np.abs(dv - v)) <= 1.2e5 / 15 / 2 * 1.01
