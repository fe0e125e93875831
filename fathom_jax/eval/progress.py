"""Progress of the long runs (``fathom sweep``, ``ruler``, ``agreement``): an ETA from the first finished unit,
with compile time reported apart.

A plain rate (units over elapsed time) counts the minute before the first unit finishes, and every first call
of a program that compiles, as if each unit took that long: the sweep's bar showed 22-33 hours for a run of
2-3 minutes. Here the clock of the ETA starts at the first finished unit. With ``sequential=True`` (the
programs compile on the thread that runs the units: the downstream sweeps) the seconds JAX reports compiling
(``jax.monitoring``'s lowering and backend-compile events) are taken out of each unit's time and shown apart,
and the programs still to compile (``keys`` not yet seen) are added at the mean compile time per program seen
so far. Otherwise (the study compiles on a background thread, overlapping the units) the ETA is the remaining
units at the mean wall time per unit since the first finished one.

Before the first unit (a minute or more of compiling and set-up) and during long units, the bar redraws every
``TICK_S`` seconds from a background thread, so its clock moves, and says what the run is doing: :meth:`Progress.phase`
names the step under way ("dense attention", "decoding ..."), ``status`` adds what it waits for (the study: the
programs still compiling).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import jax

TICK_S = 1.0  # how often the bar redraws between units
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration", "/jax/core/compile/backend_compile_duration")


class Progress:
    """A tqdm bar over ``total`` units (``done`` of them already finished by an earlier run) with an honest ETA.

    Thread-safe: :meth:`update` may be called from worker threads. ``enabled=False`` draws nothing but still
    counts (:attr:`compile_s`, :attr:`eta_s`)."""

    def __init__(self, total: int, desc: str, *, unit: str = "unit", done: int = 0, keys: int = 0,
                 sequential: bool = True, enabled: bool = True, status: Callable[[], str] | None = None):
        self.total, self.done, self.keys, self.sequential = total, done, keys, sequential
        self.unit, self.status = unit, status
        self.compile_s = 0.0
        self._lock = threading.Lock()
        self._seen: set = set()
        self._new_key_compile = 0.0  # compile seconds of the units that were a key's first
        self._run_s = 0.0  # sequential: unit seconds less their compiles
        self._units = 0  # units finished by this run
        self._first: float | None = None  # when this run's first unit finished
        self._last = time.perf_counter()
        self._compile_at_last = 0.0
        self._label = ""
        self._phase = ""
        self._closed = threading.Event()
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=done, desc=desc, unit=unit,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
            self._bar.set_postfix_str(self.postfix(), refresh=True)
            threading.Thread(target=self._tick, name=f"progress-{desc}", daemon=True).start()

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event in _COMPILE_EVENTS:
            with self._lock:
                self.compile_s += duration

    @property
    def eta_s(self) -> float | None:
        """Seconds left (None until this run's first unit finishes)."""
        with self._lock:
            return self._eta()

    def _eta(self) -> float | None:
        if self._first is None:
            return None
        left = self.total - self.done
        if self.sequential:
            new_keys = len(self._seen)
            pending = max(self.keys - new_keys, 0) * (self._new_key_compile / new_keys if new_keys else 0.0)
            return left * self._run_s / self._units + pending
        if self._units <= 1:
            return None
        return left * (time.perf_counter() - self._first) / (self._units - 1)

    def phase(self, text: str) -> None:
        """What the run does now ("dense attention", "decoding Fathom 48 @ 128"; "" when it runs units): shown
        until the next phase, and redrawn at once."""
        with self._lock:
            self._phase = text
        self._redraw()

    def postfix(self) -> str:
        """The text after the bar: the phase, what the run waits for, the ETA, the compile time so far."""
        with self._lock:
            eta = self._eta()
            compile_s, first, phase, label = self.compile_s, self._first, self._phase, self._label
        status = self.status() if self.status is not None else ""
        if first is None:
            when = "ETA after the first " + self.unit
        else:
            when = "ETA " + ("after the next unit" if eta is None else _clock(eta))
        parts = [phase, status, when, f"compiling {_clock(compile_s)} so far" if compile_s or first else ""]
        if label and not phase:
            parts.append(label)
        return ", ".join(p for p in parts if p)

    def _redraw(self) -> None:
        if self._bar is not None and not self._closed.is_set():
            self._bar.set_postfix_str(self.postfix(), refresh=True)

    def _tick(self) -> None:
        # tqdm redraws only when a unit finishes: without this the clock stood still for the first minute.
        while not self._closed.wait(TICK_S):
            self._redraw()

    def set_postfix_str(self, label: str, refresh: bool = False) -> None:
        """The name of the unit running now (tqdm's API, as the study's workers call it)."""
        with self._lock:
            self._label = label

    def update(self, n: int = 1, key=None) -> None:
        """``n`` units finished; ``key`` names the program they ran (sequential mode: its first units compile)."""
        with self._lock:
            now = time.perf_counter()
            compiled = self.compile_s - self._compile_at_last
            self._compile_at_last = self.compile_s
            if key is not None and key not in self._seen:
                self._seen.add(key)
                self._new_key_compile += compiled
            self._run_s += max(now - self._last - compiled, 0.0)
            self._last = now
            self._units += n
            self.done += n
            if self._first is None:
                self._first = now
        if self._bar is not None:
            self._bar.set_postfix_str(self.postfix(), refresh=False)
            self._bar.update(n)

    def close(self) -> None:
        self._closed.set()
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"
