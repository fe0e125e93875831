"""The static fields of a sparse attention (fathom_jax.decode.spec): their checks, spec parsing, and what jax traces."""

import dataclasses

import jax
import numpy as np
import pytest

from fathom_jax import calibrate as C
from fathom_jax import decode
from fathom_jax import methods as M
from fathom_jax.decode.spec import AttentionSpec, parse_spec
from fathom_jax.models.attention import CacheShape

SHAPE = CacheShape(layers=2, batch=1, kv_heads=2, capacity=128, head_dim=16, dtype=np.float32)


@pytest.fixture(scope="module")
def calib():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((2, 2, 64, 16)).astype(np.float32)  # [L, Hkv, n, D]
    return C.calibrate(keys, rng.standard_normal((2, 4, 64, 16)).astype(np.float32))


@pytest.mark.parametrize("fields, match", [
    (dict(method="sparq:2"), "method must be a ScanMethod"),
    (dict(sink=-1), "sink must be an int >= 0"),
    (dict(local=True), "local must be an int >= 0"),
    (dict(skip_tokens=1.5), "skip_tokens must be an int >= 0"),
    (dict(k=35), "k must be an int >= sink \\+ local = 4 \\+ 32"),
    (dict(k=64.0), "k must be an int"),
    (dict(sink=0, local=0, k=0), "and >= 1"),
    (dict(step="fast"), "step must be a fathom_jax.decode.StepConfig"),
    (dict(calibration_source="file"), "calibration_source must be one of"),
    (dict(method=M.Dense(), step=decode.StepConfig(row_cache=64)), "selects every row"),
])
def test_static_fields_are_checked_naming_the_argument(fields, match):
    fields = dict(dict(method=M.SparQ(2), k=64), **fields)
    for cls in (AttentionSpec, decode.SparseAttention):
        with pytest.raises((TypeError, ValueError), match=match):
            cls(**fields)


def test_placement_and_rows_are_parsed_and_the_spec_describes_them():
    spec = AttentionSpec(M.SparQ(2), 64, placement="pinned_host", rows="k8v8")
    assert spec.placement == decode.Placement("pinned_host") and spec.rows.spec == "k8v8"
    assert spec.label == "SparQ r=2, k=64, pinned_host, rows k8v8"
    assert spec.offloaded and not spec.fused and spec.min_capacity == 64 and spec.layer_unroll == 1
    assert not spec.uses_calibration and not spec.session
    with pytest.raises(ValueError, match="k=64 is larger than the KV cache capacity 48"):
        spec.check(dataclasses.replace(SHAPE, capacity=48))


def test_a_corpus_calibrated_method_needs_statistics_and_they_are_checked_against_the_model(calib):
    with pytest.raises(ValueError, match="needs calibration statistics"):
        decode.SparseAttention(M.Fathom(16), k=64)
    AttentionSpec(M.Fathom(16), 64)  # the statistics are not the spec's
    attn = decode.SparseAttention(M.Fathom(16), 64, calib)  # the statistics stay the third positional argument
    attn.check(SHAPE)
    with pytest.raises(ValueError, match="calibration has leading axes \\(1, 2\\)"):
        decode.SparseAttention(M.Fathom(16), 64, calib[:1]).check(SHAPE)
    with pytest.raises(TypeError, match="calibration must be a Calibration"):
        decode.SparseAttention(M.Fathom(16), 64, calibration=np.zeros(3)).check(SHAPE)


def test_from_spec_parses_the_spec_and_its_calibration(calib):
    session = decode.from_spec("fathom_klt:48", k=128)
    assert session.calibration_source == "session" and session.calibration is None and session.session
    corpus = decode.from_spec("fathom:48", k=128, calibration=calib, placement="pinned_host", step=None, sink=2)
    assert corpus.calibration is calib and corpus.calibration_source == "corpus" and corpus.sink == 2
    assert corpus.placement.memory == "pinned_host" and corpus.step == decode.StepConfig()
    plain = decode.from_spec("sparq:4", k=64, calibration=calib)  # ignored: SparQ reads no statistics
    assert plain.calibration is None
    assert parse_spec("sparq:4", k=64) == dict(method=M.SparQ(4), k=64, placement=decode.Placement())
    with pytest.raises(ValueError, match="calibration must be 'session', a Calibration or None"):
        decode.from_spec("fathom:48", k=128, calibration="corpus")
    with pytest.raises(ValueError, match="unknown scan method .nothing."):
        decode.from_spec("nothing:3", k=64)


def test_only_the_corpus_statistics_are_traced_and_every_other_field_is_in_the_treedef(calib):
    """The static fields say so in their metadata (spec.static); a field without it would become a leaf here."""
    attn = decode.SparseAttention(M.Fathom(16), k=64, calibration=calib, placement="pinned_host", rows="k8v8")
    leaves, treedef = jax.tree.flatten(attn)
    assert len(leaves) == len(jax.tree.leaves(calib))
    assert all(a is b for a, b in zip(leaves, jax.tree.leaves(calib)))
    statics = {f.name for f in dataclasses.fields(attn) if f.metadata.get("static")}
    assert statics == {"method", "k", "calibration_source", "sink", "local", "skip_tokens", "implementation",
                       "placement", "step", "rows", "sharing", "run", "share"}
    assert {f.name for f in dataclasses.fields(attn)} - statics == {"calibration"}
    bound = attn.bind(SHAPE)
    assert jax.tree.leaves(bound) == leaves and jax.tree.structure(bound) != treedef  # the resolved step is static
    assert jax.tree.unflatten(jax.tree.structure(bound), leaves).run == bound.run
    assert jax.tree.leaves(decode.from_spec("fathom_klt:48", k=128)) == []  # session statistics live in the cache
