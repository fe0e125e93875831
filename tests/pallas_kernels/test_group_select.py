"""A group's selection and union in two kernels: per head the numpy oracle's set (ties: the first positions), every
token in one slot, the kernel equal to the reference bit for bit, and the same sets as top-k + group_union."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_base import IMPLS, KernelTestBase, assert_ran
from oracles import select as np_select
from pallas_kernels import group_select as GS
from pallas_kernels import topk as TK
from tests.support import count_pallas_calls, lower_triton_text

# (groups, heads, n, k, sink, local, lengths, tied[, options]): n off the 32-token bucket, short rows (< k, < sink +
# local), three heads (not a power of two), k - sink - local not a power of two, integer scores full of ties; small
# tiles and registers: groups of several buckets and searches over several tiles, as at 1M tokens
SHAPES = {"ties": (3, 4, 700, 48, 4, 8, [700, 30, 45], True), "odd": (2, 3, 777, 40, 4, 8, [777, 11], False),
          "one-head": (1, 1, 300, 40, 4, 32, [290], True),
          "tiles": (2, 4, 2000, 76, 4, 8, [2000, 1777], False, dict(tile=64, registers=32)),
          "tiles-ties": (1, 3, 2000, 76, 4, 8, [1990], True, dict(tile=64, registers=32))}
INTERPRETED = {"ties", "odd", "tiles-ties"}  # every shape's feature at least once (seconds of CPU each)
NATIVE = {"1m": (2, 4, (1 << 20) + 64, 512, 4, 32, [(1 << 20) + 64, 700_001], False),
          "1m-ties": (1, 4, (1 << 20) + 64, 512, 4, 32, [1 << 20], True), "128k-g8": (4, 8, 1 << 17, 256, 4, 32,
                                                                                     [1 << 17, 99_999, 5, 300], True)}


def _inputs(rng, r, g, n, lengths, tied):
    scores = rng.integers(0, 6, (r, g, n)) if tied else rng.standard_normal((r, g, n))
    return jnp.asarray(scores, jnp.float32), jnp.asarray(lengths, jnp.int32)


def _check_union(slots, member, scores, lengths, k, sink, local):
    """Per head the oracle's set; no token in two slots; head h's slot block holds only tokens it selects."""
    slots, member, scores = np.asarray(slots), np.asarray(member), np.asarray(scores)
    r, g, _ = scores.shape
    assert slots.shape == (r, g * k) and member.shape == (r, g, g * k)
    for i in range(r):
        held = slots[i][slots[i] >= 0]
        assert len(held) == len(set(held.tolist()))
        assert not member[i][:, slots[i] < 0].any()
        for h in range(g):
            assert set(slots[i][member[i, h] == 1].tolist()) == np_select(scores[i, h], lengths[i], k, sink, local)
            block = slots[i, h * k:(h + 1) * k]
            assert set(block[block >= 0].tolist()) <= set(slots[i][member[i, h] == 1].tolist())


def _cases(shapes, native):
    xla, interpret, gpu = (p.values[0] for p in IMPLS)
    cases = [pytest.param(impl, name, id=f"{impl.implementation}-{name}") for impl in (xla, interpret)
             for name in shapes if impl is xla or name in INTERPRETED]
    return cases + [pytest.param(gpu, name, id=f"gpu-{name}", marks=IMPLS[2].marks) for name in {**shapes, **native}]


class TestGroupSelect(KernelTestBase):
    @pytest.mark.parametrize("impl,shape", _cases(SHAPES, NATIVE))
    def test_oracle_sets_and_reference_bits(self, impl, rng, shape):
        r, g, n, k, sink, local, lengths, tied, *options = {**SHAPES, **NATIVE}[shape]
        options = options[0] if options else {}
        scores, length = _inputs(rng, r, g, n, lengths, tied)
        got = GS.group_select(scores, length, k=k, sink=sink, local=local, **options, **impl.kw)
        if n < 4096:  # the numpy oracle loops over positions
            _check_union(*got, scores, lengths, k, sink, local)
        want = GS.group_select_reference(scores, length, k=k, sink=sink, local=local)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        calls = count_pallas_calls(GS.group_select, scores, length, name="", k=k, sink=sink, local=local, **impl.kw)
        assert calls == (2 if impl.is_kernel else 0)  # the whole selection: bucket maxima, then one per group
        if impl.is_kernel:
            assert count_pallas_calls(GS.group_select, scores, length, name=GS.KERNEL_NAME, k=k, sink=sink,
                                      local=local, **impl.kw) == 1
        for name in (GS.KERNEL_NAME, GS.BUCKET_MAX_NAME):  # in the compiled HLO too, on the GPU
            assert_ran(GS.group_select, scores, length, name=name, impl=impl, k=k, sink=sink, local=local, **options)

    def test_same_sets_as_topk_kernels_and_group_union(self, impl, rng):
        """As sets per head: the top-k kernels' selection (the "pallas" path of select_topk) and group_union."""
        from fathom_jax.select import group_union, select_topk

        scores, length = _inputs(rng, 2, 4, 500, [500, 60], True)
        slots, member = GS.group_select(scores, length, k=48, sink=4, local=8, **impl.kw)
        topk_impl = "pallas" if impl.is_kernel else "xla"
        idx, mask = select_topk(scores, length, 48, sink=4, local=8, implementation=topk_impl)
        union, union_mask, union_member = (np.asarray(x) for x in group_union(idx, mask))
        slots, member = np.asarray(slots), np.asarray(member)
        for i in range(2):
            assert sorted(slots[i][slots[i] >= 0].tolist()) == sorted(union[i][union_mask[i]].tolist())
            for h in range(4):
                assert set(slots[i][member[i, h] == 1].tolist()) == set(union[i][union_member[i, h]].tolist())


