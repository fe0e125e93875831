"""scripts/offload_inputs.py: the offload benchmark's synthetic keys and query drift against what real decodes measured
(results/plane_shares.md, results/row_reuse_*), and the two input sets side by side in one CPU run."""

import dataclasses

import numpy as np
import pytest

from fathom_jax.methods import Fathom
from fathom_jax.placement.plane_reads import plane_reads
from scripts import bench_offload, offload_inputs, offload_setup
from tests.support import bench_offload_rows, offload_file

# Fathom 32 / 48 / 64's plane-0 share of the code bits: SmolLM2's real keys at 8k (session statistics, the paper's
# budgets scaled to D = 64) and the benchmark's keys before issue 45 (results/plane_shares.md).
SMOLLM2_8K = (0.667, 0.646, 0.626)
TODAY = (0.845, 0.806, 0.771)


def plane0_shares(keys, layers=6, draws=16):
    """Plane-0 shares at Qwen3-8B's group shapes (8 KV heads x G = 4, D = 128) on fewer layers, Gaussian queries."""
    cfg = dataclasses.replace(bench_offload.QWEN3_8B, n_layers=layers)
    calib, _ = offload_setup.synthetic_calibration(cfg, keys=keys)
    q = np.random.default_rng(3).standard_normal((layers, draws, cfg.n_kv_heads, cfg.group_size, cfg.head_dim))
    return [float(plane_reads(Fathom(b), q.astype(np.float32), calib).overall_code_share[0]) for b in (32, 48, 64)]


def test_today_keys_are_the_draws_of_every_earlier_run():
    cfg = bench_offload.QWEN3_8B
    _, scale = offload_setup.synthetic_calibration(cfg)
    rng = np.random.default_rng(0)
    earlier = np.exp(0.5 * 1.25 * rng.standard_normal((cfg.n_layers, cfg.n_kv_heads, cfg.head_dim))).astype(np.float32)
    np.testing.assert_array_equal(scale, earlier)


def test_honest_keys_read_their_bits_from_the_planes_real_keys_do():
    """Measured here (6 layers, 16 draws): honest 0.673 / 0.645 / 0.620, today's 0.843 / 0.802 / 0.767."""
    honest, today = plane0_shares(offload_inputs.HONEST_KEYS), plane0_shares(offload_inputs.TODAY_KEYS)
    np.testing.assert_allclose(honest, SMOLLM2_8K, atol=0.012)
    np.testing.assert_allclose(today, TODAY, atol=0.012)


def test_outlier_channels_are_scaled_and_counted_per_group():
    keys = offload_inputs.KeyModel("x", 0.0, outlier_channels=3, outlier_scale=8.0)
    scale = keys.draw(np.random.default_rng(0), (5, 2), 16)
    assert scale.shape == (5, 2, 16) and scale.dtype == np.float32
    assert ((scale == 8.0).sum(-1) == 3).all() and ((scale == 1.0).sum(-1) == 13).all()


def test_reselected_share_follows_the_drift():
    """Repeated queries reselect every row; fresh ones few; a drift in between, more as it nears 1."""
    scale = offload_setup.synthetic_calibration(bench_offload.QWEN3_8B, keys=offload_inputs.HONEST_KEYS)[1][:2, 0]
    share = {rho: offload_inputs.reselected_share(scale, rho, tokens=8192, k=128, group_size=4, steps=3)
             for rho in (None, 0.8, 0.97, 1.0)}
    assert share[1.0] == 1.0
    assert share[None] < share[0.8] < share[0.97] < 1.0 and share[None] < 0.3


def test_inputs_parse_and_name_their_errors():
    assert [i.name for i in offload_inputs.parse_inputs("today, honest")] == ["today", "honest"]
    for bad in ("", "real", "today,today"):
        with pytest.raises(ValueError, match="--inputs"):
            offload_inputs.parse_inputs(bad)


def test_inputs_run_side_by_side_on_cpu(tmp_path, monkeypatch):
    """``--inputs today,honest``: one set of attention-only rows and one HBM control each, over caches of their own
    (tiny shapes, XLA kernels); honest rows read less of their bits from plane 0 and drift their queries; the report's
    table puts each beside today's and its control."""
    res, _ = bench_offload_rows(tmp_path, monkeypatch, "inputs", "--sections", "attn,control", "--inputs",
                                "today,honest", "--resident-planes", "1")
    got = {(r["memory"], r["inputs"]): r for r in res["rows"]}
    assert set(got) == {(m, i) for m in ("pinned_host", "device") for i in ("today", "honest")}
    for memory in ("pinned_host", "device"):
        today, honest = got[memory, "today"], got[memory, "honest"]
        assert today["query_drift"] is None and honest["query_drift"] == offload_inputs.HONEST_DRIFT
        assert honest["plane0_share"] < today["plane0_share"] - 0.05
    report = offload_file(tmp_path, "inputs", "md").read_text()
    table = report.split("## Today's inputs against honest ones")[1].split("\n## ")[0]
    lines = [line for line in table.splitlines() if line.startswith("| Fathom 48")]
    assert [line.split(" | ")[4] for line in lines] == ["today", "honest"]
    control = [f"{got['device', i]['median_ms']:.2f} (128)" for i in ("today", "honest")]
    assert all(c in line for c, line in zip(control, lines)) and lines[1].endswith("x |")
