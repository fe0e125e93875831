"""Ctrl-C stops a long command within seconds (fathom_jax/eval/interrupt.py, issue 46): real SIGINTs sent to
subprocesses, where the interrupt lands in a gc callback, is swallowed, or comes while a ``fathom agreement`` run
decodes."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _interrupt_when(proc: subprocess.Popen, ready, timeout: float = 120.0) -> tuple[int, str, str, float]:
    """Wait for ``ready()`` (or, given a string, for that line on stdout), send one SIGINT; the exit status, stdout,
    stderr and the seconds from the signal to the exit."""
    deadline = time.time() + timeout
    if isinstance(ready, str):
        while proc.stdout.readline().strip() != ready:
            assert proc.poll() is None, proc.communicate()
    else:
        while not ready():
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "the command did not get going"
            time.sleep(0.05)
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running 30 s after Ctrl-C: {err[-2000:]}")
    return proc.returncode, out, err, time.time() - t0


LOOP = """
    import gc, sys, time
    from fathom_jax.eval import interrupt, resume

    def slow_callback(phase, info):  # as JAX's _xla_gc_callback: Python code at every collection, only slower
        if phase == "start":
            print("collecting", flush=True)
        time.sleep(0.3)

    with interrupt.handled(grace_s=float(sys.argv[1])), resume.stop_on_interrupt("loop", lambda: "3 units", ["loop"]):
        {setup}
        print("running", flush=True)
        while True:
            {body}
"""


def test_an_interrupt_landing_in_a_gc_callback_stops_the_run():
    """Ctrl-C while a gc callback runs, where Python drops the KeyboardInterrupt ("Exception ignored in"): it is
    delivered again, stops the block, and the run says what it saved, well before the watchdog would."""
    body = "gc.collect()\n            time.sleep(0.2)"
    code, _, err, seconds = _interrupt_when(_start(LOOP.format(setup="gc.callbacks.append(slow_callback)", body=body),
                                                   "60"), "collecting")
    assert code == 130 and seconds < 5, err
    assert "Exception ignored" not in err
    assert err.strip() == "[loop] interrupted: 3 units; to continue where it stopped, run: fathom loop --resume"


def test_a_swallowed_interrupt_still_ends_the_process_after_the_grace():
    """Code that swallows the interrupt (or a call that never returns to Python) cannot keep the run going: the
    watchdog says what was saved and ends the process ``grace_s`` after the first Ctrl-C."""
    # No gc callback here: an interrupt it caught would be delivered again, maybe outside the try, and end the run
    # before the watchdog does (a pass, but not of this test).
    # Ctrl-C only once the loop is inside its try: sent at "running", a loaded machine delivered it before the try,
    # where it stops the run at once (a pass, but not of this test).
    body = ('try:\n                print("swallowing", flush=True)\n                time.sleep(10)\n'
            '            except BaseException:\n                pass')
    code, _, err, seconds = _interrupt_when(_start(LOOP.format(setup="pass", body=body), "1"), "swallowing")
    assert code == 130 and 1 <= seconds < 5, err
    assert err.strip() == "[loop] interrupted: 3 units; to continue where it stopped, run: fathom loop --resume"


AGREEMENT = """
    import sys
    from flax import nnx
    from fathom_jax.cli import app
    from fathom_jax.models import hub
    from fathom_jax.models.config import LlamaConfig
    from fathom_jax.models.llama import LlamaForCausalLM

    # The tests' tiny random model with SmolLM2's tokenizer (tests/eval/conftest.py), served by the hub.
    config = LlamaConfig(vocab=49152, hidden=64, intermediate=96, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=64,
                         rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192)
    model, tokenizer = LlamaForCausalLM(config, rngs=nnx.Rngs(0)), hub.load_tokenizer(sys.argv[1])
    hub.model_config = lambda source=None: config
    hub.load_model = lambda source=None, **kw: (model, tokenizer, config)
    app.run(sys.argv[2:])  # the fathom program: main, then an interrupted run ends at once
"""


def test_ctrl_c_stops_a_fathom_agreement_run_within_seconds(tmp_path, smollm2_path):
    """``fathom agreement`` over many sessions, interrupted once its first decodes are saved: it exits 130 within
    seconds, its last line naming the decodes saved and the command that resumes."""
    argv = ["agreement", "--context", "512", "--sessions", "40", "--batch", "1", "--steps", "4", "--k-fraction",
            "0.125", "--methods", "dense", "exact", "--baseline", "exact", "--calib-tokens", "256", "--quiet",
            "--out", str(tmp_path)]
    partial = tmp_path / "agreement_smollm2_512.partial.jsonl"
    saved = lambda: partial.exists() and len(partial.read_text().splitlines()) >= 3  # noqa: E731  (header + 2)
    code, _, err, seconds = _interrupt_when(_start(AGREEMENT, smollm2_path, *argv), saved)
    assert code == 130 and seconds < 8, err  # the watchdog's 5 s at most, and a loaded machine's slack
    last = err.strip().splitlines()[-1]
    assert last.startswith("[agreement] interrupted: ") and " finished decodes in " in last, err
    assert last.endswith(f"to continue where it stopped, run: fathom {' '.join(argv)} --resume")


RETURNED = """
    import os, signal, time
    from fathom_jax.eval import interrupt

    with interrupt.handled(grace_s=0.3):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            print("stopped", flush=True)
    time.sleep(1.0)  # past the grace: a watchdog still armed would end the process here
    print("alive", flush=True)
"""


def test_a_command_that_stopped_in_time_leaves_its_caller_running():
    """In-process callers (a notebook, a test) go on after an interrupted command returned: the watchdog ends only a
    command still running; the fathom program ends itself (cli.app.run)."""
    proc = _start(RETURNED)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.split() == ["stopped", "alive"], err


WRAPPED = """
    import os, signal, time
    from fathom_jax.cli.args import running

    with running("fetch-model"):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt as err:  # what JAX does with one raised in a static argument's __eq__
            raise ValueError("static arguments should be comparable using __eq__") from err
"""


def test_an_interrupt_that_surfaces_as_another_error_still_stops_the_command():
    """A Ctrl-C that JAX turned into a ValueError (it landed in jit's comparison of static arguments: a `fathom
    agreement` run said "error" and exited 1) still ends the command as interrupted: status 130, what was saved."""
    proc = _start(WRAPPED)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "[fetch-model] interrupted" in err and "static arguments" not in err, err
