"""Selection shared across layers in the decode step: what a selection layer publishes is the study's set of its
scores (:func:`~fathom_jax.decode.sharing.shared_positions`), a sharing layer's attention over it is the study's
(:func:`~fathom_jax.eval.shared_selection.shared_attention`), newest token included, on the reference and the
kernels; through the model's layer scan (Llama and Gemma 3, device and host memory) with every layer selecting it is
today's step bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fathom_jax import decode
from fathom_jax.decode import CacheView
from fathom_jax import index as I
from fathom_jax import methods as M
from fathom_jax.decode import sharing
from fathom_jax.decode.selection import patch_scores
from fathom_jax.eval.shared_selection import shared_attention
from fathom_jax.index import parts as P
from fathom_jax.methods.sharing import SharedSelection
from fathom_jax.models import DenseCache
from fathom_jax.scan import scan_scores
from fathom_jax.select import dense_attention, select_topk, sparse_attention
from tests.decode.support import D, N, context, stacked_setting, step_setting
from pallas_kernels import sparse_attend
from tests.support import ON_GPU, TINY_GEMMA3, jaxpr_equations, jaxpr_pallas_calls, sparse_forced

BUDGET = 60


@pytest.fixture(scope="module")
def setting():
    return step_setting()


@pytest.mark.parametrize("ranking", ["mass", "rank"])
def test_a_selection_layer_publishes_the_studys_set(setting, ranking):
    keys, values, q, lengths, calib = setting
    method = M.Fathom(20)
    view, kv_cache, new = stacked_setting(setting, method)
    ctx = context()
    layer = CacheView(index=view, kv=kv_cache, length=jnp.asarray(lengths), calib=calib, layer=jnp.int32(1), new=new)
    read = method.read(jnp.asarray(q), view, calib, implementation="xla")
    # the scores the layer's own step writes: every stored position's, the newest block patched in
    scores = patch_scores(read.scores(ctx.run.reader.source(layer)), read, new)
    got = sharing.publish(jnp.asarray(q), layer, ctx, SharedSelection((0,), BUDGET, ranking), 1, scores)
    index = I.build_index(keys, calib, method.parts - {P.KEYS}, length=lengths)
    scores = scan_scores(method, jnp.asarray(q), index, calib, implementation="xla").scores
    want, mask = sharing.shared_positions(scores[:, None], jnp.asarray(lengths), BUDGET, scale=1 / np.sqrt(D),
                                          ranking=ranking)
    want = np.sort(np.where(np.asarray(mask), np.asarray(want), N + 1), axis=-1)
    np.testing.assert_array_equal(np.asarray(got.mask), want <= N)
    np.testing.assert_array_equal(np.asarray(got.positions), np.where(want <= N, want, -1))
    assert np.all((np.asarray(got.positions) < lengths[:, None])[np.asarray(got.mask)])  # valid positions only


@pytest.mark.parametrize("attending", ["all", "topk"])
@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_a_sharing_layer_attends_the_published_rows(setting, implementation, attending):
    """Every head attends each position of its sequence's set (``topk``: its own exact top k of them), the newest
    token's row patched in."""
    keys, values, q, lengths, calib = setting
    view, kv_cache, new = stacked_setting(setting, M.Fathom(20))
    rng = np.random.default_rng(3)
    positions = np.stack([np.sort(rng.choice(n, BUDGET, replace=False)) for n in lengths]).astype(np.int32)
    positions[:, -1] = lengths - 1  # the newest token, which only the patch holds
    mask = np.ones_like(positions, bool)
    mask[2, :10] = False  # a shorter set
    shared = sharing.SharedSet(jnp.asarray(np.where(mask, positions, -1)), jnp.asarray(mask))
    layer = CacheView(index=view, kv=kv_cache, length=jnp.asarray(lengths), calib=calib, layer=jnp.int32(1), new=new)
    ctx = context(implementation)
    got, _ = sharing.attend_shared(jnp.asarray(q), layer, ctx, shared, SharedSelection((0,), BUDGET,
                                                                                      attending=attending), kv_heads=1)
    topk = (ctx.k, jnp.asarray(lengths)) if attending == "topk" else None
    want = shared_attention(jnp.asarray(q)[:, None], jnp.asarray(keys)[:, None], jnp.asarray(values)[:, None],
                            jnp.asarray(np.maximum(positions, 0)), jnp.asarray(mask), topk=topk)[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


PROMPT = np.random.default_rng(5).integers(0, 97, (2, 40)).astype(np.int32)
TOKENS = np.random.default_rng(6).integers(0, 97, (2, 3)).astype(np.int32)
CAPACITY = 48


def test_every_layer_selecting_is_todays_step(tiny_model):
    """Naming every layer (``all``, or each index) binds no sharing at all: the same bits as the plain method."""
    plain, _, _ = sparse_forced(tiny_model, PROMPT, TOKENS, decode.from_spec("sparq:4", k=40), CAPACITY)
    for spec in ("sparq:4@share=all@budget=40", "sparq:4@share=0,1,2@budget=44"):
        attn = decode.from_spec(spec, k=40)
        got, _, bound = sparse_forced(tiny_model, PROMPT, TOKENS, attn, CAPACITY)
        assert bound.share is None and bound.sharing == attn.sharing
        np.testing.assert_array_equal(got, plain)


def test_sharing_layers_attend_the_published_set(tiny_model):
    """Layer 0 selects and publishes every valid position (budget = capacity); layers 1 and 2 attend them all: the
    decode equals a dense cache whose layer 0 attends sparq's top-k and the others everything."""
    method, k = M.SparQ(4), 40

    def mixed(q, keys, values, length, layer):
        b, hkv, g, d = q.shape
        q, keys, values = q.reshape(-1, g, d), keys.reshape(b * hkv, -1, d), values.reshape(b * hkv, -1, d)
        lengths = jnp.full(q.shape[:1], length, jnp.int32)

        def sparse():
            index = I.build_index(keys, None, method.parts - {P.KEYS}, length=lengths)
            scores = scan_scores(method, q, index, None, implementation="xla").scores
            idx, mask = select_topk(scores, lengths, k, implementation="xla")
            return sparse_attention(q, keys, values, idx, mask)

        out = jax.lax.cond(layer == 0, sparse, lambda: dense_attention(q, keys, values, lengths))
        return out.reshape(b, hkv, g, d)

    attn = decode.from_spec(f"sparq:4@share=0@budget={CAPACITY}", k=k)
    got, _, bound = sparse_forced(tiny_model, PROMPT, TOKENS, attn, CAPACITY)
    assert bound.share.selects == (True, False, False)
    want, _ = forced_logits_after(tiny_model, PROMPT, TOKENS, DenseCache(mixed), CAPACITY)
    np.testing.assert_allclose(got[1:], want, rtol=2e-4, atol=2e-4)
    plain, _, _ = sparse_forced(tiny_model, PROMPT, TOKENS, decode.from_spec("sparq:4", k=k), CAPACITY)
    assert not np.allclose(got[1:], plain[1:], atol=1e-3)  # the sharing layers attended something else


def test_topk_sharing_layers_attend_each_heads_exact_top_k(tiny_model):
    """With ``attend=topk`` and the whole context shared (budget = capacity), a sharing head attends its exact top k
    of every position: the decode equals a dense cache whose layer 0 attends sparq's top-k and the others the exact
    top-k (the oracle's)."""
    method, k = M.SparQ(4), 40

    def mixed(q, keys, values, length, layer):
        b, hkv, g, d = q.shape
        q, keys, values = q.reshape(-1, g, d), keys.reshape(b * hkv, -1, d), values.reshape(b * hkv, -1, d)
        lengths = jnp.full(q.shape[:1], length, jnp.int32)
        index = I.build_index(keys, None, method.parts - {P.KEYS}, length=lengths)
        approx = scan_scores(method, q, index, None, implementation="xla").scores[..., : keys.shape[-2]]
        exact = jnp.einsum("rgd,rnd->rgn", q, keys, precision=jax.lax.Precision.HIGHEST)
        idx, mask = select_topk(jnp.where(layer == 0, approx, exact), lengths, k, implementation="xla")
        return sparse_attention(q, keys, values, idx, mask).reshape(b, hkv, g, d)

    attn = decode.from_spec(f"sparq:4@share=0@budget={CAPACITY}@attend=topk", k=k)
    got, _, bound = sparse_forced(tiny_model, PROMPT, TOKENS, attn, CAPACITY)
    assert bound.share.selects == (True, False, False)
    want, _ = forced_logits_after(tiny_model, PROMPT, TOKENS, DenseCache(mixed), CAPACITY)
    np.testing.assert_allclose(got[1:], want, rtol=2e-4, atol=2e-4)
    every, _, _ = sparse_forced(tiny_model, PROMPT, TOKENS, decode.from_spec(
        f"sparq:4@share=0@budget={CAPACITY}", k=k), CAPACITY)
    assert not np.allclose(got[1:], every[1:], atol=1e-3)  # k of the set, not all of it


def test_a_selection_layer_publishes_from_its_own_scores(tiny_model):
    """The step's own scores serve the published set: its selection layer runs one plane scan. The decode step scans
    each run of layers of one kind apart (layer 0 selects, layers 1 and 2 share), so no conditional branches on the
    traced layer (on a GPU each would block the host on its predicate)."""
    from fathom_jax.models import generation

    attn = decode.from_spec("fathom:16@share=0@budget=44", k=40, implementation="triton")
    _, cache, attn = generation.prefill(tiny_model, PROMPT, np.full(2, PROMPT.shape[1]), attn, CAPACITY)
    _, params = nnx.split(tiny_model)
    jaxpr = generation.decode_step_program(tiny_model, cache, attn).trace(
        params, jnp.asarray(TOKENS[:, 0]), None, cache=cache).jaxpr
    equations = list(jaxpr_equations(jaxpr.jaxpr))
    assert not [e for e in equations if e.primitive.name == "cond"
                and any(jaxpr_pallas_calls(b, sparse_attend.KERNEL_NAME) for b in e.params["branches"])]
    runs = [e for e in equations if e.primitive.name == "scan"
            and jaxpr_pallas_calls(e.params["jaxpr"], sparse_attend.KERNEL_NAME)]
    assert [e.params["length"] for e in runs] == [1, 2]  # layer 0 selects; layers 1 and 2 share
    selecting, following = (e.params["jaxpr"] for e in runs)
    assert len(jaxpr_pallas_calls(following, "fathom_plane_scan")) == 0
    assert len(jaxpr_pallas_calls(selecting, "fathom_plane_scan")) == 1  # the step's own


@pytest.mark.parametrize("placement", [pytest.param("pinned_host", marks=ON_GPU, id="gpu-pinned_host"),
                                       pytest.param("device", marks=ON_GPU, id="gpu-device")])
@pytest.mark.parametrize("attending", ["", "@attend=topk"])
def test_the_kernels_decode_a_shared_selection_as_the_reference(tiny_model, placement, attending):
    """Natively, Fathom's shared selection on the kernels (layers 0 and 2 select, layer 1 attends layer 0's set: three
    runs of the layer scan), its cache in host or device memory, decodes as the reference in device memory."""
    spec = "fathom:16@share=0,2@budget=44" + attending
    want, _, _ = sparse_forced(tiny_model, PROMPT, TOKENS, decode.from_spec(spec, k=40), CAPACITY)
    got, _, bound = sparse_forced(tiny_model, PROMPT, TOKENS, decode.from_spec(
        spec, k=40, implementation="triton", placement=placement), CAPACITY)
    assert bound.layer_kinds == (True, False, True)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def forced_logits_after(model, prompt, tokens, attention, capacity):
    """Logits of each forced decode step after ``prompt`` through ``attention``."""
    from fathom_jax.models import generation

    _, state, attention = generation.prefill(model, prompt, np.full(prompt.shape[0], prompt.shape[1]), attention,
                                             capacity)
    out = []
    for t in range(tokens.shape[1]):
        _, logits, state = generation.decode_step(model, tokens[:, t], state, attention)
        out.append(np.asarray(logits))
    return np.stack(out), state


def test_sharing_is_checked_before_any_work(tiny_model):
    with pytest.raises(ValueError, match="budget=37 must be >= k=40"):
        decode.from_spec("sparq:4@share=0@budget=37", k=40)  # below k
    with pytest.raises(ValueError, match="row_cache"):
        decode.from_spec("sparq:4@share=0@budget=64", k=40, step=decode.StepConfig(row_cache=64))
    with pytest.raises(ValueError, match="exceeds the context"):
        sparse_forced(tiny_model, PROMPT, TOKENS, decode.from_spec("sparq:4@share=0@budget=64", k=40), CAPACITY)
    with pytest.raises(ValueError, match="layer 5 is out of range"):
        sparse_forced(tiny_model, PROMPT, TOKENS, decode.from_spec("sparq:4@share=0,5@budget=44", k=40), CAPACITY)
    assert "shared 0 / 44" in decode.from_spec("sparq:4@share=0@budget=44", k=40).label


def test_gemma3_shares_among_its_global_layers():
    """Gemma 3's cache holds its global layers (model layers 2 and 5): a plan names those; a local layer is refused;
    the offloaded cache on the kernels decodes as the device cache on the reference."""
    from fathom_jax.models import gemma3 as G

    model = G.Gemma3ForCausalLM(TINY_GEMMA3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layer 1 does not scan"):
        sparse_forced(model, PROMPT, TOKENS, decode.from_spec("sparq:4@share=1@budget=44", k=40), CAPACITY)
    spec = "sparq:4@share=2@budget=44"
    got, _, bound = sparse_forced(model, PROMPT, TOKENS, decode.from_spec(spec, k=40), CAPACITY)
    assert bound.share.selects == (True, False)
    offloaded, _, _ = sparse_forced(model, PROMPT, TOKENS, decode.from_spec(
        spec, k=40, implementation="triton", placement="pinned_host"), CAPACITY)
    np.testing.assert_allclose(offloaded, got, rtol=2e-4, atol=2e-4)
    # the block scan runs blocks of one global kind apart: no conditional more than the per-layer step's
    assert decode_step_conds(model, spec) == decode_step_conds(model, "sparq:4")


def decode_step_conds(model, spec: str) -> int:
    """The ``cond`` equations of ``model``'s decode step with the method ``spec`` (nested ones included)."""
    from fathom_jax.models import generation

    attn = decode.from_spec(spec, k=40)
    _, state, attn = generation.prefill(model, PROMPT, np.full(2, PROMPT.shape[1]), attn, CAPACITY)
    own, cache = model.split_state(state)
    jaxpr = generation.decode_step_program(model, cache, attn).trace(
        nnx.split(model)[1], jnp.asarray(TOKENS[:, 0]), own, cache=cache).jaxpr
    return sum(e.primitive.name == "cond" for e in jaxpr_equations(jaxpr.jaxpr))


def test_a_branch_from_a_dense_prefill_names_model_layers():
    """The studies' branches (one dense prefill, a sparse cache built from it) take a plan in model layers on Gemma 3
    (before, the cache built from the prefill numbered its layers 0-1 and refused layer 2): the same tokens as the
    rule naming it."""
    from fathom_jax.eval import downstream as D
    from fathom_jax.methods.sharing import parse_method
    from fathom_jax.models import gemma3 as G

    model = G.Gemma3ForCausalLM(TINY_GEMMA3, rngs=nnx.Rngs(0))
    prefill = D.dense_prefill(model, PROMPT.tolist(), CAPACITY)
    got, want = (D.decode_branch(model, prefill, D.Branch(parse_method(f"sparq:4@share={layers}@budget=44"), 40),
                                 steps=3, calibration=None) for layers in ("2", "first"))
    assert got.shape == (2, 3)
    np.testing.assert_array_equal(got, want)
