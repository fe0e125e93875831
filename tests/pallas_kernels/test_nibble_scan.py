"""Nibble scan (the baselines' fixed-channel read): every implementation == a numpy oracle == the plane scan at 4."""

import jax.numpy as jnp
import pytest

from kernel_test_base import KernelTestBase, assert_ran, assert_scores_close, random_store_arrays
from oracles import nibble_scan as np_nibble_scan
from pallas_kernels import nibble_scan as NS
from pallas_kernels import plane_scan as PS
from pallas_kernels.operands import RunList, StorePlanes
from tests.support import lower_triton_text

D, G = 16, 4


class TestNibbleScan(KernelTestBase):
    @pytest.mark.parametrize("r,n_cap", [(1, 192), (5, 576), (16, 64)])
    def test_matches_numpy_oracle_and_plane_read(self, impl, rng, r, n_cap):
        planes, scales, length = random_store_arrays(rng, (4,), D, n_cap)
        q = jnp.asarray(rng.standard_normal((4, G, D)), jnp.float32)
        ch = jnp.asarray(rng.integers(0, D, (4, r)), jnp.int32)
        nib = NS.pack_nibbles(planes)
        got = NS.nibble_scan(q, nib, scales, length, ch, config=NS.NibbleScanConfig(tile=128), **impl.kw)
        assert_scores_close(got, np_nibble_scan(q, nib, scales, length, ch))
        at_depth_4 = jnp.full(ch.shape, 4, jnp.int32)
        assert_scores_close(got, PS.plane_scan(q, StorePlanes(planes, scales), length, RunList(ch, at_depth_4),
                                               implementation="xla"))
        assert_ran(NS.nibble_scan, q, nib, scales, length, ch, name=NS.KERNEL_NAME, impl=impl)


def test_nibble_scan_lowers_to_triton_and_validates():
    z = jnp.zeros
    q, scales, ln, ch = z((2, G, D)), z((2, D, 10), jnp.float16), z((2,), jnp.int32), z((2, 8), jnp.int32)
    text = lower_triton_text(NS.nibble_scan, q, z((2, D, 80), jnp.uint32), scales, ln, ch, implementation="triton",
                             interpret=False)
    assert text.count(f'name = "{NS.KERNEL_NAME}"') == 1
    with pytest.raises(ValueError, match="channels"):
        NS.nibble_scan(q, z((2, D, 80), jnp.uint32), scales, ln, ch + D)
    with pytest.raises(ValueError, match="tile"):
        NS.NibbleScanConfig(tile=32)
