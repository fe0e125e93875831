"""Run gather and row fetch: exact equality with their references; pinned-host sources on the GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _common as C
from pallas_kernels import plane_scan as PS
from pallas_kernels import row_fetch as RF
from pallas_kernels import run_gather as RG
from kernel_test_base import HAS_GPU, MODES, assert_ran, assert_scores_close, fresh_rng, interpret_flag, random_store_arrays

D = 16


def _host(x):
    """On the GPU: a pinned_host copy (the real offload path). On CPU: unchanged."""
    if not HAS_GPU:
        return x
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))


def _eq(a, b):
    return np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n_cap,chunk,kind", [(320, 4, "random"), (64, 2, "zero"), (1216, 16, "four"), (640, 8, "one")])
def test_run_gather_exact(request, mode, n_cap, chunk, kind):
    rng = fresh_rng(request)
    planes, scales, _ = random_store_arrays(rng, (2, 3), D, n_cap)
    c = {"random": 7, "zero": 5, "four": D, "one": 1}[kind]
    ch = jnp.asarray(rng.integers(0, D, (2, 3, c)), jnp.int32)
    dep = {"random": jnp.asarray(rng.integers(0, 5, (2, 3, c)), jnp.int32), "zero": jnp.zeros((2, 3, c), jnp.int32),
           "four": jnp.full((2, 3, c), 4, jnp.int32), "one": jnp.asarray(rng.integers(1, 5, (2, 3, c)), jnp.int32)}[kind]
    src_p, src_s = (planes, scales) if mode == "interpret" else (_host(planes.reshape(6, D, 4, -1)), _host(scales.reshape(6, D, -1)))
    ch_, dep_ = (ch, dep) if mode == "interpret" else (ch.reshape(6, c), dep.reshape(6, c))
    got_p, got_s = RG.run_gather(src_p, src_s, ch_, dep_, chunk=chunk, interpret=interpret_flag(mode))
    want_p, want_s = RG.run_gather_reference(planes, scales, ch, dep)
    assert _eq(got_p.reshape(want_p.shape), want_p) and _eq(got_s.reshape(want_s.shape), want_s)
    assert _eq(RG.run_gather(src_p, src_s, ch_, dep_, chunk=chunk, interpret=interpret_flag(mode))[0], got_p)


@pytest.mark.parametrize("mode", MODES)
def test_gather_then_scan_equals_direct_scan(request, mode):
    """Staged planes scanned with the identity list == the plane scan of the store itself."""
    rng = fresh_rng(request)
    planes, scales, length = random_store_arrays(rng, (4,), D, 448)
    q = jnp.asarray(rng.standard_normal((4, 4, D)), jnp.float32)
    ch, dep = PS.active_channels(jnp.asarray(rng.integers(0, 5, (4, D)), jnp.int32), max_active=10)
    sp, ss = RG.run_gather(_host(planes) if mode == "gpu" else planes, _host(scales) if mode == "gpu" else scales,
                           ch, dep, interpret=interpret_flag(mode))
    q_staged = jnp.take_along_axis(q, ch[:, None, :], axis=-1)
    iota = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (4, 10))
    staged = PS.plane_scan(q_staged, sp, ss, length, iota, dep, interpret=interpret_flag(mode), assume_sorted=True)
    assert_scores_close(staged, PS.plane_scan_reference(q, planes, scales, length, ch, dep))
    assert_ran(RG.run_gather, planes, scales, ch, dep, name=RG.KERNEL_NAME, interpret=interpret_flag(mode))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n,s,rows", [(50, 37, 8), (64, 1, 4), (300, 128, 32)])
def test_row_fetch_exact(request, mode, n, s, rows):
    rng = fresh_rng(request)
    k = jnp.asarray(rng.standard_normal((2, 3, n, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 3, n, D)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-5, n + 5, (2, 3, s)), jnp.int32)  # includes padding (-ve, >= n)
    if mode == "gpu":
        kk, vv, ii = _host(k.reshape(6, n, D)), _host(v.reshape(6, n, D)), idx.reshape(6, s)
    else:
        kk, vv, ii = k, v, idx
    got = RF.row_fetch(kk, vv, ii, rows=rows, interpret=interpret_flag(mode))
    want = RF.row_fetch_reference(k, v, idx)
    for a, b in zip(got, want):
        assert _eq(a.reshape(b.shape), b)
    assert _eq(RF.row_fetch(kk, vv, ii, rows=rows, interpret=interpret_flag(mode))[0], got[0])
    assert_ran(RF.row_fetch, k, v, idx, name=RF.KERNEL_NAME, interpret=interpret_flag(mode))


def test_gathers_lower_to_triton():
    z = jnp.zeros
    text = C.lower_triton_text(RG.run_gather, z((2, D, 4, 20), jnp.uint32), z((2, D, 10), jnp.float16),
                               z((2, 5), jnp.int32), z((2, 5), jnp.int32), interpret=False)
    assert text.count(f'name = "{RG.KERNEL_NAME}"') == 1
    text = C.lower_triton_text(RF.row_fetch, z((2, 64, D), jnp.bfloat16), z((2, 64, D), jnp.bfloat16),
                               z((2, 9), jnp.int32), interpret=False)
    assert text.count(f'name = "{RF.KERNEL_NAME}"') == 1


def test_gather_validation():
    z = jnp.zeros
    with pytest.raises(ValueError, match="depths"):
        RG.run_gather(z((2, D, 4, 20), jnp.uint32), z((2, D, 10), jnp.float16), z((2, 5), jnp.int32), z((2, 5), jnp.int32) + 7)
    with pytest.raises(ValueError, match="values"):
        RF.row_fetch(z((2, 64, D), jnp.bfloat16), z((2, 64, D), jnp.float32), z((2, 9), jnp.int32))
