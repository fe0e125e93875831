"""Top-k selection (4 sink + 32 local + top-(k-36)): the same set as the lax.top_k reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_test_base import IMPLS, KernelTestBase, assert_ran
from oracles import select as np_select
from pallas_kernels import topk as TK
from tests.support import lower_triton_text


CONFIGS = {"radix": TK.TopkConfig(path="radix"), "fused": TK.TopkConfig(), "fused_wide": TK.TopkConfig(max_buckets=32),
           "split_4_4": TK.TopkConfig(bucket_splits=4, token_splits=4),
           "split_8_2": TK.TopkConfig(bucket_splits=8, token_splits=2),
           "split_wide": TK.TopkConfig(max_buckets=32, bucket_splits=2, token_splits=8)}
# fused_wide: buckets of 64 / 128 tokens, the fused path's layout for rows past 1M tokens (n = 2^20 + 64);
# split_*: a row's bucket and token selections over several programs, then merged
SHAPES = {"3000-100": (3000, 100, [3000, 1000, 50, 37, 0, 136]), "777-64": (777, 64, [777, 700, 20, 64, 65, 100]),
          "4096-512": (4096, 512, [4096, 4000, 511, 513, 36, 1])}
# Every path at every shape natively; interpreted on the CPU (seconds of compiling each) every path and every shape
# at least once, the radix and fused paths at every shape; the reference (which has no paths) at every shape.
INTERPRETED = {("radix", "3000-100"), ("radix", "777-64"), ("radix", "4096-512"), ("fused", "3000-100"),
               ("fused", "777-64"), ("fused", "4096-512"), ("fused_wide", "4096-512"), ("split_4_4", "3000-100"),
               ("split_8_2", "777-64"), ("split_wide", "4096-512")}


def _oracle_cases():
    xla, interpret, gpu = (p.values[0] for p in IMPLS)
    cases = [pytest.param(xla, "fused", shape, id=f"xla-{shape}") for shape in SHAPES]
    cases += [pytest.param(interpret, path, shape, id=f"interpret-{shape}-{path}") for path in CONFIGS
              for shape in SHAPES if (path, shape) in INTERPRETED]
    return cases + [pytest.param(gpu, path, shape, id=f"gpu-{shape}-{path}", marks=IMPLS[2].marks)
                    for path in CONFIGS for shape in SHAPES]


class TestTopk(KernelTestBase):
    @pytest.mark.parametrize("impl,path,shape", _oracle_cases())
    def test_same_set_as_numpy_oracle(self, impl, rng, path, shape):
        n, k, lengths = SHAPES[shape]
        scores = jnp.asarray(rng.standard_normal((len(lengths), n)), jnp.float32)  # ties have probability ~0
        length = jnp.asarray(lengths, jnp.int32)
        config = CONFIGS[path]
        got = np.asarray(TK.topk_select(scores, length, k=k, config=config, **impl.kw))
        assert got.shape == (len(lengths), k)
        for r, ln in enumerate(lengths):
            row = got[r]
            assert set(row.tolist()) - {-1} == np_select(np.asarray(scores[r]), ln, k)
            assert np.all(np.diff(row[row >= 0]) > 0) and np.all(row[min(k, ln):] == -1)
        assert np.array_equal(np.asarray(TK.topk_select(scores, length, k=k, config=config, **impl.kw)), got)
        if path != "radix":
            assert_ran(TK.topk_select, scores, length, name="topk_select_tokens", impl=impl, k=k, config=config)

    @pytest.mark.parametrize("path", ["fused", "split_4_4"])
    def test_fused_ties(self, impl, rng, path):
        """Heavily tied integer scores: k distinct valid positions incl. sinks/local, the same score multiset."""
        scores = jnp.asarray(rng.integers(0, 5, (3, 2000)), jnp.float32)
        lengths = [2000, 1500, 700]
        got = np.asarray(TK.topk_select(scores, jnp.asarray(lengths, jnp.int32), k=100, config=CONFIGS[path],
                                        **impl.kw))
        want = np.asarray(TK.topk_select_reference(scores, jnp.asarray(lengths, jnp.int32), k=100))
        for r, ln in enumerate(lengths):
            row = got[r]
            assert np.all(np.diff(row) > 0) and row.min() >= 0 and row.max() < ln
            # same multiset of selected scores as lax.top_k (ties may pick other positions)
            assert sorted(np.asarray(scores[r])[row].tolist()) == sorted(np.asarray(scores[r])[want[r]].tolist())

    @pytest.mark.parametrize("path", ["fused", "split_4_4", "radix"])
    def test_higher_bucket_behind_tied_buckets(self, impl, path):
        """Bucket maxima tied at the k'-th largest before a higher one: the higher bucket's token is selected (the
        first k' buckets >= tau in index order had left it out), exactly lax.top_k's set."""
        scores = np.full((2, 4096), -1.0, np.float32)
        scores[:, 40] = scores[:, 70] = 5.0
        scores[:, 100] = 9.0
        scores[1, 2000] = 9.0
        got = np.asarray(TK.topk_select(jnp.asarray(scores), jnp.asarray([4096, 4096], jnp.int32), k=38,
                                        config=CONFIGS[path], **impl.kw))
        middle = [sorted(set(row.tolist()) - set(range(4)) - set(range(4064, 4096))) for row in got]
        assert middle == [[40, 100], [100, 2000]]

    def test_kth_largest_exact(self, impl, rng):
        if not impl.is_kernel:
            pytest.skip("kth_largest is a kernel of the radix path; the reference uses lax.top_k")
        x = jnp.asarray(rng.standard_normal((5, 999)) * 10, jnp.float32)
        keys = TK.sortable_key(x)
        for k in (1, 7, 500, 999, 1000):
            got = TK.kth_largest(keys, k=k, tile=128, interpret=impl.interpret)
            srt = -np.sort(-np.asarray(keys), axis=-1)
            want = srt[:, k - 1] if k <= 999 else np.full(5, TK.INT_MIN)
            assert np.array_equal(np.asarray(got), want)
        assert_ran(TK.topk_select, x, jnp.full((5,), 999, jnp.int32), name=TK.KERNEL_NAME, impl=impl, k=100,
                   config=TK.TopkConfig(path="radix"))


def test_sortable_key_order():
    x = jnp.asarray([-jnp.inf, -3.5, -0.0, 0.0, 1e-30, 2.0, jnp.inf], jnp.float32)
    k = np.asarray(TK.sortable_key(x))
    assert np.all(np.diff(k) >= 0)


def test_topk_lowers_to_triton_and_validates():
    text = lower_triton_text(TK.topk_select, jnp.zeros((4, 4096)), jnp.zeros((4,), jnp.int32), k=64, interpret=False,
                             implementation="triton", config=TK.TopkConfig(path="radix"))
    assert text.count(f'name = "{TK.KERNEL_NAME}"') == 2
    for n in (1 << 20, (1 << 20) + 64):  # 1M tokens, and 1M plus a decode step's room: fused, never radix
        text = lower_triton_text(TK.topk_select, jnp.zeros((4, n)), jnp.zeros((4,), jnp.int32), k=512,
                                 interpret=False, implementation="triton")  # default: fused
        assert all(f'name = "{nm}"' in text for nm in ("topk_bucket_max", "topk_select_buckets", "topk_select_tokens"))
        assert f'name = "{TK.KERNEL_NAME}"' not in text
    # A 1M-token decode cache (2^20 + 64 slots) keeps 32-token buckets; rows past 2M tokens widen them.
    assert [TK.fused_bucket(n) for n in (4096, 1 << 20, (1 << 20) + 64, 1 << 21, (1 << 21) + 64)] == [32, 32, 32, 32, 64]
    assert TK.fused_bucket((1 << 20) + 64, max_buckets=32768) == 64
    with pytest.raises(ValueError, match="k > sink"):
        TK.topk_select(jnp.zeros((4, 100)), 100, k=36)
    with pytest.raises(ValueError, match="path"):
        TK.TopkConfig(path="sort")
    with pytest.raises(ValueError, match="token_splits must be a power of two"):
        TK.TopkConfig(token_splits=3)
    text = lower_triton_text(TK.topk_select, jnp.zeros((4, 1 << 20)), jnp.zeros((4,), jnp.int32), k=512,
                             interpret=False, implementation="triton",
                             config=TK.TopkConfig(bucket_splits=8, token_splits=4))
    assert all(f'name = "{nm}"' in text for nm in ("topk_local_buckets", "topk_local_tokens"))
