"""The union kernel lays a group's union out as the library's sort-based union does, bit for bit: the same slots in
the same order, duplicates and padding masked where the sort leaves them, the same membership."""

import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax.select import group_union as sorted_union
from kernel_test_base import KernelTestBase, assert_ran
from pallas_kernels import group_union as GU
from tests.support import lower_triton_text


def random_selections(rng, r, g, k, span):
    """Each head's distinct positions in random column order, some heads short (-1 padding), overlapping heads."""
    sel = np.full((r, g, k + 1), -1, np.int32)
    for i, h in np.ndindex(r, g):
        n = int(rng.integers(k // 2, k + 1)) if h else k
        sel[i, h, :n] = rng.choice(span, n, replace=False)
        rng.shuffle(sel[i, h, :k])
    return jnp.asarray(sel)


class TestGroupUnion(KernelTestBase):
    @pytest.mark.parametrize("r,g,k,span", [(2, 4, 32, 80), (3, 3, 40, 200), (1, 2, 7, 12), (2, 1, 16, 16)],
                             ids=["g4", "g3", "odd", "one-head"])
    def test_equals_the_sorted_union(self, impl, rng, r, g, k, span):
        sel = random_selections(rng, r, g, k, span)
        slots, member = GU.group_union(sel, k=k, **impl.kw)
        union, union_mask, want_member = sorted_union(jnp.maximum(sel[..., :k], 0), sel[..., :k] >= 0)
        assert np.array_equal(np.asarray(slots), np.asarray(jnp.where(union_mask, union, -1)))
        assert np.array_equal(np.asarray(member) > 0, np.asarray(want_member))
        assert_ran(GU.group_union, sel, name=GU.KERNEL_NAME, impl=impl, k=k)


def test_group_union_lowers_to_triton_and_validates():
    sel = jnp.zeros((2, 4, 33), jnp.int32)
    text = lower_triton_text(GU.group_union, sel, k=32, implementation="triton", interpret=False)
    assert text.count(f'name = "{GU.KERNEL_NAME}"') == 1
    with pytest.raises(ValueError, match="k must be an int in"):
        GU.group_union(sel, k=40)
    with pytest.raises(TypeError, match="selected"):
        GU.group_union(sel.astype(jnp.float32), k=8)
