"""The downstream protocol: the dense branch against transformers, branching from one prefill, statistics,
and both sweeps end to end through the CLI on a tiny model with SmolLM2's tokenizer."""

import json

import numpy as np
import pytest

from fathom_jax import cli
from fathom_jax import methods as M
from fathom_jax.eval import downstream as ds
from fathom_jax.eval import downstream_report
from fathom_jax.eval.agreement import step_agreement
from fathom_jax.eval.downstream import mean_se
from tests.eval.conftest import serve


def test_dense_branch_reproduces_transformers_greedy_tokens(smollm2, smollm2_ref):
    """Three prompts of different lengths in one right-padded batch: the dense branch (prefill, then the
    sparse path's dense attention over every cached token) decodes transformers' greedy tokens."""
    model, tokenizer, _ = smollm2
    prompts = [list(smollm2_ref["tokens"])] + [list(smollm2_ref[f"extra_tokens_{i}"]) for i in range(2)]
    for text, ids in zip([smollm2_ref["prompt"], *smollm2_ref["extra_prompts"]], prompts):
        assert tokenizer.encode(text) == [int(t) for t in ids]
    want = np.stack([smollm2_ref["greedy"]] + [smollm2_ref[f"extra_greedy_{i}"] for i in range(2)])
    assert len({len(p) for p in prompts}) == 3
    prefill = ds.dense_prefill(model, prompts, capacity=192)
    dense = ds.decode_branch(model, prefill, ds.Branch(M.Dense(), None), want.shape[1])
    np.testing.assert_array_equal(dense, want)


def test_branches_parse_and_statistics():
    methods = ds.parse_methods(["dense", "exact", "fathom:48", "sparq:16"])
    keys = [b.key for b in ds.branches(methods, (64, 128))]
    assert keys == ["dense", "exact@64", "exact@128", "fathom:48@64", "fathom:48@128", "sparq:16@64", "sparq:16@128"]
    # Compressed rows: every scan in each format, the oracle on the model's rows too (the reference)
    by_rows = ds.branches(methods, (64,), rows=("k8v8",))
    assert [b.key for b in by_rows] == ["dense", "exact@64", "exact@64+k8v8", "fathom:48@64+k8v8", "sparq:16@64+k8v8"]
    assert by_rows[3].name == "Fathom 48 (k8v8 rows), k=64"
    assert [b.key for b in ds.branches(methods[2:], (64,), rows=("model", "k8v8"))] == [
        "fathom:48@64", "fathom:48@64+k8v8", "sparq:16@64", "sparq:16@64+k8v8"]
    attn = ds.attention_for(by_rows[3], 512, "session")
    assert attn.rows.spec == "k8v8" and ds.attention_for(by_rows[1], 512, None).rows is None
    with pytest.raises(ValueError, match="listed twice"):
        ds.parse_methods(["sparq:16", "sparq:16"])
    with pytest.raises(ValueError):
        ds.parse_methods(["fathom:x"])
    assert ds.forced_tokens(128) == (4, 32) and ds.forced_tokens(64) == (4, 16) and ds.forced_tokens(20) == (2, 5)
    mean, se = ds.mean_se([1.0, 0.0, 1.0, 0.0])
    assert mean == 0.5 and se == pytest.approx(np.std([1, 0, 1, 0], ddof=1) / 2)
    p = ds.paired([1.0, 0.5, 0.2], [0.5, 0.5, 0.4])
    assert (p["wins"], p["ties"], p["losses"], p["n"]) == (1, 1, 1, 3) and p["mean"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="paired"):
        ds.paired([1.0], [1.0, 2.0])


# ----------------------------------------------------------------------------------------------
# The CLI: argument errors before any work, and a tiny end-to-end run of each sweep


