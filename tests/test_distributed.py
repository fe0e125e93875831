"""Several processes, one mesh: jax.distributed on this machine (two processes, two CPU devices each, gloo).

The multi-process tests start their processes (``tests/distributed_worker.py``) with a coordinator on 127.0.0.1 and
stop them by themselves: every wait has a deadline, past which the test kills the processes it started and fails.
"""

import json
import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from fathom_jax import distributed
from fathom_jax.format import round_capacity
from fathom_jax.placement import Placement, device_mesh
from tests import distributed_worker as worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_DEVICES = 2  # CPU devices per process
DEADLINE_S = 480  # a whole multi-process run, compile included; generous: a loaded 2-core machine is several x slower
HEARTBEAT_S = 15  # the dying-process runs: how long the survivor waits for a silent peer


# -- one process ---------------------------------------------------------------------------------------

_JOB_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID", "SLURM_STEP_NODELIST",
            "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "OMPI_MCA_orte_hnp_uri", "PMIX_SERVER_URI2")


@pytest.fixture
def no_job(monkeypatch):
    for name in _JOB_ENV:
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    return calls


def test_check_same_names_the_processes_that_differ(monkeypatch):
    """Two processes, faked: the all-gather returns this process's digest and process 1's, whose prompt is
    ``arange(3)`` (the real all-gather runs in every two-process test below)."""
    from jax.experimental import multihost_utils

    theirs = distributed._digest(np.arange(3, dtype=np.int32))
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda mine: np.stack([mine, theirs]))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    distributed.check_same(np.arange(3, dtype=np.int32), "the prompt's token ids")  # the same: passes
    for mine in (np.arange(4, dtype=np.int32), np.arange(3, dtype=np.int64), np.array([0, 1, 3], np.int32)):
        with pytest.raises(ValueError, match=r"the prompt's token ids must be the same on every process of a "
                                             r"multi-process run; process\(es\) \[1\] differ from process 0"):
            distributed.check_same(mine, "the prompt's token ids")


def test_initialize_without_a_job_is_one_process(no_job):
    assert distributed.initialize() is False and no_job == []
    distributed.check_same(np.arange(3), "anything")  # one process: nothing to compare


