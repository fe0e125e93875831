"""The README's examples run as written, its two set-up commands are the ones CI and the set-up script
honour, and the repository is self-contained (paper by arXiv id, DESIGN.md, a LICENSE matching
pyproject.toml)."""

import json
import pathlib
import re
import shlex
import tomllib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).parents[1]
README = (REPO / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def commands(block: str) -> list[str]:
    return [line.strip() for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def quick_start() -> tuple[str, str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    main_job, tests = commands(block)
    return main_job, tests


def test_two_setup_commands_and_ci_runs_the_test_one():
    main_job, tests = quick_start()
    assert main_job.startswith("bash scripts/setup_env.sh && .venv/bin/fathom sweep")
    assert "--with-oracle" not in main_job, "the main job must not build the torch oracle venv"
    assert tests.startswith("bash scripts/setup_env.sh --with-oracle && ")
    assert tests.endswith(" -n 2 --dist loadfile --durations=15"), "the slowest tests show in every run"
    ci = commands((REPO / ".ci" / "run").read_text().split("\n", 1)[1])
    assert ci[-1] == tests, "the CI script must run exactly the README's test command"


def timing_rows() -> list[list[str]]:
    """The rows of results/cpu_timings.md's table: date, commit, command, wall, CPU, outcome."""
    lines = (REPO / "results" / "cpu_timings.md").read_text().splitlines()
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines if re.match(r"\| 20\d\d-", line)]


def test_quick_start_times_are_the_last_recorded_fresh_clone_runs():
    """The README said 955 tests and 2 min 26 s while 983 ran and the sweep alone took 4 min 13 s: its numbers are
    the last runs results/cpu_timings.md records (the main job's and the test command's), on the machine it names."""
    quick = " ".join(README.split("## Quick start", 1)[1].split("\n## ", 1)[0].split())
    rows = timing_rows()
    main = [r for r in rows if "main job" in r[2]][-1]
    tests = [r for r in rows if "the README's test command" in r[2]][-1]
    clock = lambda cell: re.match(r"(\d+ min \d+ s)", cell).group(1)  # noqa: E731
    assert f"the main job took {clock(main[3])} with the set-up already run" in quick, main
    passed = re.search(r"(\d+) passed", tests[5]).group(1)
    assert f"the test command ran {passed} CPU tests in {clock(tests[3])}" in quick, tests
    cores, memory = re.search(r"(\d+)-core, ([\d.]+) GiB VM", quick).groups()  # the machine, as the rows name it
    for row in (main, tests):
        assert f"{cores} cores, {memory} GiB" in row[0], row


def test_readme_speaks_to_a_stranger():
    """No paths of the machine that wrote it, no commit ids in the quick start's timings, and the design notes speak
    of this repository only."""
    import re

    assert "/root/" not in README and ".pyenv" not in README
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7}\b", quick), "a commit id in the quick start"
    design = (REPO / "DESIGN.md").read_text()
    assert "steering" not in design and "shared/" not in design


def test_offloaded_decoding_reads_in_short_subsections():
    section = README.split("## Offloaded decoding", 1)[1].split("\n## ", 1)[0]
    parts = section.split("\n### ")
    assert len(parts) >= 8, "one subsection per topic"
    for part in parts:
        prose = " ".join(line for line in part.split("```")[::2])  # code blocks left out
        assert len(prose.split()) <= 320, part.split("\n", 1)[0]


def test_repository_is_self_contained():
    assert "arXiv:2609.17652" in README and "](../" not in README and "shared/paper" not in README
    for doc in ("DESIGN.md", "LICENSE"):
        assert f"]({doc})" in README and (REPO / doc).is_file(), doc
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    license_text = (REPO / "LICENSE").read_text()
    assert project["license"] == {"text": "Apache-2.0"}
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    extras = project["optional-dependencies"]
    assert extras["gpu"] == ["jax[cuda12]==0.11.2"] and "jax==0.11.2" in project["dependencies"]
    assert any(dep.startswith("nbclient") for dep in extras["notebook"])


def _write_hf(path: pathlib.Path, config, hf: dict, seed: int) -> None:
    """A tiny random checkpoint in HF layout (our name map; no transformers) with a word-level tokenizer."""
    import tokenizers
    from flax import nnx
    from safetensors.numpy import save_file
    from tokenizers import models as tok_models, pre_tokenizers

    from fathom_jax.models import LlamaForCausalLM
    from fathom_jax.models.llama.loading import hf_name_map

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf))
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(seed))
    tensors = {}
    for p, var in nnx.to_flat_state(nnx.state(model)):
        spec, a = hf_name_map(config)[tuple(p)], np.asarray(var.get_value())
        for i, layer_a in enumerate(a if p[0] == "layers" else [a]):
            tensors[spec.name.format(i=i)] = np.ascontiguousarray(spec.transform(layer_a))  # T is self-inverse
    save_file(tensors, str(path / "model.safetensors"))
    tok = tokenizers.Tokenizer(tok_models.WordLevel({f"w{i}": i for i in range(config.vocab - 1)} |
                                                    {"[UNK]": config.vocab - 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture
def checkpoints(tmp_path, monkeypatch):
    """Tiny Llama-3 and Qwen3 stand-ins at the paths the README's loading example names."""
    from fathom_jax.models import LlamaConfig

    common = {"vocab_size": 50, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False}
    llama = LlamaConfig.from_hf_config(common | {"architectures": ["LlamaForCausalLM"]})
    qwen_hf = common | {"architectures": ["Qwen3ForCausalLM"], "head_dim": 8}
    _write_hf(tmp_path / "checkpoints" / "Meta-Llama-3-8B-Instruct", llama,
              common | {"architectures": ["LlamaForCausalLM"]}, 0)
    _write_hf(tmp_path / "checkpoints" / "Qwen3-8B", LlamaConfig.from_hf_config(qwen_hf), qwen_hf, 1)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def smollm2_cached():
    from fathom_jax.models.hub import cached_model_path

    if not pathlib.Path(cached_model_path("smollm2")).exists():
        pytest.skip("SmolLM2 is not cached: run scripts/setup_env.sh (it fetches the model)")


@pytest.fixture
def smollm2_first_layers(monkeypatch, smollm2_cached):
    """SmolLM2 cut to its first 4 of 30 layers (tests.support.serve_first_layers): the examples' calls, shapes and
    cache layouts are the real model's at a seventh of the compute (the parity tests run the whole model)."""
    from tests.support import serve_first_layers

    serve_first_layers(monkeypatch, 4)


@pytest.mark.slow  # decodes 1024 tokens of code: about half a minute on 2 CPU cores
def test_python_examples_run_as_written(checkpoints, smollm2_first_layers, capsys):
    examples = blocks("python")
    assert len(examples) >= 3
    namespace: dict = {}
    for i, code in enumerate(examples):
        exec(compile(code, f"README.md[python {i}]", "exec"), namespace)
    assert namespace["approx"].shape == (1, 2, 4, 1000)  # n-wide, not capacity-wide
    assert namespace["out"].shape == (1, 2, 4, 64) and bool(np.all(np.isfinite(namespace["out"])))
    assert namespace["ids"].shape == (8,) and namespace["qwen_config"].family == "qwen3"
    # under a plain jax.jit a failed check is JAX's runtime error; checks.reraise gives the CheckError, as the README says
    assert namespace["message"].startswith("build_store: keys contains 1 NaN or inf value(s)")
    assert capsys.readouterr().out.strip(), "the sparse decoding example prints its continuation"


@pytest.mark.slow
def test_shell_examples_run_as_written(smollm2_first_layers, capsys, monkeypatch):
    from fathom_jax import cli

    monkeypatch.chdir(REPO)
    lines = [line for block in blocks("bash") for line in commands(block) if line.startswith(".venv/bin/fathom ")]
    assert lines
    for line in lines:
        argv = shlex.split(line)[1:]
        if argv[0] in ("ruler", "agreement"):  # hours on a CPU: check that the arguments parse and pass the checks
            from fathom_jax.cli import study_commands as eval_commands

            args = cli.build_parser().parse_args(argv)
            configs = (eval_commands.ruler_configs if argv[0] == "ruler" else eval_commands.agreement_configs)(args)
            assert configs, line
            continue
        assert cli.main(argv) == 0, line
        err = capsys.readouterr().err
        if "generate" in line:
            share = re.search(r"k = 64 of (\d+) context tokens \(([\d.]+)%\)", err)
            assert share and float(share.group(2)) < 10, err  # the example is sparse
            assert "bits per token per KV head" in err and "tokens/s" in err
