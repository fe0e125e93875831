"""The Mosaic GPU probe of the tensor-core plane scan: its reference, fed the product rows of a store, is the plane
scan (numpy oracle); the kernel lowers to Mosaic GPU for CUDA on CPU; on the GPU it compiles and equals its reference.
(Mosaic GPU's interpret mode at 0.11.2 rejects a wgmma whose left operand is in registers, so no CPU run.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_base import HAS_GPU, random_store_arrays
from oracles import plane_scan as np_plane_scan
from pallas_kernels import plane_scan as PS
from pallas_kernels import plane_scan_mgpu as MG

D, G = 16, 4


def test_reference_is_the_plane_scan():
    rng = np.random.default_rng(5)
    planes, scales, _ = random_store_arrays(rng, (3,), D, 256)
    length = jnp.full((3,), 256, jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, G, D)), jnp.float32)
    runs = PS.active_channels(jnp.asarray(rng.integers(0, 5, (3, D)), jnp.int32))
    words, a, w, unscale = MG.product_rows(q, planes, scales, runs.channels, runs.depths)
    got = MG.plane_product_reference(words, a, w) * unscale[:, None, None, None]  # [R, NB, 64, 16]
    got = got.reshape(3, 256, 16)[..., :G].transpose(0, 2, 1)
    want = np_plane_scan(q, planes, scales, length, runs.channels, runs.depths)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


def test_lowers_to_mosaic_gpu():
    specs = (jax.ShapeDtypeStruct((2, 3, 2, 64), jnp.uint32), jax.ShapeDtypeStruct((2, 3, 64), jnp.float16),
             jax.ShapeDtypeStruct((2, 2, 64, 16), jnp.float16))
    text = jax.export.export(jax.jit(MG.plane_product_mgpu), platforms=["cuda"])(*specs).mlir_module()
    assert "mosaic_gpu" in text and MG.KERNEL_NAME in text
    with pytest.raises(ValueError, match="K % 16 == 0"):
        MG.plane_product_mgpu(jnp.zeros((2, 3, 2, 63), jnp.uint32), jnp.zeros((2, 3, 63), jnp.float16),
                              jnp.zeros((2, 2, 63, 16), jnp.float16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_runs_on_the_gpu():
    rng = np.random.default_rng(6)
    planes, scales, _ = random_store_arrays(rng, (3,), D, 512)
    q = jnp.asarray(rng.standard_normal((3, G, D)), jnp.float32)
    runs = PS.active_channels(jnp.asarray(rng.integers(0, 5, (3, D)), jnp.int32))
    words, a, w, _ = MG.product_rows(q, planes, scales, runs.channels, runs.depths)
    got = jax.jit(MG.plane_product_mgpu)(words, a, w)
    want = MG.plane_product_reference(words, a, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))