@pytest.mark.parametrize("kwargs,env,message", [
    (dict(coordinator="10.0.0.1:1234", num_processes=0, process_id=0), {}, "num_processes must be an int >= 1"),
    (dict(coordinator="10.0.0.1:1234", num_processes=2, process_id=2), {},
     r"process_id must lie in \[0, num_processes\) = \[0, 2\), got 2"),
    (dict(coordinator="10.0.0.1", num_processes=2, process_id=0), {}, "coordinator must be host:port"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "two"},
     "environment variable JAX_NUM_PROCESSES must be an int, got 'two'"),
])
def test_initialize_checks_its_arguments_first(no_job, monkeypatch, kwargs, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        distributed.initialize(**kwargs)
    assert no_job == []


def test_initialize_after_devices_are_in_use_says_so(no_job, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")  # the rest from the environment too
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    jax.devices()
    with pytest.raises(RuntimeError, match="must run before anything uses JAX's devices"):
        distributed.initialize()
    assert no_job == []


@pytest.mark.parametrize("tasks,job", [("2", True), ("1", False)])
def test_a_slurm_job_of_several_tasks_is_detected(no_job, monkeypatch, tasks, job):
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": tasks,
                        "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}.items():
        monkeypatch.setenv(name, value)
    assert distributed._cluster_detected() is job


def test_a_join_still_waiting_is_not_initialized_and_refuses_a_second_join(monkeypatch):
    """After a join timed out or was interrupted, JAX's connect still waits on its thread (its client already set):
    this process is not joined, and joining again fails at once (the CLI ends the process instead)."""
    import threading

    from jax._src import distributed as jax_distributed

    release = threading.Event()
    waiting = threading.Thread(target=release.wait, daemon=True)
    waiting.start()
    monkeypatch.setattr(distributed, "_connecting", waiting)
    monkeypatch.setattr(jax_distributed.global_state, "client", object())
    try:
        assert distributed.join_pending() and not distributed.is_initialized()
        with pytest.raises(distributed.JoinError, match="still waiting for the job's other processes"):
            distributed.initialize("127.0.0.1:1234", 2, 0)
    finally:
        release.set()
        waiting.join()
    assert not distributed.join_pending()


def _fake_devices(processes: int, per_process: int):
    return [types.SimpleNamespace(id=p * per_process + i, process_index=p)
            for p in range(processes) for i in range(per_process)]


def test_mesh_devices_take_an_even_share_of_every_process(monkeypatch):
    monkeypatch.setattr(jax, "devices", lambda: _fake_devices(2, 4))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert [d.id for d in distributed.mesh_devices(4)] == [0, 1, 4, 5]  # 2 of each process, process by process
    assert [d.id for d in distributed.mesh_devices(8)] == list(range(8))
    with pytest.raises(ValueError, match="3 devices do not split evenly over the 2 processes"):
        distributed.mesh_devices(3)
    with pytest.raises(ValueError, match="9 devices asked for, 8 .* over 2 processes"):
        distributed.mesh_devices(9)


def test_mesh_devices_of_one_process_are_the_first_ones():
    assert distributed.mesh_devices(2) == jax.devices()[:2] and distributed.global_mesh(1) is None
    assert list(distributed.global_mesh().devices) == jax.devices()
    with pytest.raises(ValueError, match="devices must be an int >= 1"):
        distributed.mesh_devices(0)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (the CPU tests force 2 host devices)")
def test_put_zeros_and_to_host_in_one_process():
    """In one process the placement helpers are jax.device_put's: the same shardings and values."""
    placement = Placement("pinned_host", mesh=device_mesh(2))
    x = np.arange(24, dtype=np.float32).reshape(1, 4, 6)
    sharding = placement.sharding(3, bulk=True)
    y = distributed.put({"a": x}, {"a": sharding})["a"]
    assert y.sharding == sharding and [s.data.shape for s in y.addressable_shards] == [(1, 2, 6)] * 2
    np.testing.assert_array_equal(distributed.to_host(y), x)
    z = distributed.zeros((1, 4, 6), np.float32, sharding)
    assert z.sharding == sharding and not np.asarray(z).any()
    assert distributed.local_bytes({"y": y, "z": z}) == 2 * x.nbytes


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (the CPU tests force 2 host devices)")
def test_what_a_process_holds():
    mesh = device_mesh(2)
    assert distributed.local_share(None) == 1.0 and distributed.local_share(mesh) == 1.0
    assert Placement("pinned_host", mesh=mesh).local_shards == 2 and Placement().local_shards == 1
    line = distributed.holding({"kv": 3 * 2**20, "planes": 512}, None)
    assert line.endswith("holds 3.0 MiB of the cache's 3.0 MiB (kv 3.0 MiB, planes 512 B)"), line


# -- two processes -------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(process: int, processes: int, port: int) -> dict:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path,
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES=str(processes),
               JAX_PROCESS_ID=str(process))
    # the suite's compile flags (tests/conftest.py), and this test's devices per process
    env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={WORKER_DEVICES}").strip()
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


class Launch:
    """Processes of one job, started together; :meth:`wait` returns when all have ended or kills them at the
    deadline (each by its own handle)."""

    def __init__(self, args: list[str], tmp_path, processes: int = 2, *, commands: list[list[str]] | None = None,
                 envs: list[dict] | None = None, cwd=ROOT):
        """``processes`` workers (``tests/distributed_worker.py`` with ``args``), or the given ``commands``, one
        process each, with ``envs``."""
        if commands is None:
            port = _free_port()
            commands = [[sys.executable, "-m", "tests.distributed_worker", *args]] * processes
            envs = [_worker_env(i, processes, port) for i in range(processes)]
        self.logs = [(tmp_path / f"out{i}.txt", tmp_path / f"err{i}.txt") for i in range(len(commands))]
        self.procs = []
        for (out, err), command, env in zip(self.logs, commands, envs):
            with open(out, "w") as stdout, open(err, "w") as stderr:  # the child keeps its own descriptors
                self.procs.append(subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr))
        self.start = time.monotonic()
        self.ended: dict[int, float] = {}

    def wait(self, deadline_s: float):
        while len(self.ended) < len(self.procs):
            for i, p in enumerate(self.procs):
                if i not in self.ended and p.poll() is not None:
                    self.ended[i] = time.monotonic() - self.start
            if time.monotonic() - self.start > deadline_s:
                for p in self.procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                pytest.fail(f"the processes did not end within {deadline_s} s:\n{self.report()}")
            time.sleep(0.2)
        return [p.returncode for p in self.procs]

    def stderr(self, i: int) -> str:
        return self.logs[i][1].read_text()

    def stdout(self, i: int) -> str:
        return self.logs[i][0].read_text()

    def results(self, i: int) -> dict:
        """The RESULT lines process ``i`` printed, by method."""
        lines = self.logs[i][0].read_text().splitlines()
        return {r["method"]: r for r in (json.loads(x[len("RESULT "):]) for x in lines if x.startswith("RESULT "))}

    def report(self) -> str:
        return "\n".join(f"--- process {i} (exit {p.returncode}):\n{self.stderr(i)[-3000:]}"
                         for i, p in enumerate(self.procs))