@pytest.fixture
def tiny_gemma3(monkeypatch, smollm2_tokenizer):
    """The hub's model is a random 3-layer Gemma 3 (two 128-token window layers, then a global one; D = 128) with
    SmolLM2's tokenizer asking for BOS, as Gemma's does."""
    import dataclasses

    from flax import nnx

    from fathom_jax.models.gemma3 import Gemma3ForCausalLM
    from fathom_jax.models.gemma3.config import Gemma3Config
    config = Gemma3Config(vocab=49152, hidden=64, intermediate=96, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=128,
                          sliding_window=128, sliding_window_pattern=3, query_pre_attn_scalar=128.0)
    model = Gemma3ForCausalLM(config, rngs=nnx.Rngs(0))
    tokenizer = dataclasses.replace(smollm2_tokenizer, add_bos=True, bos_id=1)
    serve(monkeypatch, model, tokenizer, config)
    return model, tokenizer


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, message", [
    (["ruler", "--tasks", "niah_single", "haystack"], "unknown RULER task(s) ['haystack']"),
    (["ruler", "--context", "1024", "--k", "2048"], "k=2048 must lie in [1, context = 1024]"),
    (["ruler", "--context", "16384"], "context 16384 is longer than the model can hold (8192 positions)"),
    (["ruler", "--context", "1000"], "context must be a multiple of 64"),
    (["ruler", "--methods", "dense", "fathom:48"], "must include exact"),
    (["ruler", "--methods", "exact", "fathom:999"], "Fathom 999: budget must lie in [0, 256]"),
    (["agreement", "--baseline", "loki:8"], "the baseline 'loki:8' is not among the methods"),
    (["agreement", "--k-fraction", "1.5"], "argument --k-fraction: expected a fraction of the context in (0, 1]"),
    (["agreement", "--sessions", "1"], "expected an integer >= 2"),
    (["agreement", "--steps", "4000", "--context", "4096"], "steps must lie in [1, context / 2]"),
    (["agreement", "--rows", "k8c64v8"], "K scales per block of tokens"),
    (["ruler", "--rows", "k9v9"], "k9v9"),
    (["ruler", "--rows", "K8V8"], "write 'K8V8' as 'k8v8'"),
    (["agreement", "--methods", "dense", "exact", "fathom:48@share=0,40@budget=512"], "layer 40 is out of range"),
])
def test_bad_arguments_are_one_line_and_exit_2_before_the_model_loads(capsys, monkeypatch, argv, message):
    from fathom_jax.models import hub
    from tests.support import SMOL

    def work(*a, **kw):
        raise AssertionError("the command loaded the model before checking its arguments")

    monkeypatch.setattr(hub, "model_config", lambda source=None: SMOL)  # its metadata only
    monkeypatch.setattr(hub, "load_model", work)
    code, out, err = run(capsys, *argv)
    assert code == 2 and err.startswith(f"fathom {argv[0]}: error: ") and message in err, err
    assert err.count("\n") == 1  # and nothing done but saying that the metadata is read (it takes seconds)
    assert all(line.startswith(f"[{argv[0]}] reading ") for line in out.splitlines()), out


def test_ruler_end_to_end_on_a_tiny_model(capsys, tmp_path, tiny_smollm2):
    methods = ["dense", "exact", "fathom:24", "sparq:8"]
    code, out, err = run(capsys, "ruler", "--context", "512", "--k", "48", "--tasks", "niah_single", "fwe",
                         "--per-task", "1", "--methods", *methods, "--calib-tokens", "256", "--out", str(tmp_path))
    assert code == 0, err
    # what it does before the first decode is said as it starts (it printed nothing for 34-36 s on 2 CPU cores)
    said = [line.split(" ", 2)[1] for line in out.splitlines() if line.startswith("[ruler] ")]
    assert said[:4] == ["reading", "loading", "capturing", "measuring"], out
    prefix = tmp_path / "ruler_smollm2_512"
    res = json.loads((prefix.with_suffix(".json")).read_text())
    assert [b["key"] for b in res["branches"]] == ["dense", "exact@48", "fathom:24@48", "sparq:8@48"]
    assert [s["task"] for s in res["samples"]] == ["niah_single", "fwe"]
    for b in res["branches"]:
        assert len(b["scores"]) == 2 and all(0 <= s <= 1 for s in b["scores"]) and len(b["generations"]) == 2
    bits = {b["spec"]: b["bits"] for b in res["branches"]}
    assert bits["sparq:8"] == 8 * 4 + 8 * 16 / 64 and 24 < bits["fathom:24"] <= 24 + 64 * 16 / 64
    # The report is rebuilt from the JSON alone, and printed.
    assert downstream_report.render_markdown(res) == prefix.with_suffix(".md").read_text()
    assert "| Fathom 24 |" in out and prefix.with_suffix(".png").stat().st_size > 1000
    # Dense attention and the oracle alone (what a model solves, before ranking scans): a report without scans
    res["branches"] = [b for b in res["branches"] if b["kind"] in ("dense", "exact")]
    assert "range of the per-token scans" not in downstream_report.render_markdown(res)


SHARED = "fathom:24@share=0@budget=128"


