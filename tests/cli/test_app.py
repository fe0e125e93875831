"""The ``fathom`` CLI: every bad argument is one line on stderr and exit status 2, found before any model
weights are loaded or activations captured; results files record the run that wrote them."""

import json
import os
import re
import types

import pytest

from fathom_jax.cli import app as cli
from fathom_jax.cli import args as cli_args
from fathom_jax.cli import generate_command
from fathom_jax.models import hub
from fathom_jax.models.config import LlamaConfig
from tests.support import SMOL, CharTokenizer

@pytest.fixture
def no_work(monkeypatch):
    """The model's metadata and tokenizer are available; loading weights or capturing fails the test."""

    def work(*a, **k):
        raise AssertionError("the command started work before checking its arguments")

    monkeypatch.setattr(hub, "model_config", lambda source=None: SMOL)
    monkeypatch.setattr(hub, "load_tokenizer", lambda source=None: CharTokenizer())
    monkeypatch.setattr(hub, "load_model", work)
    import fathom_jax.models as models

    monkeypatch.setattr(models, "capture_qkv", work)
    monkeypatch.setattr(cli_args, "available_bytes", lambda: 64 * cli_args.GiB)


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


BAD_ARGUMENTS = [
    (["generate", "x", "--method", "bogus"], "argument --method: unknown scan method 'bogus'"),
    (["generate", "x", "--method", "fathom:-3"], "argument --method: Fathom -3: budget must be"),
    (["generate", "x", "--method", "fathom:abc"], "budget must be an integer, got 'abc'"),
    (["generate", "x", "--method", "fathom:9999"], r"argument --method: Fathom 9999: budget must lie in [0, 256]"),
    (["generate", "x", "--method", "sparq:999"], "argument --method: SparQ r=999: r must be <= D = 64"),
    (["generate", "x", "--k", "0"], "argument --k: expected an integer >= 36"),
    (["generate", "x", "--k", "-5"], "argument --k: expected an integer >= 36"),
    (["generate", "x", "--method", "fathom:32", "--k", "-5"], "argument --k: expected an integer >= 36"),
    (["generate", "x", "--max-new-tokens", "0"], "argument --max-new-tokens: expected an integer >= 1"),
    (["generate", ""], "argument prompt: the prompt is empty"),
    (["generate"], "argument prompt: the prompt is empty"),
    (["generate", "x" * 8200], "the prompt (8200 tokens) + --max-new-tokens 32 = 8232 tokens, more than the model's "
                               "8192 positions"),
    (["generate", "x", "--method", "fathom:32", "--calibration", "corpus", "--calib-tokens", "9000"],
     "--calib-tokens 9000 asks for 9000 tokens, more than the model's 8192 positions"),
    (["generate", "x", "--mesh", "0"], "argument --mesh: expected an integer >= 1"),
    # "2 cpu device(s)" here, "2 gpu device(s)" on the two-GPU machine
    (["generate", "x", "--mesh", "64"], "argument --mesh: 64 devices asked for, 2 "),
    (["generate", "x", "--coordinator", "host0", "--num-processes", "2", "--process-id", "0"],
     "argument --coordinator / --num-processes / --process-id: coordinator must be host:port"),
    (["generate", "x", "--process-id", "-1"], "argument --process-id: expected an integer >= 0"),
    (["generate", "x", "--step-config", "read=sideways"], "argument --step-config: step read must be one of"),
    (["generate", "x", "--step-config", "index_writes=never"],
     "argument --step-config: step index_writes must be one of"),
    (["generate", "x", "--step-config", "pipeline=0"],
     "argument --step-config: step pipeline must be an int >= 1 or 'auto', got 0"),
    (["generate", "x", "--step-config", "streams=2"], "argument --step-config: step config: unknown key 'streams'"),
    (["sweep", "--k", "0"], "argument --k: expected an integer >= 36"),
    (["sweep", "--k", "5000"], "argument --k: [5000] is more than the 4096 tokens of --context 4096"),
    (["sweep", "--positions", "0"], "argument --positions: expected an integer >= 1"),
    (["sweep", "--positions", "-3"], "argument --positions: expected an integer >= 1"),
    (["sweep", "--positions", "4090"], "argument --positions: 4090 decode positions leave 6 tokens"),
    (["sweep", "--context", "0"], "argument --context: expected an integer >= 1"),
    (["sweep", "--context", "10"], "argument --context: 10 tokens cannot hold the default k"),
    (["sweep", "--context", "9000"], "--context 9000 asks for 9000 tokens, more than the model's 8192 positions"),
    (["generate", "x", "--method", "fathom_tuned"],
     "argument --method: fathom_tuned reads per-(layer, KV head) budgets from a tuned calibration, which generate's "
     "session or corpus statistics are not (fathom tune"),
    (["generate", "x", "--method", "fathom_bits:55:observed"],
     "argument --method: fathom_bits:55:observed: it reads the calibration keys' plane errors (the observed error "
     "model), which generate's session or corpus statistics do not hold; drop ':observed' (fathom_bits:55)"),
    # ruler and agreement have no tuned calibration either: refused before the model loads (they failed 34-59 s later)
    (["ruler", "--methods", "dense", "exact", "fathom_tuned"],
     "argument --methods: fathom_tuned reads per-(layer, KV head) budgets from a tuned calibration, which ruler's "
     "corpus or session statistics are not"),
    (["agreement", "--methods", "dense", "exact", "sparq:16", "fathom_bits:55:observed"],
     "argument --methods: fathom_bits:55:observed: it reads the calibration keys' plane errors (the observed error "
     "model), which agreement's corpus or session statistics do not hold"),
    (["ruler", "--methods", "dense", "exact", "fathom:999"], "argument --methods: Fathom 999: budget must lie in"),
    (["agreement", "--k-fraction", "inf"], "argument --k-fraction: expected a fraction of the context in (0, 1], got "
                                           "'inf'"),
    (["agreement", "--k-fraction", "nan"], "argument --k-fraction: expected a fraction of the context in (0, 1], got "
                                           "'nan'"),
    (["agreement", "--k-fraction", "0"], "argument --k-fraction: expected a fraction of the context in (0, 1]"),
    (["agreement", "--k-fraction", "1.5"], "argument --k-fraction: expected a fraction of the context in (0, 1]"),
    (["agreement", "--k-fraction", "0.001"], "argument --k-fraction: 0.001 of --context 4096 is k = 4 tokens per query "
                                             "head, fewer than 16 (below 128 a selection keeps k/8 sinks and a k/4 "
                                             "local window); use a fraction of at least 0.004 at this context"),
    (["ruler", "--k", "4"], "argument --k: expected an integer >= 16"),
    (["tune", "--context", "100000"], "--context 100000 asks for 100000 tokens, more than the model's 8192 positions"),
    (["tune", "--context", "100000", "--allow-long-context"], "tune --context 100000 needs about"),
    (["tune", "--mean", "200"], "argument --mean: [200] outside (8, 120] bits (the tuning grid at the model's "),
    (["fetch-model", "gpt5"], "argument name: invalid choice: 'gpt5'"),
    (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
]


@pytest.mark.parametrize("argv,message", BAD_ARGUMENTS, ids=[" ".join(a)[:40] for a, _ in BAD_ARGUMENTS])
def test_bad_argument_is_one_line_and_exit_2_before_any_work(capsys, no_work, tmp_path, argv, message):
    if argv[0] in ("sweep", "tune", "ruler", "agreement"):
        argv = [*argv, "--out", str(tmp_path)]
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err


def test_generate_joins_the_job_before_jax_starts_its_devices(capsys, no_work, monkeypatch):
    """Every --coordinator run (or JAX_* variables) failed: the backend check touched the devices before
    distributed.initialize ran. Now the prompt is read, the job joined, then the backend checked (the two-process run
    itself: tests/test_distributed.py, the README's launch)."""
    from fathom_jax import distributed

    order = []
    monkeypatch.setattr(distributed, "initialize", lambda *a, **k: order.append(("join", *a)) or False)
    monkeypatch.setattr(cli_args, "check_backend", lambda: order.append(("backend",)))
    code, _, err = run(capsys, "generate", "x", "--coordinator", "host0:1234", "--num-processes", "2",
                       "--process-id", "1", "--mesh", "64")
    assert code == 2 and "argument --mesh: 64 devices asked for, 2 " in err, err  # stops after both
    assert order == [("join", "host0:1234", 2, 1), ("backend",)]
    order.clear()
    code, _, err = run(capsys, "generate", "", "--coordinator", "host0:1234", "--num-processes", "2")
    assert code == 2 and "the prompt is empty" in err and order == []  # before waiting for the other processes


def test_debug_shows_the_traceback(no_work):
    with pytest.raises(cli.UsageError, match="argument --k"):
        cli.main(["generate", "x", "--k", "0", "--debug"])
    with pytest.raises(cli.UsageError, match="the prompt is empty"):
        cli.main(["--debug", "generate", ""])


def test_unwritable_out_fails_before_the_study(capsys, no_work, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = run(capsys, "sweep", "--out", str(blocker / "results"))
    assert code == 2 and f"argument --out: cannot write to '{blocker / 'results'}'" in err


def test_memory_is_sized_before_allocating(capsys, no_work, monkeypatch):
    """A 13,583-token prompt ran 284 s at 21.3 GB peak on a 23 GB machine before this check."""
    monkeypatch.setattr(cli_args, "available_bytes", lambda: 4 * cli_args.GiB)
    code, _, err = run(capsys, "generate", "x" * 8000, "--max-new-tokens", "8")
    assert code == 2 and "needs about" in err and "GiB is available" in err and "--no-memory-check" in err
    # the sizing reproduces the reported peak (SmolLM2, 13,583 tokens: 21.3 GB measured) within 10%
    assert abs(cli_args.peak_bytes(SMOL, 13583) / 21.3e9 - 1) < 0.1


def test_corrupt_cached_model_is_one_line_naming_the_file(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FATHOM_CACHE", str(tmp_path))
    path = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path.write_bytes(b"GGUF truncated")
    code, out, err = run(capsys, "fetch-model")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert f"cached model {path} has 14 bytes" in err and "fathom fetch-model --force" in err


def test_help_shows_defaults_budget_guidance_and_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for want in ("the text to continue", "tokens to generate (for each prompt) (default: 32)", "(default: 128)", "(default: dense)",
                 "choosing a scan budget", "sparq:8 = 34", "D = 128: sparq:16 = 68", "--model"):
        assert want in text, want
    with pytest.raises(SystemExit):
        cli.main(["tune", "--help"])  # every command takes --model (the README says so)
    text = " ".join(capsys.readouterr().out.split())
    for want in ("--model", "--allow-long-context", "--no-memory-check", "tuned_<model>_<context>_mean<M>"):
        assert want in text, want
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "fathom_tuned" not in text and "observed" not in text  # what generate cannot run is not offered
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.startswith("fathom-jax ")
    for command in ("generate", "sweep", "ruler", "agreement", "tune", "row-formats"):  # the bundled models, by name
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "a bundled model (smollm2, gemma3-270m:" in text and "embedded" not in text, command


# What each command's --help says a committed run took: (command, results file, its meta field, the help's words).
HELP_TIMES = [
    ("sweep", "fidelity_smollm2_4k.json", "wall_seconds", "{} s at --context 4096"),
    ("sweep", "fidelity_smollm2_8k.json", "wall_seconds", "and {} s at 8192 with the 128 positions"),
    ("sweep", "fidelity_smollm2_4k_64pos.json", "wall_seconds", "{} s on an idle VM"),
    ("ruler", "ruler_smollm2_4k.json", "wall_s", "{} s at --context 4096"),
    ("ruler", "ruler_smollm2_8k.json", "wall_s", "and {} s at 8192"),
    ("agreement", "agreement_smollm2_4k.json", "wall_s", "{} s at --context 4096"),
]


@pytest.mark.parametrize("command, name, field, words", HELP_TIMES, ids=[f"{c}-{n}" for c, n, _, _ in HELP_TIMES])
def test_help_times_are_the_committed_runs_with_their_machine(capsys, command, name, field, words):
    """The help quoted 212 s and 384 s where the committed files say 297 s and 590 s, and a run log kept only in git
    history: every number is a committed file's, beside that file's machine size."""
    from fathom_jax.eval import compare

    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    meta = json.loads(open(os.path.join(compare.COMMITTED, name)).read())["meta"]
    assert words.format(round(meta[field])) in text, (words, meta[field])
    host = meta["host"]
    size = f"2-core, {host['memory_gib']} GiB" if host["cpus"] == 2 else f"{host['cpus']} cores, {host['memory_gib']} GiB"
    assert size in text, size
    assert not re.search(r"\b[0-9a-f]{7}:results/", text), "a file in git history only"


def test_sweep_records_the_run_in_its_results(capsys, monkeypatch, tmp_path):
    """The committed results carried a wall_seconds that no code wrote; now the CLI writes the run's record."""
    from fathom_jax.eval import study

    captured = {}
    tiny = LlamaConfig(vocab=97, hidden=8, intermediate=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8)
    monkeypatch.setattr(hub, "model_config", lambda source=None: tiny)
    monkeypatch.setattr(hub, "load_tokenizer", lambda source=None: CharTokenizer())
    monkeypatch.setattr(hub, "load_model", lambda source=None: (None, CharTokenizer(), tiny))
    import fathom_jax.models as models
    import numpy as np

    monkeypatch.setattr(models, "capture_qkv", lambda model, ids: {x: np.zeros((1, 1, len(ids), 8), np.float32)
                                                                   for x in "qkv"})

    def fake_study(eval_cap, calib_cap, config, *, meta, progress):
        return {"meta": dict(meta), "rows": []}

    monkeypatch.setattr(study, "run_study", fake_study)
    monkeypatch.setattr(study, "compile_ahead", lambda *a, **k: None)  # nothing runs the programs
    monkeypatch.setattr(study, "render_markdown", lambda res: "")
    monkeypatch.setattr(study, "write_report", lambda res, prefix: captured.update(res=res, prefix=prefix) or [prefix])
    code, _, err = run(capsys, "sweep", "--context", "300", "--positions", "64", "--out", str(tmp_path), "--quiet",
                       "--no-memory-check")
    assert code == 0, err
    meta = captured["res"]["meta"]
    assert meta["command"] == f"fathom sweep --context 300 --positions 64 --out {tmp_path} --quiet --no-memory-check"
    assert meta["wall_seconds"] >= 0 and meta["host"]["cpus"] >= 1 and "commit" in meta
    assert captured["prefix"] == os.path.join(str(tmp_path), "fidelity_smollm2_300tok_64pos")
    json.dumps(meta)  # the record is plain JSON


def test_the_main_job_writes_into_runs_and_compares_with_the_committed_file(capsys, monkeypatch, tmp_path):
    """The README's main job (``fathom sweep --positions 64``) overwrote the committed results/fidelity_smollm2_4k_64pos.*;
    now it writes runs/ of the working folder and says whether its numbers are the committed file's (the study stands
    in: it writes the committed JSON with another run record)."""
    import shutil

    from fathom_jax.eval import compare, study

    tiny = LlamaConfig(vocab=97, hidden=8, intermediate=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8)
    monkeypatch.setattr(hub, "model_config", lambda source=None: tiny)
    monkeypatch.setattr(hub, "load_tokenizer", lambda source=None: CharTokenizer())
    monkeypatch.setattr(hub, "load_model", lambda source=None: (None, CharTokenizer(), tiny))
    import fathom_jax.models as models
    import numpy as np

    monkeypatch.setattr(models, "capture_qkv", lambda model, ids: {x: np.zeros((1, 1, len(ids), 8), np.float32)
                                                                   for x in "qkv"})
    committed = os.path.join(compare.COMMITTED, "fidelity_smollm2_4k_64pos.json")
    monkeypatch.setattr(study, "run_study", lambda *a, meta, progress: {"meta": dict(meta), "rows": []})
    monkeypatch.setattr(study, "compile_ahead", lambda *a, **k: None)
    monkeypatch.setattr(study, "render_markdown", lambda res: "")
    monkeypatch.setattr(study, "write_report", lambda res, prefix: [shutil.copy(committed, prefix + ".json")])
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "sweep", "--positions", "64", "--quiet", "--no-memory-check")
    assert code == 0, err
    assert (tmp_path / "runs" / "fidelity_smollm2_4k_64pos.json").is_file()
    twin = os.path.relpath(committed)
    line = next(line for line in out.splitlines() if "fathom compare" in line)
    assert line.startswith(f"[sweep] runs/fidelity_smollm2_4k_64pos.json measures what {twin} does: its ")
    assert line.endswith(f"; again: fathom compare runs/fidelity_smollm2_4k_64pos.json {twin}")


def test_the_sweep_says_what_it_does_before_each_slow_step(capsys, monkeypatch, tmp_path):
    """It printed nothing for 12-15 s (the GGUF's metadata, the tokenizer, the texts, the model): each step is said
    as it starts, the first before the model's metadata is read."""
    from fathom_jax.eval import study

    seen = []
    tiny = LlamaConfig(vocab=97, hidden=8, intermediate=8, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=8)

    def step(name, value):
        def fn(*a, **k):
            seen.append((name, capsys.readouterr().out))
            return value
        return fn

    import fathom_jax.models as models
    import numpy as np

    monkeypatch.setattr(hub, "model_config", step("metadata", tiny))
    monkeypatch.setattr(hub, "load_tokenizer", lambda source=None: CharTokenizer())
    monkeypatch.setattr(hub, "load_model", step("load", (None, CharTokenizer(), tiny)))
    monkeypatch.setattr(models, "capture_qkv", lambda model, ids: {x: np.zeros((1, 1, len(ids), 8), np.float32)
                                                                   for x in "qkv"})
    monkeypatch.setattr(study, "run_study", step("study", {"meta": {}, "rows": []}))
    monkeypatch.setattr(study, "compile_ahead", lambda *a, **k: None)
    monkeypatch.setattr(study, "render_markdown", lambda res: "")
    monkeypatch.setattr(study, "write_report", lambda res, prefix: [prefix])
    code, _, err = run(capsys, "sweep", "--context", "300", "--positions", "64", "--out", str(tmp_path), "--quiet",
                       "--no-memory-check")
    assert code == 0, err
    said = dict(seen)
    assert said["metadata"].startswith("[sweep] reading SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to f32)'s "
                                       "metadata and tokenizer"), said
    assert said["load"].startswith("[sweep] compiling the study's programs in the background (0 to go); loading "
                                   "SmolLM2-135M-Instruct"), said
    assert said["study"].startswith("[sweep] capturing q/k/v over 300 tokens of each text"), said


def test_the_study_says_how_far_its_statistics_and_references_are():
    """The study's bar sat at 0/2040 for two minutes while the statistics and dense references computed: its phase
    counts them as they finish."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from fathom_jax.eval import study

    phases, gates = [], [threading.Event() for _ in range(3)]
    bar = types.SimpleNamespace(phase=phases.append)
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(gate.wait) for gate in gates]
        counting = threading.Thread(target=study._count_down, args=(bar, futures))
        counting.start()
        for gate in gates:
            gate.set()
        counting.join(timeout=30)
    assert phases[0] == "calibration statistics and dense attention, 0 of 3 done"
    assert phases[-1] == "calibration statistics and dense attention, done" and len(phases) <= 5, phases


@pytest.fixture(scope="module")
def tiny_hf_model(tmp_path_factory):
    """A tiny random Llama in HF layout with a word-level tokenizer.json (no downloads)."""
    import tokenizers
    from tokenizers import models as tok_models, pre_tokenizers

    from tests.support import write_hf_checkpoint

    path = tmp_path_factory.mktemp("tiny_hf")
    write_hf_checkpoint(path)
    vocab = {f"w{i}": i for i in range(49)} | {"[UNK]": 49}
    tok = tokenizers.Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def test_generate_with_a_local_hf_model_reports_what_was_sparse(capsys, tiny_hf_model):
    prompt = " ".join(f"w{i % 49}" for i in range(80))
    code, out, err = run(capsys, "generate", prompt, "--model", str(tiny_hf_model), "--method", "sparq:2",
                         "--k", "40", "--max-new-tokens", "3")
    assert code == 0, err
    assert "SparQ r=2: k = 40 of 82 context tokens (48.8%)" in err
    assert "reads 8.5 bits per token per KV head per layer (dense keys: 64)" in err and "tokens/s" in err
    assert out.startswith(prompt) and len(out) > len(prompt)


def test_generate_passes_mesh_and_step_config_to_the_hook(capsys, monkeypatch, tiny_hf_model):
    """--mesh 2 --placement pinned_host reach the hook's placement, --step-config its step configuration (the sharded
    decode itself is tested against the unsharded one in tests/test_sharding.py)."""
    import jax.numpy as jnp

    import fathom_jax.models as models

    seen = {}

    def fake_generate(model, prompt, n, *, capacity, attention_fn=None):
        seen["attn"] = attention_fn
        return jnp.concatenate([prompt, jnp.zeros((n,), prompt.dtype)])

    monkeypatch.setattr(models, "generate", fake_generate)
    prompt = " ".join(f"w{(7 * i) % 49}" for i in range(80))
    code, _, err = run(capsys, "generate", prompt, "--model", str(tiny_hf_model), "--method", "fathom:8", "--k", "40",
                       "--max-new-tokens", "2", "--mesh", "2", "--placement", "pinned_host", "--step-config",
                       "read=staged,index_writes=full_blocks,pipeline=1")
    assert code == 0, err
    placement, step = seen["attn"].placement, seen["attn"].step
    assert placement.num_shards == 2 and placement.memory == "pinned_host"
    assert step.read == "staged" and step.index_writes == "full_blocks" and step.pipeline == 1


def test_registered_command_modules_share_the_conventions(capsys, monkeypatch):
    """The evaluation commands register from their own module with one line in cli.COMMAND_MODULES."""
    module = types.ModuleType("fake_commands")

    def command(args):
        if args.n > 3:
            raise cli.UsageError(f"argument --n: {args.n} is more than 3")
        raise ValueError("the library says no")

    def register(subparsers):
        p = subparsers.add_parser("fake", help="a registered command")
        p.add_argument("--n", type=cli.positive_int(1), default=1, help="a number")
        p.set_defaults(func=command)

    module.register = register
    monkeypatch.setitem(__import__("sys").modules, "fake_commands", module)
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("fake_commands",))
    assert run(capsys, "fake", "--n", "0")[::2] == (2, "fathom fake: error: argument --n: expected an integer >= 1, "
                                                      "got '0' (see fathom fake --help)\n")
    assert run(capsys, "fake", "--n", "5")[::2] == (2, "fathom fake: error: argument --n: 5 is more than 3\n")
    assert run(capsys, "fake")[::2] == (1, "fathom fake: error: the library says no (--debug shows the traceback)\n")
    with pytest.raises(ValueError, match="the library says no"):
        cli.main(["fake", "--debug"])


def _gemma_state(spec, batch, capacity, rows=None):
    """The bytes of a tiny Gemma 3's decode state as allocated, by kind (K/V rows in the row format ``rows``, index
    parts, windows)."""
    from flax import nnx

    from fathom_jax import decode
    from fathom_jax.models import gemma3 as G
    from fathom_jax.models.attention import DenseCache
    from tests.support import TINY_GEMMA3 as CFG

    model = nnx.eval_shape(lambda: G.Gemma3ForCausalLM(CFG, rngs=nnx.Rngs(0)))  # the state needs no weights
    attention = DenseCache() if spec is None else decode.from_spec(spec, k=40, rows=rows)
    windows, cache = model.split_state(model.init_state(attention.bind(model.cache_shape(batch, capacity)), batch,
                                                        capacity))
    held = {"kv": cache.k.nbytes + cache.v.nbytes} if spec is None else cache.nbytes()
    return {**held, "windows": windows.k.nbytes + windows.v.nbytes}


@pytest.mark.parametrize("spec, rows", [(None, None), ("dense", None), ("fathom:16", None), ("sparq:2", None),
                                        ("landmark", None), ("quest:16", None), ("dense", "k8v8"),
                                        ("fathom:16", "k8v8")])
def test_state_bytes_are_the_allocated_state_of_the_global_layers_and_windows(spec, rows):
    """What fathom generate sizes and prints: the global layers' K/V (in the --rows format; and a sparse method's key
    index), the local layers' windows; byte for byte what the decoder allocates. A Llama model's every layer caches
    the context."""
    from fathom_jax import methods
    from tests.support import TINY_GEMMA3 as CFG

    method = None if spec is None else methods.parse(spec)
    want = _gemma_state(spec, 2, 200, rows)
    assert cli_args.state_bytes(CFG, 200, method, rows=rows, batch=2) == want
    assert cli_args.cache_layers(CFG) == (2, 4, 4) and cli_args.cache_layers(SMOL) == (30, 0, 0)
    assert cli_args.state_bytes(SMOL, 1000) == {"kv": 2 * 30 * 3 * 1000 * 64 * 4}
    assert cli_args.peak_bytes(CFG, 200) == cli_args.peak_bytes(CFG, 200, cache=0) + sum(cli_args.state_bytes(
        CFG, 200).values())


@pytest.mark.parametrize("rows", [None, "k8v8"])
def test_generate_on_gemma3_sizes_and_prints_what_its_global_layers_hold(capsys, monkeypatch, rows):
    """--model gemma3-270m --method fathom:16 --placement pinned_host (--rows k8v8): the memory check and the printed
    line count the global layers' sparse cache (its rows in the format asked for) and the windows (the decoding
    itself: tests/models/test_gemma3_sparse.py)."""
    import jax.numpy as jnp

    import fathom_jax.models as models
    from flax import nnx

    from fathom_jax import methods
    from fathom_jax.rows.layout import row_format
    from fathom_jax.models import gemma3 as G
    from tests.support import TINY_GEMMA3 as CFG

    model = nnx.eval_shape(lambda: G.Gemma3ForCausalLM(CFG, rngs=nnx.Rngs(0)))  # generate is a stub here
    monkeypatch.setattr(hub, "model_config", lambda source=None: CFG)
    monkeypatch.setattr(hub, "load_tokenizer", lambda source=None: CharTokenizer())
    monkeypatch.setattr(hub, "load_model", lambda source=None: (model, CharTokenizer(), CFG))
    seen = {}
    monkeypatch.setattr(generate_command, "check_memory", lambda need, what, skip: seen.update(need=need))
    monkeypatch.setattr(models, "generate", lambda model, prompt, n, *, capacity, attention_fn=None: seen.update(
        attn=attention_fn) or jnp.zeros((n,), jnp.int32))
    code, _, err = run(capsys, "generate", "x" * 60, "--model", "gemma3-270m", "--method", "fathom:16", "--k", "40",
                       "--max-new-tokens", "4", "--placement", "pinned_host", *(["--rows", rows] if rows else []))
    assert code == 0, err
    sizes = cli_args.state_bytes(CFG, 64, methods.Fathom(16), rows=rows)
    assert sizes == _gemma_state("fathom:16", 1, 64, rows) and seen["attn"].placement.memory == "pinned_host"
    assert seen["attn"].rows == (None if rows is None else row_format(rows))
    assert seen["need"] == cli_args.peak_bytes(CFG, 64, cache=sum(sizes.values()))
    held = sum(n for kind, n in sizes.items() if kind != "windows")
    line = next(line for line in err.splitlines() if "decode state" in line)
    assert f"2 global layers' cache {cli_args.readable_bytes(held)} (kv " in line
    assert f"4 sliding-window layers' 4-token rings {cli_args.readable_bytes(sizes['windows'])}" in line