@pytest.mark.slow
def test_four_devices_over_two_processes_decode_smollm2_like_one_device(tmp_path):
    """SmolLM2's attention layout (random weights, 2 layers) on a 4-device mesh over two processes (4 sequences x 3
    KV heads: 3 groups per device), cache and index in the host layout: Fathom and SparQ decode the tokens one process
    on one device decodes. Each process holds half of the cache, in shards of its own devices only. (``--model
    smollm2`` runs the real weights by hand: twice the CPU time.)"""
    methods = ("fathom:16", "sparq:4")
    job = Launch(["--model", "smollm2-layout", "--methods", ",".join(methods), "--mesh", "4"], tmp_path)
    # the reference in this process while the two run: one device, no mesh, the same code
    model, prompt, lengths = worker.load("smollm2-layout")
    want = {spec: worker.decode_tokens(model, prompt, lengths, worker.hook(spec, Placement("pinned_host")))
            for spec in methods}
    assert job.wait(DEADLINE_S) == [0, 0], job.report()
    for process in (0, 1):
        got = job.results(process)
        for spec in methods:
            r = got[spec]
            np.testing.assert_array_equal(np.array(r["tokens"]), want[spec], err_msg=f"{spec}, process {process}")
            assert r["kv_spans_processes"] and r["local_bytes"] * 2 == r["bytes"] and r["local_shards"] == 2
            capacity = round_capacity(worker.capacity(prompt))
            assert r["kv_shard_shapes"] == [[2, 3, capacity, 128]] * WORKER_DEVICES  # [L, R / 4, C, 2 Dh]
    assert not np.array_equal(want["fathom:16"], want["sparq:4"])  # the selection decides something


@pytest.mark.slow
def test_a_process_that_dies_makes_the_others_fail_not_hang(tmp_path):
    """Process 1 exits after the prefill; process 0's next step waits on it, and once process 1 has missed its
    heartbeats the coordination service ends process 0 with an error naming it. (A dead coordinator, process 0, is
    seen at once: its socket closes; checked by hand, not here, to keep the suite short.)"""
    job = Launch(["--model", "tiny", "--methods", "fathom:16", "--die-after-prefill", "1", "--heartbeat-timeout",
                  str(HEARTBEAT_S)], tmp_path)
    codes = job.wait(DEADLINE_S)
    assert codes[1] == worker.DIED, job.report()
    assert codes[0] != 0 and not job.results(0), job.report()  # failed, and decoded nothing
    err = job.stderr(0)
    assert "the JAX distributed service detected fatal errors" in err, job.report()
    # Which message ends it is a race: the service's list of the tasks that missed their heartbeats, process 0's own
    # heartbeat refused once the service has shut down on that error, or the collective's transport seeing process
    # 1's socket close before either.
    causes = ("stopped sending heartbeats", "StartSendingHeartbeats", "Connection closed by peer")
    assert any(cause in err for cause in causes), job.report()
    # ended by the coordination service, not by the test's deadline (slack for a loaded machine)
    assert job.ended[0] - job.ended[1] < 6 * HEARTBEAT_S, job.ended


