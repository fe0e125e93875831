"""The CLI's shared checks (fathom_jax/cli/args.py) not covered through the commands in test_cli.py."""

import os
import subprocess
import sys

import jax
import pytest


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="needs a machine without a GPU")
def test_a_platform_the_machine_lacks_is_one_line(tmp_path):
    """``JAX_PLATFORMS=cuda`` without a GPU printed a 28-line traceback from inside the model's loading."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cuda", "PYTHONPATH": root}
    run = subprocess.run([sys.executable, "-m", "fathom_jax.cli", "agreement", "--context", "512", "--sessions", "2",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and run.stdout == "" and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("fathom agreement: error: JAX cannot start the platform(s) JAX_PLATFORMS='cuda' asks "
                                 "for on this machine") and "unset JAX_PLATFORMS" in run.stderr


def test_a_run_time_check_in_a_command_reads_as_its_check_error():
    """Inside a command (cli.main runs each in ``running``), a check that fires in a compiled program is the
    CheckError with its message, which main prints as one line, not JAX's INTERNAL runtime error."""
    import jax.numpy as jnp

    from fathom_jax import checks
    from fathom_jax.cli.args import running

    def f(x):
        checks.fail_if(x < 0, lambda v: f"x must be >= 0, got {v}", x)
        return x

    with pytest.raises(checks.CheckError, match=r"^x must be >= 0, got -1.0$"), running("sweep"):
        jax.block_until_ready(jax.jit(f)(jnp.float32(-1)))


def test_an_interrupted_command_without_a_log_says_so_and_exits_130(capsys):
    """generate and tune keep no partial results: Ctrl-C ends them with one line (not a traceback) and status 130."""
    from fathom_jax.cli.args import running

    with pytest.raises(SystemExit) as stop:
        with running("tune"):
            raise KeyboardInterrupt
    assert stop.value.code == 130
    assert capsys.readouterr().err.strip() == ("[tune] interrupted: it writes its results only when it ends, so "
                                               "nothing was saved")


def test_every_command_writes_into_a_folder_git_ignores_unless_told(tmp_path):
    """The main job overwrote the committed results/fidelity_smollm2_4k_64pos.* and every later result recorded its
    commit as -dirty: each command's --out defaults to runs/ (or a folder in it), which .gitignore names."""
    import argparse

    from fathom_jax.cli import app
    from fathom_jax.cli.args import RUNS

    sub = next(a for a in app.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    outs = {name: next((a.default for a in p._actions if a.dest == "out"), None) for name, p in sub.choices.items()}
    writing = {name: out for name, out in outs.items() if out is not None}
    assert set(writing) >= {"sweep", "ruler", "agreement", "tune", "row-formats"}, outs
    assert all(out == RUNS or out.startswith(RUNS + "/") for out in writing.values()), writing
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, ".gitignore")) as f:
        assert f"/{RUNS}/" in f.read().split(), ".gitignore does not name runs/"
