"""A pool of decode sessions over one model and one sparse attention: a fixed number of slots, sessions that join,
pause, resume and leave without compiling the step again.

    pool = SessionPool(model, decode.from_spec("fathom:48", k=512), PoolConfig(slots=4, capacity=32768))
    a = pool.add(prompt_ids)          # prefilled alone, into a free slot (or parked in host memory if none is free)
    out = pool.step()                 # {session id: its new token} for every session in a slot: one compiled program
    pool.pause(a); pool.save(a, path) # parked in host memory; written to disk (fathom_jax.serve.session_store)
    b = pool.load(path)               # back, as a new session that decodes exactly what ``a`` would have

The pool's cache is a :class:`~fathom_jax.decode.SparseCache` of ``slots`` sequences, made once where the attention's
placement puts it (its bulk arrays in ``pinned_host`` memory too: sessions then move by kernels, see
:mod:`fathom_jax.serve.slots`). A step feeds every
slot and masks the free ones: their lengths enter the step as 0 and leave it unchanged, and what the step writes in
a free slot is overwritten whole when a session moves in (:mod:`fathom_jax.serve.slots`). Sequences never mix in a
step, so an active session's tokens do not depend on what the other slots hold. What the model keeps of its own per
sequence (Gemma 3's window rings: ``model.split_state``'s first part) is one more tree of ``slots`` sequences in
device memory, moved, parked and saved with each session's cache.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int

from fathom_jax.decode.cache import SparseCache
from fathom_jax.decode.hook import SparseAttention
from fathom_jax.format import round_capacity
from fathom_jax.models import generation
from fathom_jax.serve import session_store
from fathom_jax.serve import slots as slots_lib
from fathom_jax.serve.admission import AdmissionError, Budget

PROMPT_BUCKET = 64  # prompts are right-padded to a multiple of this: a prefill program per bucket, not per length


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """``slots``: sessions decoded per step; ``capacity``: tokens per session (prompt and generated);
    ``host_bytes``: host memory for parked sessions (None: 80% of the machine's, and
    of XLA's pinned-memory cap where parked sessions are pinned); ``hbm_bytes``: device memory for
    the pool's cache and one prefill (None: 90% of the device's free memory where it reports it, else
    unchecked)."""

    slots: int
    capacity: int
    host_bytes: int | None = None
    hbm_bytes: int | None = None

    def __post_init__(self):
        for name in ("slots", "capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PoolConfig: {name} must be an int >= 1, got {value!r}")
        for name in ("host_bytes", "hbm_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"PoolConfig: {name} must be None or an int >= 0, got {value!r}")


@dataclasses.dataclass
class Session:
    """One session: its prompt length, the tokens it generated (the last is the next step's input), and where its
    cache is: a ``slot`` of the pool, or ``parked`` in host memory (a tree of one sequence; the model's own state of
    it, if the model keeps one, in ``parked_state``)."""

    id: int
    prompt_length: int
    tokens: list[int]
    slot: int | None = None
    parked: SparseCache | None = None
    parked_state: Any = None

    @property
    def length(self) -> int:
        """Tokens in its cache (the prompt and every generated token but the last)."""
        return self.prompt_length + len(self.tokens) - 1


def _pool_step_fn(graphdef, attention: SparseAttention, params, tokens, active, own, cache: SparseCache):
    """One greedy step of every slot; free slots (``active`` False) enter at length 0 and keep their lengths (the
    model's own state of a free slot is whatever the step leaves: a session moving in overwrites it whole)."""
    model = nnx.merge(graphdef, params)
    groups = jnp.repeat(active, cache.groups // cache.batch)[None]
    index = cache.index
    masked = dataclasses.replace(cache, length=jnp.where(active, cache.length, 0),
                                 index=dataclasses.replace(index, length=jnp.where(groups, index.length, 0)))
    (nxt, _), state = generation.greedy_step(model, attention, tokens, model.join_state(own, masked))
    own, out = model.split_state(state)
    out = dataclasses.replace(out, length=jnp.where(active, out.length, cache.length),
                              index=dataclasses.replace(out.index, length=jnp.where(groups, out.index.length,
                                                                                    index.length)))
    return (nxt, own), out


class SessionPool:
    """Sessions decoded together in ``config.slots`` slots of one compiled step (see the module docstring)."""

    def __init__(self, model, attention: SparseAttention, config: PoolConfig):
        if not isinstance(attention, SparseAttention):
            raise TypeError(f"SessionPool: attention must be a decode.SparseAttention, got {type(attention).__name__}")
        if not isinstance(config, PoolConfig):
            raise TypeError(f"SessionPool: config must be a PoolConfig, got {type(config).__name__}")
        self.model, self.config = model, config
        self._graphdef, self._params = nnx.split(model)
        self._unbound = attention
        shape = model.cache_shape(config.slots, config.capacity)
        self.attention = attention.bind(shape)
        self.heads = shape.kv_heads
        self._moves = (self.attention.placement, self.attention.resolved_implementation)
        slots_lib.check_moves(*self._moves)  # a placement the slot moves cannot serve fails before any allocation
        template = jax.eval_shape(lambda: model.split_state(model.init_state(self.attention, config.slots,
                                                                             config.capacity)))
        self._axes = None if template[0] is None else slots_lib.own_axes(template[0], config.slots)
        per_slot = slots_lib.slot_bytes(template[1], config.slots, attention.placement,
                                         model_state=template[0])
        self.budget = Budget.make(config, per_slot)
        self.budget.admit_pool("SessionPool")  # before the cache is allocated
        own, cache = model.split_state(model.init_state(self.attention, config.slots, config.capacity))
        slots_lib.check_layout(cache)
        self._cache = self.attention.start_decode(cache, np.zeros(config.slots, np.int32))
        self._own = own
        self._run = self.attention.program(_pool_step_fn, self._cache, static=(self._graphdef,),
                                           options=generation.decode_compiler_options())
        self._compiled_before = self._run.jit._cache_size()  # programs of this layout other pools compiled
        self._slots: list[int | None] = [None] * config.slots
        self._sessions: dict[int, Session] = {}
        self._ids = itertools.count()

    # -- what the pool holds ------------------------------------------------------------------
    @property
    def sessions(self) -> dict[int, Session]:
        return dict(self._sessions)

    def session(self, sid: int) -> Session:
        if sid not in self._sessions:
            raise KeyError(f"SessionPool: no session {sid!r} (sessions: {sorted(self._sessions)})")
        return self._sessions[sid]

    def tokens(self, sid: int) -> list[int]:
        """Every token the session generated so far."""
        return list(self.session(sid).tokens)

    @property
    def cache(self) -> SparseCache:
        """The pool's stacked cache (every slot; the next step donates it)."""
        return self._cache

    @property
    def free_slots(self) -> int:
        return self._slots.count(None)

    def memory(self) -> dict:
        """Bytes by where they live: the pool's cache, the parked sessions, the budgets, and one session by kind."""
        return self.budget.report(parked=sum(s.parked is not None for s in self._sessions.values()))

    def step_compiles(self) -> int:
        """Step programs this pool compiled: 1 once it stepped (0 if an earlier pool of the same layout did); joins
        and leaves never add one."""
        return self._run.jit._cache_size() - self._compiled_before

    # -- sessions in and out ------------------------------------------------------------------
    def add(self, prompt: Int[Array, "T"]) -> int:
        """Prefill a session from ``prompt [T]`` (alone, with its own statistics) into a free slot, or park it in host
        memory when every slot is taken; returns its id. Refused (:class:`AdmissionError`) before any work when the
        memory it needs is not there."""
        prompt = np.asarray(prompt)
        if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"SessionPool.add: prompt must be a non-empty 1-D array of token ids, got {prompt.dtype} "
                             f"{prompt.shape}")
        t = prompt.size
        if t + 1 > self.config.capacity:
            raise ValueError(f"SessionPool.add: prompt of {t} tokens leaves no room for a new one in the capacity "
                             f"{self.config.capacity}")
        parked = self.free_slots == 0
        self.budget.admit_session("SessionPool.add", parked=parked)
        padded = min(-(-t // PROMPT_BUCKET) * PROMPT_BUCKET, round_capacity(self.config.capacity))
        ids = np.zeros((1, padded), np.int32)
        ids[0, :t] = prompt
        logits, state, _ = generation.prefill(self.model, ids, np.array([t], np.int32), self._unbound,
                                              self.config.capacity)
        own, cache = self.model.split_state(state)
        one = (own, slots_lib.session_of(cache))
        session = Session(next(self._ids), t, [int(np.asarray(generation.first_token(logits))[0])])
        self._sessions[session.id] = session
        self._place(session, one, parked)
        return session.id

    def pause(self, sid: int) -> None:
        """Free the session's slot; its cache moves to host memory."""
        session = self.session(sid)
        if session.slot is None:
            return
        self.budget.admit_session("SessionPool.pause", parked=True)
        slot = jnp.int32(session.slot)
        own = None if self._axes is None else slots_lib.extract_own(self._own, slot, axes=self._axes)
        self._park(session, (own, slots_lib.extract(self._cache, session.slot, self.heads, *self._moves)))

    def resume(self, sid: int) -> None:
        """Move a parked session back into a free slot (:class:`AdmissionError` when none is free)."""
        session = self.session(sid)
        if session.slot is not None:
            return
        if self.free_slots == 0:
            raise AdmissionError(f"SessionPool.resume: no free slot for session {sid} (all {self.config.slots} slots "
                                 "are taken): pause or remove a session first")
        self.budget.admit_session("SessionPool.resume", parked=False)
        self._place(session, (session.parked_state, session.parked), parked=False)  # _place moves it to the device
        session.parked = session.parked_state = None  # only once in its slot: a failed move keeps the parked copy
        self.budget.unpark(session.id)

    def remove(self, sid: int) -> None:
        """Forget the session and free its slot or its host memory."""
        session = self.session(sid)
        if session.slot is not None:
            self._free(session.slot)
        self.budget.unpark(session.id)
        del self._sessions[sid]

    # -- decoding -------------------------------------------------------------------------------
    def step(self) -> dict[int, int]:
        """One token for every session in a slot, in one compiled program: ``{session id: its new token}``. A
        session whose cache is full is parked first (it can be saved or removed, not decoded; an
        :class:`AdmissionError` if host memory cannot take it, before anything is decoded)."""
        for session in list(self._sessions.values()):
            if session.slot is not None and session.length + 1 > self.config.capacity:
                self.pause(session.id)
        active = np.array([s is not None for s in self._slots])
        if not active.any():
            return {}
        tokens = np.array([0 if s is None else self._sessions[s].tokens[-1] for s in self._slots], np.int32)
        (nxt, self._own), self._cache = self._run(self._params, tokens, active, self._own, cache=self._cache)
        nxt = np.asarray(nxt)
        out = {}
        for slot, sid in enumerate(self._slots):
            if sid is not None:
                self._sessions[sid].tokens.append(int(nxt[slot]))
                out[sid] = int(nxt[slot])
        return out

    # -- disk -----------------------------------------------------------------------------------
    def save(self, sid: int, path: str | os.PathLike) -> None:
        """Write a paused session to ``path`` (a directory; an earlier save there is replaced only once this one is
        complete)."""
        session = self.session(sid)
        if session.parked is None:
            raise ValueError(f"SessionPool.save: session {sid} is in slot {session.slot}; pause it first")
        if self._axes is not None and session.parked_state is None:
            raise ValueError(f"SessionPool.save: session {sid} has no model state, which {type(self.model).__name__} "
                             "keeps beside the cache: it cannot be decoded again from the cache alone")
        session_store.save(path, self._saved(session.parked_state, session.parked), tokens=session.tokens,
                           prompt_length=session.prompt_length, signature=self._signature())

    def load(self, path: str | os.PathLike) -> int:
        """A saved session back in this pool (a free slot, else parked), as a new id. The file is checked whole
        first: a damaged or foreign one raises :class:`~fathom_jax.serve.session_store.SessionFileError` and
        changes nothing."""
        template = slots_lib.session_template(self._cache, self.heads)
        if self._axes is not None:
            own = jax.eval_shape(lambda o: slots_lib.extract_own(o, jnp.int32(0), axes=self._axes), self._own)
            template = self._saved(own, template)
        parked = self.free_slots == 0
        self.budget.admit_session("SessionPool.load", parked=parked)
        saved, meta = session_store.load(path, template, signature=self._signature())
        one = (saved[session_store.MODEL_STATE], saved["cache"]) if self._axes is not None else (None, saved)
        if meta["prompt_length"] + len(meta["tokens"]) - 1 > self.config.capacity:
            raise session_store.SessionFileError(f"session at {path} holds more tokens than the capacity "
                                                 f"{self.config.capacity}")
        session = Session(next(self._ids), meta["prompt_length"], list(meta["tokens"]))
        self._sessions[session.id] = session
        self._place(session, one, parked)
        return session.id

    # -- internals ------------------------------------------------------------------------------
    def _signature(self) -> dict:
        """What a saved session must match to load here: the model's shape and the attention's layout."""
        return dict(model=repr(self.model.config), attention=self._unbound.label, heads=self.heads,
                    capacity=round_capacity(self.config.capacity))

    @staticmethod
    def _saved(own, cache):
        """What a save holds: the cache alone, or with the model's own state (its leaves then named apart)."""
        return cache if own is None else {"cache": cache, session_store.MODEL_STATE: own}

    def _place(self, session: Session, one: tuple[Any, SparseCache], parked: bool) -> None:
        """``one``: ``(the model's own state or None, the cache)`` of the session."""
        if parked:
            self._park(session, one)
            return
        slot = self._slots.index(None)
        own, cache = slots_lib.to_device(one, self.attention.placement)
        self._cache = slots_lib.insert(self._cache, cache, slot, *self._moves)
        if self._axes is not None:
            self._own = slots_lib.insert_own(self._own, own, jnp.int32(slot), axes=self._axes)
        self._slots[slot], session.slot = session.id, slot

    def _park(self, session: Session, one: tuple[Any, SparseCache]) -> None:
        session.parked_state, session.parked = slots_lib.to_host(one, self.attention.placement)
        self.budget.park(session.id)
        if session.slot is not None:
            self._free(session.slot)
            session.slot = None

    def _free(self, slot: int) -> None:
        self._cache = slots_lib.clear(self._cache, slot)
        self._slots[slot] = None