def readme_launch() -> list[list[str]]:
    """The README's launch of one job as two processes on one machine ("Several processes"): one argument list per
    process, as written (the shell's ``&`` left out)."""
    section = (pathlib.Path(ROOT) / "README.md").read_text().split("### Several processes", 1)[1].split("\n### ")[0]
    (block,) = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    lines = [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    return [argv[:-1] if argv[-1] == "&" else argv for argv in lines]


def _cli_env() -> dict:
    """A process of the README's launch on this machine: the CPU, no job in the environment (the command line gives
    it), the suite's compile flags but no device count (the command makes its devices), this checkout's fathom_jax."""
    env = {k: v for k, v in os.environ.items() if k not in _JOB_ENV and k != "PYTEST_XDIST_WORKER"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    return env


def _as_process(argv: list[str], port: int, *extra: str) -> list[str]:
    """One README command line run by this checkout's Python, its coordinator on a free port of this machine."""
    coordinator = argv[argv.index("--coordinator") + 1]
    return [sys.executable, "-m", "fathom_jax.cli", *[f"127.0.0.1:{port}" if a == coordinator else a
                                                      for a in argv[1:]], *extra]


@pytest.fixture
def smollm2():
    """The README's launch runs the bundled SmolLM2 (scripts/setup_env.sh fetches it)."""
    from fathom_jax.models.hub import cached_model_path

    if not pathlib.Path(cached_model_path("smollm2")).exists():
        pytest.skip("SmolLM2 is not cached: run scripts/setup_env.sh (it fetches the model)")


@pytest.mark.slow  # ~25 s on 2 CPU cores: two processes load SmolLM2 and compile, and the one-process reference
def test_the_readme_launch_runs_as_written(tmp_path, monkeypatch, capsys, smollm2):
    """The README's two command lines, on this machine, with the bundled SmolLM2 (3 KV heads): both processes join,
    split the batch of two prompts (one prompt's 3 KV heads each), hold half of the cache and exit 0; process 0 prints
    the tokens one process decodes with no mesh."""
    from fathom_jax.cli import app

    launch = readme_launch()
    assert len(launch) == 2 and all(argv[0] == ".venv/bin/fathom" and argv[1] == "generate" for argv in launch), launch
    assert [a for a in launch[0] if a != "0"] == [a for a in launch[1] if a != "1"], "the same but the id"
    port = _free_port()
    job = Launch([], tmp_path, commands=[_as_process(argv, port) for argv in launch], envs=[_cli_env()] * 2)
    # the reference in this process while the two run: one process, no mesh, the same command otherwise
    monkeypatch.chdir(ROOT)
    job_flags = {"--mesh", "--coordinator", "--num-processes", "--process-id"}
    alone = [a for i, a in enumerate(launch[0][1:]) if a not in job_flags and launch[0][i] not in job_flags]
    # (the memory check left out of this reference only: with the two processes and a loaded machine beside it, it
    # once found 1.0 GiB available and refused)
    assert app.main([*alone, "--no-memory-check"]) == 0
    want = capsys.readouterr().out
    assert job.wait(DEADLINE_S) == [0, 0], job.report()
    assert want.count("--- ") == 2 and want in job.stdout(0), (want, job.stdout(0))  # both prompts' continuations
    assert "--- " not in job.stdout(1), job.stdout(1)  # every process holds the tokens, process 0 prints them
    for i in (0, 1):
        err = job.stderr(i)
        assert f"process {i} of 2: joining the job at coordinator 127.0.0.1:{port}" in err, err
        assert "each device holds 1 whole sequence(s): the batch is split" in err, err
        assert re.search(rf"process {i} of 2: 1 local cpu device\(s\) of 2; holds (\S+ \S+) of the cache's", err), err
        assert "tokens/s" in err, err


def test_a_missing_partner_ends_in_one_line_naming_the_coordinator(tmp_path):
    """Either process of the README's launch alone (process 0 runs the coordinator, process 1 finds none): each says
    what it waits for, and when ``--join-timeout`` passes ends with one line naming the coordinator, exit status 1, not
    JAX's C++ abort minutes later."""
    launch, ports = readme_launch(), (_free_port(), _free_port())
    job = Launch([], tmp_path, commands=[_as_process(argv, port, "--join-timeout", "3")
                                         for argv, port in zip(launch, ports)], envs=[_cli_env()] * 2)
    assert job.wait(DEADLINE_S) == [1, 1], job.report()
    for i, port in enumerate(ports):
        lines = job.stderr(i).splitlines()
        assert len(lines) == 2 and lines[0].startswith(f"[generate] process {i} of 2: joining the job at coordinator "
                                                       f"127.0.0.1:{port}, waiting up to 3 s"), lines
        assert lines[1].startswith(f"fathom generate: error: process {i} of 2: the job's other processes did not join "
                                   f"at coordinator 127.0.0.1:{port}") and "within 3 s" in lines[1], lines
        assert job.ended[i] < 3 + 30, job.ended  # the timeout, and the interpreter's start on a loaded machine


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_while_waiting_for_the_other_processes_stops_at_once(tmp_path, inherited):
    """JAX's connect ignores SIGINT; the wait for it does not: exit status 130 within a second or two of Ctrl-C, also
    where the process started with SIGINT ignored (as under a pytest-xdist worker: the command installs its handler
    before it waits, as every command does)."""
    disposition = "SIG_DFL" if inherited == "default" else "SIG_IGN"
    command = _as_process(readme_launch()[0], _free_port())
    # the disposition set, then the command exec'd (an ignored signal stays ignored across exec)
    wrapped = [sys.executable, "-c", f"import os, signal, sys; signal.signal(signal.SIGINT, signal.{disposition}); "
               "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])", *command[1:]]
    job = Launch([], tmp_path, commands=[wrapped], envs=[_cli_env()])
    deadline = time.monotonic() + DEADLINE_S
    while "joining the job" not in job.stderr(0):
        assert time.monotonic() < deadline and job.procs[0].poll() is None, job.report()
        time.sleep(0.1)
    sent = time.monotonic()
    job.procs[0].send_signal(signal.SIGINT)
    assert job.wait(DEADLINE_S) == [130], job.report()
    assert job.start + job.ended[0] - sent < 5, job.ended
    assert "interrupted while joining the job's other processes; nothing ran" in job.stderr(0), job.report()
