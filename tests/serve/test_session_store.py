"""Saved sessions: a damaged, partial or foreign save loads nothing and says why; an interrupted save leaves the
previous one intact."""

import json
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


def test_a_damaged_file_loads_nothing(saved, monkeypatch):
    pool, sid, path = saved
    arrays = path / session_store.ARRAYS
    data = bytearray(arrays.read_bytes())
    leaves = json.loads((path / session_store.MANIFEST).read_text())["leaves"]
    ends = [leaf["offset"] + int(np.prod(leaf["shape"])) * np.dtype(leaf["dtype"]).itemsize for leaf in leaves]
    for at in (0, (leaves[-1]["offset"] + ends[-1]) // 2, max(ends) - 1):  # the first byte, one inside, the last
        flipped = bytearray(data)
        flipped[at] ^= 0xFF
        arrays.write_bytes(bytes(flipped))
        with pytest.raises(SessionFileError, match=f"saved session at {path}: leaf .* fails its checksum"):
            pool.load(path)
    arrays.write_bytes(bytes(data[: len(data) // 3]))  # truncated
    with pytest.raises(SessionFileError, match=f"saved session at {path}: arrays.bin holds .* says .*truncated"):
        pool.load(path)
    monkeypatch.setattr(session_store, "CHUNK", 4096)  # a small chunk: a leaf of many chunks, one damaged
    pool.save(sid, path)
    data = bytearray(arrays.read_bytes())
    data[3 * 4096 + 7] ^= 0x01
    arrays.write_bytes(bytes(data))
    with pytest.raises(SessionFileError, match="fails its checksum"):
        pool.load(path)
    _unchanged(pool, [sid])


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
    manifest = json.loads((path / "session.json").read_text())
    (path / "session.json").write_text(json.dumps({**manifest, "format": 1}))  # an orbax save of the first version
    with pytest.raises(SessionFileError, match="in format 1 .*this version reads format 2"):
        pool.load(path)
    _unchanged(pool, [sid])


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