def test_agreement_end_to_end_on_a_tiny_model(capsys, tmp_path, tiny_smollm2):
    """The scans decode with k8v8 rows (--rows), compared with the exact step on the model's rows; the oracle
    decodes in both, and Fathom is paired with SparQ in the same rows; a selection shared across layers decodes as a
    branch of its own."""
    code, out, err = run(capsys, "agreement", "--context", "512", "--sessions", "2", "--steps", "8",
                         "--k-fraction", "0.125", "--methods", "dense", "exact", "fathom:24", "sparq:16",
                         SHARED, "--rows", "k8v8", "--calib-tokens", "256", "--out", str(tmp_path), "--quiet")
    assert code == 0, err
    res = json.loads((tmp_path / "agreement_smollm2_512.json").read_text())
    by_key = {b["key"]: b for b in res["branches"]}
    assert set(by_key) == {"dense", "exact@64", "exact@64+k8v8", "fathom:24@64+k8v8", "sparq:16@64+k8v8",
                           f"{SHARED}@64+k8v8"}
    # a selection shared across layers reads its scan at the selection layer only
    assert 0 < by_key[f"{SHARED}@64+k8v8"]["bits"] < by_key["fathom:24@64+k8v8"]["bits"]
    assert res["meta"]["ks"] == [64] and res["meta"]["config"]["rows"] == ["k8v8"]
    assert by_key["exact@64"]["agreement"]["64"] == [1.0, 1.0]  # the oracle agrees with itself
    assert by_key["fathom:24@64+k8v8"]["rows"] == "k8v8" and by_key["exact@64"]["rows"] is None
    for b in res["branches"]:
        assert len(b["agreement"]["64"]) == 2 and len(b["real"]) == 2
    report = downstream_report.render_markdown(res)
    assert report == (tmp_path / "agreement_smollm2_512.md").read_text()
    assert "| exact top-k oracle (k8v8 rows), k=64 |" in report and "- K/V rows: the model dtype, k8v8" in report
    assert "Fathom 24 (k8v8 rows)" in out and "vs SparQ r=16 (k8v8 rows)" in out
    # every step is also compared with the dense step, session by session, from the generations in the file
    summary = downstream_report.agreement_summary(res)
    with_dense = [step_agreement(step, ref) for step, ref in zip(by_key[f"{SHARED}@64+k8v8"]["generations"],
                                                                 by_key["dense"]["generations"])]
    assert summary[f"{SHARED}@64+k8v8"]["vs_dense"] == mean_se(with_dense)
    assert summary["dense"]["vs_dense"] == (1.0, 0.0) and "dense_vs_baseline" not in summary["dense"]
    assert summary["sparq:16@64+k8v8"]["dense_vs_baseline"]["mean"] == 0.0
    assert "## Agreement with the dense step" in report


def test_gemma3_sweep_decodes_from_its_windows_and_global_cache(capsys, tmp_path, tiny_gemma3):
    """--model gemma3-270m: prompts that start with BOS, the dense prefill's windows beside the global layer's K/V;
    the dense branch decodes what models.generate decodes from the same prompts; results named for the model."""
    from fathom_jax import models
    from fathom_jax.eval import ruler, texts

    model, tokenizer = tiny_gemma3
    code, out, err = run(capsys, "ruler", "--model", "gemma3-270m", "--context", "512", "--k", "64", "--tasks",
                         "niah_single", "--per-task", "2", "--methods", "dense", "exact", "fathom:48", "sparq:16",
                         "--calib-tokens", "256", "--out", str(tmp_path), "--quiet")
    assert code == 0, err
    res = json.loads((tmp_path / "ruler_gemma3_512.json").read_text())
    assert res["meta"]["model"].startswith("Gemma 3 270M") and res["meta"]["bos"] and res["meta"]["head_dim"] == 128
    samples = ruler.make_samples(tokenizer, ("niah_single",), 2, 512 - 64 - 1, 0, sentences=texts.prose_sentences()[0])
    prompts = np.array([[1, *s.prompt] for s in samples], np.int32)
    want = np.asarray(models.generate(model, prompts, ruler.max_gen_tokens(("niah_single",)), capacity=512))
    dense = next(b for b in res["branches"] if b["key"] == "dense")
    assert dense["generations"] == [tokenizer.decode(t[: s.gen_tokens].tolist()) for t, s in zip(want, samples)]
    assert ds.default_methods(128)[2:5] == ("fathom:48", "fathom:64", "fathom:96")
    assert ds.default_methods(64) == ds.DEFAULT_METHODS == (
        "dense", "exact", "fathom:24", "fathom:32", "fathom:48", "sparq:8", "sparq:16", "double_sparsity:16", "loki:16",
        "thumbnail:2", "landmark")