def test_higher_bucket_behind_tied_buckets():
    """Bucket maxima tied at the k'-th largest ahead of a higher bucket (the case the top-k kernels once lost)."""
    scores = np.full((1, 2, 4096), -1.0, np.float32)
    scores[..., 40] = scores[..., 70] = 5.0
    scores[0, 0, 100] = scores[0, 1, 2000] = 9.0
    length = jnp.asarray([4096], jnp.int32)
    slots, member = GS.group_select(jnp.asarray(scores), length, k=38, sink=4, local=32, implementation="pallas")
    slots, member = np.asarray(slots), np.asarray(member)
    middle = [sorted(set(slots[0][member[0, h] == 1].tolist()) - set(range(4)) - set(range(4064, 4096)))
              for h in range(2)]
    assert middle == [[40, 100], [40, 2000]]
    assert slots[0, 38 + 4] == -1  # head 1's first middle slot: token 40, held by head 0


def test_lowers_to_triton_at_1m_and_validates():
    n = (1 << 20) + 64
    text = lower_triton_text(GS.group_select, jnp.zeros((1, 4, n)), jnp.zeros((1,), jnp.int32), k=512, sink=4,
                             local=32, interpret=False, implementation="pallas")
    assert text.count(f'name = "{GS.KERNEL_NAME}"') == 1 and text.count(f'name = "{GS.BUCKET_MAX_NAME}"') == 1
    assert TK.BUCKET == GS.BUCKET
    # groups of buckets whose maxima of every head one program holds: 16 at 1M tokens and 4 heads
    assert [GS.group_size(g, nb) for g, nb in ((4, 32770), (8, 32770), (4, 4098), (3, 100))] == [16, 32, 2, 1]
    scores = jnp.zeros((2, 4, 300))
    with pytest.raises(ValueError, match="length must be"):
        GS.group_select(scores, jnp.zeros((3,), jnp.int32), k=48, sink=4, local=8)
    with pytest.raises(ValueError, match="need k > sink"):
        GS.group_select(scores, jnp.zeros((2,), jnp.int32), k=12, sink=4, local=8)
    with pytest.raises(ValueError, match="scores must have 3 dims"):
        GS.group_select(jnp.zeros((4, 300)), jnp.zeros((4,), jnp.int32), k=48, sink=4, local=8)
