"""scripts/plane_shares.py's rows and report: budgets named at D = 128, the quoted numbers set beside the measured."""


import numpy as np
import pytest

from fathom_jax.placement.plane_reads import PlaneReads
from scripts import plane_shares


def fake_result() -> dict:
    # D = 64: plane bits 32, 16, 8, 0 of 56 code bits; 8 scale bits
    smol = PlaneReads(np.array([[0.5, 0.25, 0.125, 0.0]] * 2), head_dim=64)
    synth = PlaneReads(np.array([[0.25, 0.125, 0.0, 0.0]]), head_dim=128)
    rows = [plane_shares.row("smollm2 4k", "session", "last 2 positions", 24, 64, smol, context=4096),
            plane_shares.row("synthetic", "drawn", "4 Gaussian draws", 48, 128, synth)]
    machine = {"date": "today", "jax": "0", "backend": "cpu", "host": "h", "cpus": 1, "commit": "abc"}
    run = {"machine": machine, "command": "scripts/plane_shares.py", "parts": ["synthetic", "smollm2 4k"],
           "wall_seconds": 1.0}
    smollm2 = {"4096": {"capture": "capture_qkv", "positions": [4094, 4095]}}
    return {"runs": [run], "smollm2": smollm2, "rows": rows}


def test_rows_name_the_d128_budget_and_report_the_shares(tmp_path):
    res = fake_result()
    assert [r["budget_at_d128"] for r in res["rows"]] == [48, 48]
    assert res["rows"][0]["code_share"] == pytest.approx([32 / 56, 16 / 56, 8 / 56, 0])
    text = plane_shares.report(res)
    assert "commit abc: `scripts/plane_shares.py` (synthetic, smollm2 4k; 1.0 s)" in text
    assert "4096 tokens: capture_qkv, decode positions 4094-4095" in text
    assert "| smollm2 4k | session | last 2 positions | 24 (= F48) | 64.00 | 57.1 | 28.6 | 14.3 | 0.0 | 85.7 |" in text
    assert "| synthetic | drawn | 4 Gaussian draws | 48 | " in text  # D = 128: no scaled name
    # the numbers beside the measured ones, for the rows that exist; HBM p=1 = (32 + 8) / 64
    assert "| smollm2 4k (last 2 positions) | session | 24 | 66.0 / 91.0 | 57.1 / 85.7 | 62.5 |" in text
    assert "| synthetic (4 Gaussian draws) | drawn | 48 | 85.0 / 99.0 | 66.7 / 100.0 |" in text
    assert "| 1 | 0.500 | 0.250 | 0.125 | 0.000 |" in text  # the per-layer frequencies of the SmolLM2 row
    plane_shares.plot(res, str(tmp_path / "shares.png"))
    assert (tmp_path / "shares.png").stat().st_size > 0


def test_bad_arguments_stop_before_any_work(capsys):
    with pytest.raises(SystemExit):
        plane_shares.main(["--contexts", "100"])
    assert "must each leave" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plane_shares.main(["--smollm2-budgets", "300"])
    assert "--smollm2-budgets" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plane_shares.main(["--chunk", "0"])
    assert "--chunk must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plane_shares.main(["--append", "--out", "/nonexistent"])
    assert "--append: no /nonexistent/plane_shares.json" in capsys.readouterr().err


def test_chunked_capture_is_the_study_capture_bit_for_bit():
    """At SmolLM2's head shapes (D = 64, 3 query heads per KV head) and chunks of 64 queries; XLA:CPU gave other
    shapes (D = 8, or chunks of 16) other roundings from the second layer on, so the equality is shape-bound."""
    from flax import nnx

    from fathom_jax.models import capture_qkv
    from fathom_jax.models.config import LlamaConfig
    from fathom_jax.models.llama import LlamaForCausalLM

    config = LlamaConfig(vocab=97, hidden=64, intermediate=96, n_layers=3, n_heads=9, n_kv_heads=3, head_dim=64,
                         rope_theta=1e4, rms_norm_eps=1e-6)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    ids = np.random.default_rng(0).integers(0, 97, size=128)
    dense = capture_qkv(model, ids)
    chunked = plane_shares.capture(model, ids, chunk=64)
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(np.asarray(getattr(chunked, name)), np.asarray(dense[name]))
