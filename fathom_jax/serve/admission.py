"""Admission: what a pool and each of its sessions take in host memory and HBM, checked before anything is allocated.

Every session of a pool has the same bytes (one slot of the pool's cache: :func:`fathom_jax.serve.slots.slot_bytes`,
by kind). The pool's cache is allocated once; a session then needs, for a moment, one slot's worth of device memory
(its prefill, or a saved session on its way into a slot) and, while parked, one slot's worth of host memory. A
request that does not fit raises :class:`AdmissionError` naming the memory that is short, by how much, and what holds
the rest; the pool is unchanged.
"""

from __future__ import annotations

import dataclasses

import jax

from fathom_jax.placement import host_memory, host_memory_available

GiB = 1 << 30


class AdmissionError(ValueError):
    """A session (or a pool) that would not fit in the memory left; nothing was allocated."""


def _fmt(n: int) -> str:
    return f"{n / GiB:.3f} GiB" if n >= (1 << 24) else f"{n} bytes"


def _kinds(by_kind: dict[str, int]) -> str:
    return ", ".join(f"{kind} {_fmt(size)}" for kind, size in sorted(by_kind.items()) if size)


def short_message(where: str, memory: str, need: int, free: int, budget: int, what: str, kinds: dict[str, int],
                  held: str) -> str:
    return (f"{where}: {memory} is short by {_fmt(need - free)}: {what} needs {_fmt(need)} ({_kinds(kinds)}); "
            f"{_fmt(max(free, 0))} of the {_fmt(budget)} {memory} budget is free ({held})")


def free_device_bytes(fraction: float = 0.9) -> int | None:
    """``fraction`` of the first local device's free memory, where the backend reports it (None on CPU): the rest is
    left to what the ledger does not count (a prefill's activations, the step's temporaries)."""
    stats = jax.local_devices()[0].memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))


@dataclasses.dataclass
class Budget:
    """The pool's memory ledger: one slot's bytes (``session``: ``{"host": {kind: n}, "hbm": {kind: n}}``), the
    slots, the budgets (None: unchecked) and the parked sessions."""

    session: dict[str, dict[str, int]]
    slots: int
    host: int | None
    hbm: int | None
    parked: set = dataclasses.field(default_factory=set)

    @classmethod
    def make(cls, config, session: dict[str, dict[str, int]]) -> "Budget":
        host = config.host_bytes
        if host is None:
            phys = host_memory.physical_bytes()
            host = None if phys is None else int(0.8 * phys)
            if host_memory_available():  # parked sessions are pinned: XLA's pinned allocator has its own cap
                cap = int(0.8 * host_memory.limit_gib() * GiB)
                host = cap if host is None else min(host, cap)
        hbm = config.hbm_bytes if config.hbm_bytes is not None else free_device_bytes()
        return cls(session=session, slots=config.slots, host=host, hbm=hbm)

    @property
    def session_total(self) -> int:
        return sum(sum(k.values()) for k in self.session.values())

    def pool_bytes(self, memory: str) -> int:
        return self.slots * sum(self.session[memory].values())

    def _check(self, where, memory, need, used, what, kinds, held):
        budget = self.host if memory == "host" else self.hbm
        if budget is not None and used + need > budget:
            raise AdmissionError(short_message(where, memory, need, budget - used, budget, what, kinds, held))

    def admit_pool(self, where: str) -> None:
        for memory in ("host", "hbm"):
            kinds = {k: self.slots * v for k, v in self.session[memory].items()}
            self._check(where, memory, self.pool_bytes(memory), 0, f"a cache of {self.slots} slots", kinds,
                        "nothing else is counted")

    def admit_session(self, where: str, *, parked: bool) -> None:
        """A session's way in: one slot's bytes in device memory for a moment; and, if ``parked``, in host memory."""
        flat = {k: v for kinds in self.session.values() for k, v in kinds.items()}
        held = f"the pool's cache holds {_fmt(self.pool_bytes('hbm'))}"
        self._check(where, "hbm", self.session_total, self.pool_bytes("hbm"), "one session on its way in", flat, held)
        if parked:
            used = self.pool_bytes("host") + len(self.parked) * self.session_total
            held = f"{len(self.parked)} parked sessions hold {_fmt(len(self.parked) * self.session_total)}"
            self._check(where, "host", self.session_total, used, "one parked session", flat, held)

    def park(self, sid: int) -> None:
        self.parked.add(sid)

    def unpark(self, sid: int) -> None:
        self.parked.discard(sid)

    def report(self, parked: int) -> dict:
        return dict(session=self.session, session_bytes=self.session_total,
                    host=dict(budget=self.host, pool=self.pool_bytes("host"), parked=parked,
                              parked_bytes=len(self.parked) * self.session_total),
                    hbm=dict(budget=self.hbm, pool=self.pool_bytes("hbm")))
