"""The one sparse step: every method equals the per-head reference; stacked layers, the newest-token patch,
pipelined chunks, and the pinned_host placement on the GPU (compared like with like)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import calibrate as C
from fathom_jax import index as I
from fathom_jax import methods as M
from fathom_jax.decode import (
    CacheView,
    sparse_attention_step,
)
from fathom_jax.index import parts as P
from fathom_jax.placement import Placement
from fathom_jax.scan import scan_scores
from fathom_jax.select import select_topk, sparse_attention
from tests.decode.support import (
    G,
    K,
    R,
    context,
    side_by_side,
    stacked_setting,
    step_setting,
)

METHODS = [M.Fathom(20), M.FathomKLT(20), M.SparQ(4), M.SparQUnion(3), M.DoubleSparsity(4), M.Loki(6),
           M.Thumbnail(2), M.Full4(), M.Landmark(), M.Quest(), M.Exact(), M.Dense()]


@pytest.fixture(scope="module")
def setting():
    return step_setting()


def step(method, q, index, kv, lengths, calib, ctx, **view):
    """``(out, bits)`` of the step over a view of ``index`` and the K/V rows ``kv``."""
    res = sparse_attention_step(method, q, CacheView(index=index, kv=kv, length=lengths, calib=calib, **view), ctx)
    return res.out, res.bits


def per_head_reference(method, q, keys, values, lengths, calib, k=K):
    """scan_scores -> select_topk -> each head attends over its own rows (no union, no fetch)."""
    if method.name == "dense":
        from fathom_jax.select import dense_attention

        return dense_attention(q, keys, values, lengths)
    index = I.build_index(keys, calib, method.parts, length=lengths)
    scores = scan_scores(method, q, index, calib, implementation="xla").scores
    idx, mask = select_topk(scores, lengths, k, implementation="xla")
    return sparse_attention(q, keys, values, idx, mask)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.spec)
def test_step_equals_per_head_reference(setting, method):
    keys, values, q, lengths, calib = setting
    index = I.build_index(keys, calib, method.parts - {P.KEYS}, length=lengths)
    got, bits = step(method, q, index, side_by_side(keys, values), jnp.asarray(lengths), calib, context())
    want = per_head_reference(method, q, keys, values, lengths, calib)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert bits.shape == (R,)


@pytest.mark.parametrize("implementation", ["xla", "triton"])
@pytest.mark.parametrize("method", [M.Fathom(20), M.Landmark(), M.Quest(8), M.Exact()], ids=lambda m: m.spec)
def test_stacked_layers_and_newest_token_patch(setting, method, implementation):
    """A stacked [L, R] cache read at a layer, with the newest token patched in from device memory,
    equals the step over that layer's index with the token appended."""
    keys, values, q, lengths, calib = setting
    view, kv_cache, new = stacked_setting(setting, method)
    got, _ = step(method, q, view, kv_cache, jnp.asarray(lengths), calib,
                  context(implementation, Placement("pinned_host")), layer=1, new=new)
    full = I.build_index(keys, calib, method.parts - {P.KEYS}, length=lengths)
    want, _ = step(method, q, full, side_by_side(keys, values), jnp.asarray(lengths), calib, context())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


PIPELINE = dict(pipeline=3, gather_programs=5)


@pytest.mark.parametrize("method,implementation", [
    (M.Fathom(20), "xla"), (M.Exact(), "xla"), (M.Landmark(), "xla"), (M.Quest(), "xla"),
    # the kernels' group windows, natively (interpreted on the CPU this one step cost ~30 s; each kernel's own suite
    # reads group windows interpreted)
    pytest.param(M.Fathom(20), "triton", marks=[pytest.mark.gpu, pytest.mark.skipif(
        jax.default_backend() != "gpu", reason="needs a CUDA GPU")])], ids=lambda x: getattr(x, "spec", x))
