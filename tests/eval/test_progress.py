"""The long runs' ETA (fathom_jax/eval/progress.py): from the first finished unit, compile time apart."""

import jax
import pytest

from fathom_jax.eval import progress as P

COMPILE = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(P.time, "perf_counter", lambda: now[0])
    return now


def test_sequential_eta_takes_compiles_apart(clock):
    """Ten units of two programs: the first unit of each compiles for 30 s and runs 2 s, the others run 2 s. A
    plain rate after the first unit said 10 x 32 s; here 9 x 2 s plus the other program's 30 s compile."""
    bar = P.Progress(10, "t", keys=2, enabled=False)
    assert bar.eta_s is None  # nothing finished yet
    clock[0] += 32.0
    jax.monitoring.record_event_duration_secs(COMPILE, 30.0)
    bar.update(1, key="a")
    assert bar.eta_s == pytest.approx(9 * 2.0 + 30.0) and bar.compile_s == pytest.approx(30.0)
    clock[0] += 2.0
    bar.update(1, key="a")
    clock[0] += 32.0
    jax.monitoring.record_event_duration_secs(COMPILE, 30.0)
    bar.update(1, key="b")
    assert bar.eta_s == pytest.approx(7 * 2.0)  # every program compiled
    bar.close()
    jax.monitoring.record_event_duration_secs(COMPILE, 30.0)  # closed: no longer listening
    assert bar.compile_s == pytest.approx(60.0)


def test_overlapped_eta_starts_at_the_first_unit(clock):
    """The study compiles on another thread: the ETA is the wall time per unit since the first finished one,
    whatever the minute before it (and resumed units count as done)."""
    bar = P.Progress(12, "t", done=2, sequential=False, enabled=False)
    clock[0] += 90.0  # compiling, capturing
    bar.update(1)
    assert bar.eta_s is None
    for _ in range(3):
        clock[0] += 4.0
        bar.update(1)
    assert bar.eta_s == pytest.approx(6 * 4.0)
    bar.close()


def test_the_bar_says_what_the_run_does_and_its_clock_moves_before_the_first_unit(monkeypatch, capsys):
    """The sweep's bar sat at 0/2040 with its clock stopped for a minute while programs compiled: now it names the
    phase and what it waits for, and redraws every TICK_S seconds until units finish."""
    import time

    monkeypatch.setattr(P, "TICK_S", 0.02)
    waiting = ["3 programs to compile"]
    bar = P.Progress(5, "study", unit="layer", sequential=False, status=lambda: waiting[0])
    bar.phase("dense attention")
    assert bar.postfix() == "dense attention, 3 programs to compile, ETA after the first layer"
    time.sleep(0.1)  # a few ticks
    draws = capsys.readouterr().err.count("dense attention")
    assert draws >= 3
    bar.phase("")
    waiting[0] = ""
    bar.update(1)
    assert bar.postfix() == "ETA after the next unit, compiling 0:00 so far"
    bar.close()
    time.sleep(0.1)
    capsys.readouterr()
    time.sleep(0.1)
    assert capsys.readouterr().err == ""  # closed: no more redraws
