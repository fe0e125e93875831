"""Attention over selected rows read by index: the library's attention over the gathered rows (the decode step's
former path), every implementation, rows of a stacked cache at a layer and group window or a fetched buffer, the new
token's row put in, heads with no slot, any split of the slots over programs."""

import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax.select import attend
from kernel_test_base import KernelTestBase, assert_ran, host
from pallas_kernels import sparse_attend as SA
from pallas_kernels.operands import StoredRows
from tests.support import lower_triton_text

G, DH = 3, 16


def gathered(kv, slots, new_row, new_position):
    """The rows a fetch returns: zero rows at -1, the new row where its slot is (plain numpy)."""
    kv, slots = np.asarray(kv, np.float32), np.asarray(slots)
    rows = np.where((slots >= 0)[..., None], np.take_along_axis(kv, np.maximum(slots, 0)[..., None], axis=1), 0)
    at_new = slots == np.asarray(new_position)[:, None]
    return np.where(at_new[..., None], np.asarray(new_row, np.float32)[:, None, :], rows)


class TestSparseAttend(KernelTestBase):
    @pytest.mark.parametrize("config", [None, SA.SparseAttendConfig(block=8, shares=1),
                                        SA.SparseAttendConfig(block=32, shares=4)], ids=["auto", "one-share", "b32s4"])
    def test_equals_attention_over_gathered_rows(self, impl, rng, config):
        kv = jnp.asarray(rng.standard_normal((3, 5, 120, 2 * DH)), jnp.bfloat16)  # [L, R, n, 2 Dh]
        q = jnp.asarray(rng.standard_normal((2, G, DH)), jnp.float32)
        slots = jnp.asarray(rng.integers(-1, 120, (2, 50)), jnp.int32)
        member = (rng.random((2, G, 50)) < 0.5) & (np.asarray(slots)[:, None, :] >= 0)
        member[1, 2] = False  # a head with no slot: zeros
        new_row = jnp.asarray(rng.standard_normal((2, 2 * DH)), jnp.bfloat16)
        new_position = slots[:, 7]
        rows = StoredRows(host(kv, impl), layer=jnp.int32(2), group_start=3)
        got = SA.sparse_attend(q, rows, slots, jnp.asarray(member), new_row=new_row, new_position=new_position,
                               config=config, **impl.kw)
        fetched = jnp.asarray(gathered(np.asarray(kv[2, 3:5]), slots, new_row, new_position))
        want = attend(q, fetched[..., :DH], fetched[..., DH:], jnp.asarray(member))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        assert np.all(np.asarray(got)[1, 2] == 0)
        assert_ran(SA.sparse_attend, q, rows, slots, jnp.asarray(member), name=SA.KERNEL_NAME, impl=impl,
                   new_row=new_row, new_position=new_position, config=config)

    def test_fetched_buffer_without_new_row(self, impl, rng):
        buffer = jnp.asarray(rng.standard_normal((4, 64, 2 * DH)), jnp.float32)  # rows [Rc, S, 2 Dh] at their slots
        q = jnp.asarray(rng.standard_normal((4, G, DH)), jnp.float32)
        index = jnp.where(jnp.asarray(rng.random((4, 64)) < 0.8), jnp.arange(64, dtype=jnp.int32), -1)
        member = jnp.asarray(rng.random((4, G, 64)) < 0.7) & (index[:, None, :] >= 0)
        got = SA.sparse_attend(q, StoredRows(buffer), index, member, **impl.kw)
        want = attend(q, buffer[..., :DH], buffer[..., DH:], member)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_sparse_attend_lowers_to_triton_and_validates():
    z = jnp.zeros
    q, kv, slots, member = z((2, G, DH)), z((3, 2, 64, 2 * DH), jnp.bfloat16), z((2, 32), jnp.int32), z((2, G, 32), bool)
    text = lower_triton_text(lambda *a: SA.sparse_attend(a[0], StoredRows(a[1], layer=jnp.int32(1)), a[2], a[3],
                                                         implementation="triton", interpret=False), q, kv, slots, member)
    assert text.count(f'name = "{SA.KERNEL_NAME}"') == 1
    with pytest.raises(ValueError, match="key and value side by side"):
        SA.sparse_attend(q, StoredRows(kv[..., :DH], layer=1), slots, member)
    with pytest.raises(ValueError, match="power of two"):
        SA.sparse_attend(z((2, G, 12)), StoredRows(z((3, 2, 64, 24)), layer=1), slots, member)
    with pytest.raises(ValueError, match="member"):
        SA.sparse_attend(q, StoredRows(kv, layer=1), slots, member[:, :2])
    with pytest.raises(ValueError, match="come together"):
        SA.sparse_attend(q, StoredRows(kv, layer=1), slots, member, new_row=z((2, 2 * DH)))
    with pytest.raises(ValueError, match="power of two"):
        SA.SparseAttendConfig(block=12)