def test_groups_split_into_chunks_equal_one_chunk(setting, method, implementation):
    """With ``pipeline=3`` each group is stepped in its own chunk (its plane transfer chained to the previous chunk's;
    one after the other here), reading the stacked cache at its group offset: every output equals the one-chunk
    step's. The kernels read group windows (plane scan via the run gather, persistent programs in the pipeline, row
    fetch); landmarks, Quest's page bounds and the oracle's keys are staged by the kernels' group windows too."""
    q, lengths, calib = setting[2], jnp.asarray(setting[3]), setting[4]
    view, kv_cache, new = stacked_setting(setting, method)
    host = Placement("pinned_host")

    def run(**kw):
        ctx = context(implementation, host, **kw)
        fn = jax.jit(lambda view, kv, new: step(method, q, view, kv, lengths, calib, ctx, layer=jnp.int32(1),
                                                new=new))
        return fn(view, kv_cache, new)

    (one, bits1), (three, bits3) = run(pipeline=1), run(**PIPELINE)
    with pytest.raises(ValueError, match="pipeline=2 must divide the 3 groups"):
        run(pipeline=2)
    if implementation == "xla":
        np.testing.assert_array_equal(np.asarray(three), np.asarray(one))
    else:  # natively XLA fuses the chunks' glue by their shapes: the same selection, sums within an ulp or two
        np.testing.assert_allclose(np.asarray(three), np.asarray(one), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(bits3), np.asarray(bits1))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("read,split", [("direct", {}), ("staged", {}),
                                        ("staged", dict(pipeline=4, gather_programs=64))],
                         ids=["direct", "staged", "pipeline4"])
def test_pinned_host_step_equals_hbm_step_and_reference(read, split):
    """On a GPU the index and K/V rows live in pinned_host memory and the kernels read them there. The host
    and HBM steps read the same bf16 cache (like with like: the store is built from the bf16 keys) and agree
    exactly, also with the groups in pipelined chunks (run concurrently under the pipeline's compiler options);
    both match the per-head reference. ``staged`` is one chunk: ``pipeline="auto"`` would split these 8 groups
    into 2 chunks in host memory against the HBM step's one, and their GEMMs over 4 and 8 groups agreed bit for
    bit in one process and not in another (9e-8)."""
    rng = np.random.default_rng(3)
    r, n = 8, 4096
    keys = jnp.asarray(rng.standard_normal((r, n, 128)) * np.exp(rng.normal(size=128)), jnp.bfloat16)
    values = jnp.asarray(rng.standard_normal((r, n, 128)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((r, 4, 128)), jnp.float32)
    lengths = jnp.full((r,), n, jnp.int32)
    keys32 = keys.astype(jnp.float32)
    calib = C.calibrate_session(keys32)
    method = M.Fathom(48)
    index = I.build_index(keys32, calib, method.parts, length=lengths)
    stacked = jax.tree.map(lambda x: x[None], index)
    host = Placement("pinned_host")
    placed = host.put(stacked, stacked.bulk())  # bulk leaves (planes, scales) to pinned_host, the rest on the device
    assert placed["raw"].planes.sharding.memory_kind == "pinned_host"
    kv = side_by_side(keys, values)[None]
    kv_host = jax.device_put(kv, host.sharding(4, bulk=True))
    assert kv_host.sharding.memory_kind == "pinned_host"
    ctx = context("triton", host, k=256, groups=r, capacity=n, **({"read": read, "pipeline": 1} | split))
    got = jax.jit(lambda idx, c: step(method, q, idx, c, lengths, calib, ctx, layer=0)[0],
                  compiler_options=ctx.run.options or None)(placed, kv_host)
    hbm_ctx = context("triton", k=256, groups=r, capacity=n)
    hbm = jax.jit(lambda idx, c: step(method, q, idx, c, lengths, calib, hbm_ctx, layer=0)[0])(stacked, kv)
    if not split:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(hbm))
    else:  # GEMMs over fewer groups may sum in another order on the GPU (seen: 3e-7 with 4 chunks)
        np.testing.assert_allclose(np.asarray(got), np.asarray(hbm), rtol=1e-5, atol=1e-6)
    want = per_head_reference(method, q, keys32, values.astype(jnp.float32), lengths, calib, k=256)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=2e-3)


def _pallas_grids(fn, *args, name):
    """The grids of the ``pallas_call``s named ``name`` in the jaxpr of ``fn(*args)``."""
    from tests.support import pallas_call_eqns

    return [tuple(eqn.params["grid_mapping"].grid) for eqn in pallas_call_eqns(fn, *args, name=name)]


