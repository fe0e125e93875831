"""The threshold selection decodes the sorted selection's bits: sampled thresholds, overflowing and starved candidate
lists (the second path, counted in the cache), offloaded caches; the step runs its kernels once a chunk and the top-k
kernels only inside the second path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fathom_jax import decode
from fathom_jax.decode import StepConfig
from fathom_jax.decode.reads import ScanOperands
from fathom_jax.decode.selection import ThresholdSelection
from fathom_jax.models import generation
from fathom_jax.placement import Placement
from pallas_kernels import candidate_topk, group_union, scan_select, sparse_attend
from pallas_kernels.topk_radix import INT_MIN
from tests.support import jaxpr_equations, jaxpr_pallas_calls

RNG = np.random.default_rng(11)
PROMPT = RNG.integers(0, 97, (2, 256)).astype(np.int32)
TOKENS = RNG.integers(0, 97, (2, 4)).astype(np.int32)
LENGTHS = np.array([256, 200])
CAPACITY = 320


def decode_run(model, attn):
    """Logits of the prefill and each forced step, and the final cache."""
    logits, cache, attn = generation.prefill(model, PROMPT, LENGTHS, attn, CAPACITY)
    out = [np.asarray(logits)]
    for t in range(TOKENS.shape[1]):
        _, logits, cache = generation.decode_step(model, TOKENS[:, t], cache, attn)
        out.append(np.asarray(logits))
    return np.stack(out), cache


def hook(step, placement=None):
    return decode.from_spec("fathom:16", k=40, implementation="triton", step=step,
                            placement=placement or Placement())


@pytest.fixture(scope="module")
def sorted_run(tiny_model):
    return decode_run(tiny_model, hook(StepConfig(selection="sorted")))


def test_threshold_selection_decodes_the_sorted_bits(tiny_model, sorted_run):
    """Thresholds from this step's sample select from their candidates: the same logits, bit for bit, and the same
    cache (but the second-path counts, which only this one keeps)."""
    want, want_cache = sorted_run
    assert want_cache.second_path is None
    got, cache = decode_run(tiny_model, hook(StepConfig(selection="threshold")))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert int(cache.second_path.sum()) == 0  # the sample's thresholds held on every step
    assert jax.tree.map(np.array_equal, cache.index, want_cache.index) == jax.tree.map(lambda _: True, cache.index)


@pytest.mark.parametrize("threshold", [2**31 - 1, INT_MIN], ids=["starved", "overflow"])
def test_second_path_decodes_the_sorted_bits(tiny_model, sorted_run, monkeypatch, threshold):
    """Thresholds that no token reaches, or that every token does (more candidates than the list holds): every step
    takes the second path, counted per layer and group, and decodes the same bits."""
    want, _ = sorted_run
    monkeypatch.setattr(ScanOperands, "sample_threshold",
                        lambda self, reader, stop, **kw: jnp.full((stop.shape[0], self.queries.shape[1]), threshold,
                                                                  jnp.int32))
    got, cache = decode_run(tiny_model, hook(StepConfig(selection="threshold", threshold=ThresholdSelection(slack=1))))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.all(np.asarray(cache.second_path) == TOKENS.shape[1])


def test_offloaded_tiers_with_threshold_selection(tiny_model):
    """Resident and warm planes (the tiered gather's staged planes, read by the scan that selects): the bits of the
    same cache selected the sorted way."""
    placement = Placement("pinned_host", resident_planes=1, warm_planes=6)
    want, _ = decode_run(tiny_model, hook(StepConfig(selection="sorted"), placement))
    got, cache = decode_run(tiny_model, hook(StepConfig(selection="threshold"), placement))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert int(cache.second_path.sum()) == 0


def test_step_kernels_once_a_chunk(tiny_model):
    """In the step's program, once per chunk of each layer: the sampled scan and its radix select, the scan that
    selects, the top-k among candidates, the union and the attention kernel; the plane scan and the top-k kernels
    only inside the second path's branch."""
    for chunks in (1, 2):
        attn = hook(StepConfig(pipeline=chunks, selection="threshold"), Placement("pinned_host"))
        _, cache, attn = generation.prefill(tiny_model, PROMPT, LENGTHS, attn, CAPACITY)
        _, params = nnx.split(tiny_model)
        jaxpr = generation.decode_step_program(tiny_model, cache, attn).trace(
            params, jnp.asarray(TOKENS[:, 0]), None, cache=cache).jaxpr
        for name in (scan_select.SAMPLE_NAME, "kth_largest", scan_select.KERNEL_NAME, candidate_topk.KERNEL_NAME,
                     group_union.KERNEL_NAME, sparse_attend.KERNEL_NAME):
            assert len(jaxpr_pallas_calls(jaxpr, name)) == chunks, (name, chunks)
        conds = [e for e in jaxpr_equations(jaxpr.jaxpr, skip=("pallas_call",)) if e.primitive.name == "cond"
                 and any(jaxpr_pallas_calls(b, group_union.KERNEL_NAME) for b in e.params["branches"])]
        assert len(conds) == chunks
        for cond in conds:
            by_candidates, by_scores = cond.params["branches"]  # lax.cond(failed, by_scores, by_candidates)
            assert jaxpr_pallas_calls(by_candidates, "topk_select_tokens") == []
            assert jaxpr_pallas_calls(by_candidates, group_union.KERNEL_NAME)
            assert jaxpr_pallas_calls(by_scores, "fathom_plane_scan")
            assert jaxpr_pallas_calls(by_scores, "topk_select_tokens")
        outside = [e for e in jaxpr_equations(jaxpr.jaxpr, skip=("cond", "pallas_call")) if e.primitive.name == "pallas_call"]
        assert not [e for e in outside if str(e.params["name"]).startswith(("fathom_plane_scan", "topk_"))]
