"""Saved sessions: a damaged, partial or foreign save loads nothing and says why; an interrupted save leaves the
previous one intact."""

import os

import numpy as np
import pytest

from fathom_jax.serve import PoolConfig, SessionFileError, SessionPool
from fathom_jax.serve import session_store
from tests.serve.conftest import CAPACITY, PROMPTS


@pytest.fixture
def saved(tiny_model, attention, tmp_path):
    pool = SessionPool(tiny_model, attention, PoolConfig(slots=1, capacity=CAPACITY))
    sid = pool.add(PROMPTS[1])
    for _ in range(3):
        pool.step()
    pool.pause(sid)
    pool.save(sid, tmp_path / "s")
    return pool, sid, tmp_path / "s"


def _unchanged(pool, before):
    assert sorted(pool.sessions) == before and pool.free_slots == 1


def test_a_saved_session_loads_bit_for_bit(saved):
    pool, sid, path = saved
    back = pool.load(path)
    assert pool.tokens(back) == pool.tokens(sid)
    pool.pause(back)
    for x, y in zip(*(session_store._leaves(pool.session(s).parked) for s in (sid, back))):
        np.testing.assert_array_equal(np.asarray(x[1]), np.asarray(y[1]))


# orbax's restore of damaged data fails in its async worker, whose event loop closes with a callback pending
ORBAX_CLOSED_LOOP = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@ORBAX_CLOSED_LOOP
def test_a_damaged_file_loads_nothing(saved):
    pool, sid, path = saved
    biggest = max((os.path.join(d, f) for d, _, fs in os.walk(path / "arrays") for f in fs), key=os.path.getsize)
    data = bytearray(open(biggest, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(biggest, "wb").write(bytes(data))
    with pytest.raises(SessionFileError, match=f"saved session at {path}"):
        pool.load(path)
    open(biggest, "wb").write(bytes(data[: len(data) // 3]))  # truncated
    with pytest.raises(SessionFileError, match=f"saved session at {path}"):
        pool.load(path)
    _unchanged(pool, [sid])


@ORBAX_CLOSED_LOOP
def test_a_partial_or_foreign_save_loads_nothing(saved, tiny_model, attention, tmp_path):
    pool, sid, path = saved
    os.makedirs(tmp_path / "partial" / "arrays")
    with pytest.raises(SessionFileError, match="no saved session .* a save that never finished"):
        pool.load(tmp_path / "partial")
    (path / "session.json").write_text('{"tokens": [1, 2')
    with pytest.raises(SessionFileError, match="damaged session.json"):
        pool.load(path)
    _unchanged(pool, [sid])
    other = SessionPool(tiny_model, attention, PoolConfig(slots=1, capacity=2 * CAPACITY))
    pool.save(sid, path)
    with pytest.raises(SessionFileError, match="another pool layout"):
        other.load(path)


def test_an_interrupted_save_leaves_the_previous_one(saved, monkeypatch):
    pool, sid, path = saved
    pool.resume(sid)
    pool.step()
    pool.pause(sid)

    def interrupted(tmp, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(session_store, "_replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.save(sid, path)
    monkeypatch.undo()
    assert sorted(os.listdir(path.parent)) == ["s"]  # the temporary directory went with the interrupted save
    back = pool.load(path)
    assert pool.tokens(back) == pool.tokens(sid)[:-1]  # the earlier save, one token shorter