def test_kernel_options_reach_the_kernels_and_change_no_result(setting):
    """``StepConfig(fetch_programs=P)`` runs the row fetch as P persistent programs, ``topk=TopkConfig(...)`` splits
    the top-k's selections over several programs per row: the same step (interpreted on CPU)."""
    from pallas_kernels.topk import TopkConfig
    from tests.support import count_pallas_calls

    keys, values, q, lengths, calib = setting
    method = M.Fathom(20)
    view, kv_cache, new = stacked_setting(setting, method)

    def run(**kw):
        ctx = context("triton", Placement("pinned_host"), **kw)
        return lambda q: step(method, q, view, kv_cache, jnp.asarray(lengths), calib, ctx, layer=1, new=new)[0]

    plain = run(fetch_programs=0, topk=TopkConfig(bucket_splits=1, token_splits=1))
    tuned = run(fetch_programs=3, topk=TopkConfig(bucket_splits=2, token_splits=2))
    np.testing.assert_array_equal(np.asarray(tuned(q)), np.asarray(plain(q)))
    assert _pallas_grids(tuned, q, name="row_fetch") == [(3,)]
    assert _pallas_grids(plain, q, name="row_fetch") == [(R, G * K // 32)]  # (groups, 32-row items of the union)
    assert count_pallas_calls(tuned, q, name="topk_local_tokens") == 1
    assert count_pallas_calls(plain, q, name="topk_local_tokens") == 0


@pytest.mark.parametrize("placement", [Placement(), Placement("pinned_host")], ids=["device", "host"])
def test_scan_config_reaches_the_plane_scan(setting, placement):
    """``StepConfig(scan=PlaneScanConfig(...))`` configures the step's plane scan (in place in device memory; the staged
    buffer from host memory): another tile and lanes give the same scores, so the same step, and one plane scan."""
    from pallas_kernels.plane_scan import PlaneScanConfig
    from tests.support import count_pallas_calls

    keys, values, q, lengths, calib = setting
    method = M.Fathom(20)
    view, kv_cache, new = stacked_setting(setting, method)

    def run(**kw):
        ctx = context("triton", placement, **kw)
        return lambda q: step(method, q, view, kv_cache, jnp.asarray(lengths), calib, ctx, layer=1, new=new)[0]

    default, tuned = run(), run(scan=PlaneScanConfig(tile=256, lanes=8, num_warps=2))
    np.testing.assert_array_equal(np.asarray(tuned(q)), np.asarray(default(q)))
    assert count_pallas_calls(tuned, q, name="fathom_plane_scan") == 1
    packed = run(scan=PlaneScanConfig(math="f16x2"))  # the packed-f16 arithmetic: its own kernel, in the program
    assert count_pallas_calls(packed, q, name="fathom_plane_scan_f16x2") == 1
    assert count_pallas_calls(packed, q, name="fathom_plane_scan") == 1  # (names match as prefixes): no other scan


@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_pipelined_chunk_fetches_wait_for_the_next_chunks_scan(setting, implementation):
    """In pipelined chunks the next-to-last chunk's row fetch takes the last chunk's scan output (its scores) as an
    operand it never reads, so the GPU runs it after that scan, not beside it; the order changes no result."""
    from tests.support import pallas_call_eqns

    keys, values, q, lengths, calib = setting
    method = M.Fathom(20)
    view, kv_cache, new = stacked_setting(setting, method)

    def run(pipeline):
        ctx = context(implementation, Placement("pinned_host"), pipeline=pipeline, gather_programs=2)
        return lambda q: step(method, q, view, kv_cache, jnp.asarray(lengths), calib, ctx, layer=1, new=new)[0]

    if implementation == "triton":
        fetches = pallas_call_eqns(run(3), q, name="row_fetch")
        # operands: index, layer, K/V cache (+ the next chunk's scan output)
        assert [len(e.invars) for e in fetches] == [3, 4, 3]
        chained = fetches[1].invars[-1].aval
        assert chained.shape[:2] == (1, G) and chained.dtype == jnp.float32
        if jax.default_backend() == "cpu":  # the results: xla here (interpreted, ~20 s), both on the GPU
            return
    np.testing.assert_array_equal(np.asarray(jax.jit(run(3))(q)), np.asarray(jax.jit(run(1))(q)))


def test_dense_attention_has_its_own_path(setting):
    """A method that selects every row attends over all of them, with no scan, selection or fetch kernel."""
    from tests.support import count_pallas_calls

    keys, values, q, lengths, calib = setting
    view, kv_cache, new = stacked_setting(setting, M.Dense())
    ctx = context("triton", Placement())
    fn = lambda q: step(M.Dense(), q, view, kv_cache, jnp.asarray(lengths), calib, ctx, layer=1, new=new)[0]
    assert count_pallas_calls(fn, q, name="") == 0
    want = per_head_reference(M.Dense(), q, keys, values, lengths, calib)
    np.testing.assert_allclose(np.asarray(fn(q)), np.asarray(want), rtol=2e-5, atol=2e-5)
