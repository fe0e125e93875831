"""Ctrl-C that stops a long command within seconds, whatever code runs when it comes.

Python raises ``KeyboardInterrupt`` in whatever Python code the main thread runs when SIGINT arrives. Three ways
a long run kept going after it (issue 46):

* it landed in a garbage-collection callback or a ``__del__`` (JAX's ``_xla_gc_callback`` runs at every
  collection), where Python prints "Exception ignored in: ..." and drops it, and ``fathom ruler`` ran on for
  minutes after the first Ctrl-C;
* the main thread sat in a long call into XLA, which runs no Python code until it returns;
* the command had stopped, but the interpreter's exit waited for worker and compile threads to finish what they
  had queued, and ``fathom sweep`` took minutes to exit after its message.

:func:`handled` (around every command, ``fathom_jax.cli.args.running``) installs a SIGINT handler and an
unraisable-exception hook for the command's duration. The hook sees a ``KeyboardInterrupt`` dropped in a callback
and delivers it again a moment later, until it lands in the command's own code. The first Ctrl-C also starts a watchdog: if the
process is still alive ``GRACE_S`` seconds later (stuck in a call, or waiting for threads at exit), it prints what
was saved (the innermost :func:`reporting` message, once) and ends the process with status 130; a second Ctrl-C
does so at once. Everything a run saves is written as it finishes (``fathom_jax.eval.resume.UnitLog``), so ending
the process there loses nothing saved. The ``fathom`` program (``fathom_jax.cli.app.run``) ends at once after an
interrupted command, so its exit does not wait for threads either.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command Ctrl-C stopped
GRACE_S = 5.0  # after the first Ctrl-C, the longest the process may take to stop by itself
REDELIVER_S = 0.05  # after an interrupt was dropped in a callback, when it is delivered again


class _State:
    """What the handler, the hook and the watchdog share (one command runs at a time per process)."""

    def __init__(self):
        self.lock = threading.RLock()  # reentrant: the handler may run on the main thread while it reports
        self.interrupted = False  # a Ctrl-C came during the command
        self.redelivering = False  # the hook re-raised a dropped interrupt: the next SIGINT is that one, not a second
        self.reporters: list[Callable[[], str]] = []
        self.reported = False
        self.active = True  # the command's block still runs (the watchdog ends only a command still running)


_state = _State()


@contextlib.contextmanager
def handled(grace_s: float | None = None):
    """Ctrl-C in the block stops the process within ``grace_s`` seconds (default :data:`GRACE_S`). Only the main
    thread can install signal handlers; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _state
    _state = _State()
    grace = GRACE_S if grace_s is None else grace_s
    previous_handler = signal.signal(signal.SIGINT, lambda signum, frame: _on_sigint(grace))
    previous_hook, sys.unraisablehook = sys.unraisablehook, _on_unraisable(sys.unraisablehook)
    try:
        yield
    finally:
        _state.active = False
        signal.signal(signal.SIGINT, previous_handler if previous_handler is not None else signal.default_int_handler)
        sys.unraisablehook = previous_hook


@contextlib.contextmanager
def reporting(message: Callable[[], str]):
    """Within the block, ``message()`` is what an interrupt prints (:func:`report`): what the run has saved."""
    if not _state.reporters:
        _state.reported = False  # a new command (in one process, as tests run them)
    _state.reporters.append(message)
    try:
        yield
    finally:
        _state.reporters.remove(message)


def requested() -> bool:
    """Whether a Ctrl-C came during the running command (the error it ends with may be another one: JAX turns an
    interrupt raised inside a static argument's ``__eq__`` into a ``ValueError``)."""
    return _state.interrupted


def report() -> None:
    """Print the innermost :func:`reporting` message on stderr, once per command (the main thread, or the
    watchdog if the main thread does not get there in time)."""
    with _state.lock:
        if _state.reported or not _state.reporters:
            return
        _state.reported = True
        message = _state.reporters[-1]
    print(message(), file=sys.stderr, flush=True)


def _on_sigint(grace: float) -> None:
    with _state.lock:
        if _state.redelivering:
            _state.redelivering = False
            raise KeyboardInterrupt
        if _state.interrupted:  # a second Ctrl-C: the user will not wait
            _exit_now()
        _state.interrupted = True
    threading.Thread(target=_watchdog, args=(_state, grace), name="fathom-interrupt-watchdog", daemon=True).start()
    raise KeyboardInterrupt


def _on_unraisable(previous):
    def hook(unraisable) -> None:
        if issubclass(unraisable.exc_type, KeyboardInterrupt):
            # Dropped in a gc callback or __del__: deliver it again, a moment later, from another thread (from
            # this one the handler would run at once, inside the callback still), until it lands in plain code.
            threading.Timer(REDELIVER_S, _redeliver).start()
            return
        previous(unraisable)

    return hook


def _redeliver() -> None:
    with _state.lock:
        _state.redelivering = True
    _thread.interrupt_main(signal.SIGINT)


def _watchdog(state: _State, grace: float) -> None:
    # A daemon thread: a process that stops in time ends it too. A command that returned in time is left alone (a
    # caller in the same process, a notebook, goes on); the program's own exit does not wait (cli.app.run).
    time.sleep(grace)
    if state.active:
        _exit_now()


def _exit_now() -> None:
    """Say what was saved (if not said yet) and end the process, not waiting for its threads."""
    try:
        report()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(EXIT_INTERRUPTED)
