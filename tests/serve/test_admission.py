"""Admission: a pool or a session that would not fit is refused before anything is allocated, naming the memory that
is short and by how much; the sessions already there decode on unchanged."""

import jax
import pytest

from fathom_jax.serve import AdmissionError, PoolConfig, SessionPool
from fathom_jax.serve.admission import Budget
from tests.serve.conftest import CAPACITY, PROMPTS

SESSION = {"host": {"kv": 300}, "hbm": {"planes_hbm": 50, "small": 10}}


def test_the_ledger_names_the_memory_short_and_by_how_much():
    budget = Budget(session=SESSION, slots=2, host=1000, hbm=200)
    with pytest.raises(AdmissionError, match=r"hbm is short by 60 bytes: a cache of 2 slots needs 120 bytes "
                                             r"\(planes_hbm 100 bytes, small 20 bytes\)"):
        Budget(session=SESSION, slots=2, host=1000, hbm=60).admit_pool("pool")
    budget.admit_pool("pool")  # host 600 of 1000, hbm 120 of 200
    with pytest.raises(AdmissionError, match=r"add: hbm is short by 280 bytes: one session on its way in needs 360"):
        budget.admit_session("add", parked=False)
    budget.hbm = None  # unchecked
    budget.admit_session("add", parked=True)
    budget.park(1)
    with pytest.raises(AdmissionError, match=r"add: host is short by 320 bytes: one parked session needs 360 bytes.*"
                                             r"1 parked sessions hold 360 bytes"):
        budget.admit_session("add", parked=True)
    budget.unpark(1)
    budget.admit_session("add", parked=True)


def test_a_refused_session_leaves_the_pool_as_it_was(tiny_model, attention, lone_tokens):
    one = SessionPool(tiny_model, attention, PoolConfig(slots=2, capacity=CAPACITY)).memory()["session_bytes"]
    pool = SessionPool(tiny_model, attention, PoolConfig(slots=2, capacity=CAPACITY, host_bytes=one + one // 2))
    a, b = pool.add(PROMPTS[0]), pool.add(PROMPTS[1])
    pool.step()
    c = pool.add(PROMPTS[2])  # parked: room for one
    live = len(jax.live_arrays())
    with pytest.raises(AdmissionError, match=r"SessionPool.add: host is short by .*\(1 parked sessions hold"):
        pool.add(PROMPTS[2])
    with pytest.raises(AdmissionError, match=r"SessionPool.pause: host is short by"):
        pool.pause(a)
    assert len(jax.live_arrays()) == live and sorted(pool.sessions) == [a, b, c] and pool.session(a).slot == 0
    for _ in range(11):
        pool.step()
    assert pool.tokens(a) == lone_tokens[0] and pool.tokens(b) == lone_tokens[1]


def test_a_pool_larger_than_its_device_budget_is_refused_before_allocating(tiny_model, attention):
    live = len(jax.live_arrays())
    with pytest.raises(AdmissionError, match=r"SessionPool: hbm is short by .* a cache of 4 slots needs"):
        SessionPool(tiny_model, attention, PoolConfig(slots=4, capacity=CAPACITY, hbm_bytes=1000))
    assert len(jax.live_arrays()) == live
