"""A churn trace over a session pool, its runner and the options of ``scripts/bench_pool.py`` and ``scripts/soak_pool.py``.

A trace is a list of events over sessions numbered 0..n-1 (each with its own prompt): ``add``, ``steps`` (a decode
burst), ``pause``, ``resume``, ``save`` (a parked session written to disk and dropped from the pool), ``load`` (a saved
one back), ``remove`` (a departure). :func:`churn` draws one from a seed, simulating the slots so that every event is
legal (more sessions than slots: arrivals park while the slots are full); :func:`run` plays it on a pool, timing each
event and sampling memory.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

from fathom_jax.serve import SessionPool


def churn(sessions: int, slots: int, rounds: int, burst: int, seed: int = 0, min_tokens: int | None = None
          ) -> list[dict]:
    """``rounds`` decode bursts of 1..``burst`` steps, each followed by one or two random events; a session departs
    once it decoded ``min_tokens`` (default 3 bursts' worth), and every session left at the end departs."""
    min_tokens = 3 * burst if min_tokens is None else min_tokens
    rng = np.random.default_rng(seed)
    state = {i: "pending" for i in range(sessions)}
    tokens = dict.fromkeys(range(sessions), 0)
    events: list[dict] = []

    def where(status):
        return [i for i, s in state.items() if s == status]

    def place(i):
        state[i] = "active" if len(where("active")) < slots else "parked"

    for i in range(min(slots, sessions)):
        events.append(dict(op="add", session=i))
        place(i)
    for _ in range(rounds):
        n = int(rng.integers(1, burst + 1))
        events.append(dict(op="steps", n=n))
        for i in where("active"):
            tokens[i] += n
        for _ in range(int(rng.integers(1, 3))):
            free = len(where("active")) < slots
            options = {"add": where("pending"), "pause": where("active"), "save": where("parked"),
                       "load": where("saved"), "resume": where("parked") if free else [],
                       "remove": [i for i in where("active") + where("parked") if tokens[i] >= min_tokens]}
            ops = [op for op, who in options.items() if who]
            if not ops:
                continue
            op = ops[int(rng.integers(len(ops)))]
            i = options[op][int(rng.integers(len(options[op])))]
            events.append(dict(op=op, session=i))
            if op in ("add", "load"):
                place(i)
            else:
                state[i] = {"pause": "parked", "save": "saved", "resume": "active", "remove": "done"}[op]
    for i in where("active") + where("parked"):
        events.append(dict(op="remove", session=i))
    return events


def memory() -> dict:
    """Device memory in use (None where the backend reports none) and the bytes of live JAX arrays."""
    stats = jax.local_devices()[0].memory_stats()
    return dict(device_in_use=None if not stats else int(stats.get("bytes_in_use", 0)),
                live_bytes=int(sum(x.nbytes for x in jax.live_arrays())))


def run(pool: SessionPool, events: list[dict], prompts: list, save_dir: str) -> dict:
    """Play ``events`` on ``pool``: each session's tokens (by session number, across saves and loads), a timeline of
    the events (seconds, tokens decoded, memory) and the add / save / load timings."""
    ids: dict[int, int] = {}
    tokens: dict[int, list[int]] = {}
    timeline, adds, saves, loads = [], [], [], []
    session_bytes = pool.memory()["session_bytes"]
    start = time.perf_counter()
    for event in events:
        op, i = event["op"], event.get("session")
        t0 = time.perf_counter()
        decoded = 0
        if op == "add":
            ids[i] = pool.add(prompts[i])
            adds.append(time.perf_counter() - t0)
        elif op == "steps":
            for _ in range(event["n"]):
                decoded += len(pool.step())
        elif op == "pause":
            pool.pause(ids[i])
        elif op == "resume":
            pool.resume(ids[i])
        elif op == "save":
            pool.save(ids[i], os.path.join(save_dir, f"session_{i}"))
            saves.append(time.perf_counter() - t0)
        elif op == "load":
            ids[i] = pool.load(os.path.join(save_dir, f"session_{i}"))
            loads.append(time.perf_counter() - t0)
        elif op != "remove":
            raise ValueError(f"unknown trace event {event!r}")
        if op in ("save", "remove"):  # the session leaves the pool (a saved one comes back by a load)
            tokens[i] = pool.tokens(ids[i])
            pool.remove(ids.pop(i))
        mem = pool.memory()
        timeline.append(dict(op=op, session=i, seconds=time.perf_counter() - t0, at=time.perf_counter() - start,
                             tokens=decoded, steps=event.get("n", 0), parked=mem["host"]["parked"],
                             host_bytes=mem["host"]["pool"] + mem["host"]["parked_bytes"],
                             hbm_bytes=mem["hbm"]["pool"], **memory()))
    for i, sid in ids.items():
        tokens[i] = pool.tokens(sid)
    return dict(tokens=tokens, timeline=timeline, add_s=adds, save_s=saves, load_s=loads,
                session_bytes=session_bytes, step_compiles=pool.step_compiles())


def warm_up(pool: SessionPool, prompt, save_dir: str) -> None:
    """Every program a trace runs compiled once (prefill, step, the slot moves, a save and a load), the pool left
    empty."""
    sid = pool.add(prompt)
    pool.step()
    pool.pause(sid)
    pool.resume(sid)
    pool.step()
    pool.pause(sid)
    path = os.path.join(save_dir, "warm_up")
    pool.save(sid, path)
    pool.remove(sid)
    pool.remove(pool.load(path))


def lone_tokens(pool: SessionPool, prompt, count: int) -> list[int]:
    """``count`` tokens of ``prompt`` decoded alone and uninterrupted in ``pool`` (emptied by the caller first)."""
    sid = pool.add(prompt)
    while len(pool.tokens(sid)) < count:
        pool.step()
    out = pool.tokens(sid)
    pool.remove(sid)
    return out


def add_options(ap: argparse.ArgumentParser, *, prompt_tokens: int, slots: int, sessions: int, burst: int, method: str,
                k: int, rows: str) -> None:
    """The options ``bench_pool`` and ``soak_pool`` share (the defaults theirs): the sessions, the pool, the trace's
    bursts, the method, the rows, the seed, where saves and results go."""
    for flag, default in (("--prompt-tokens", prompt_tokens), ("--slots", slots), ("--sessions", sessions),
                          ("--burst", burst)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--method", default=method)
    ap.add_argument("--k", type=int, default=k)
    ap.add_argument("--rows", default=rows, help="K/V row format (model: the model dtype)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-dir", default=None, help="where saves go (default: the system's temporary directory)")
    ap.add_argument("--out", default="results")


def parse(ap: argparse.ArgumentParser, argv, counts: tuple[str, ...]) -> argparse.Namespace:
    """``ap.parse_args(argv)``, each option named in ``counts`` (a dest) at least 1."""
    args = ap.parse_args(argv)
    for name in counts:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args
