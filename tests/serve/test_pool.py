"""SessionPool on the tiny decoder (CPU): sessions joining, pausing, saved and loaded, leaving, decode exactly what
they decode alone; the step compiles once; bad requests fail by name before any work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax import decode
from fathom_jax.serve import PoolConfig, SessionPool
from scripts import pool_trace
from tests.serve.conftest import CAPACITY, PROMPTS, decode_alone


def _pool(model, attention, slots=2, **kw):
    return SessionPool(model, attention, PoolConfig(slots=slots, capacity=CAPACITY, **kw))


def swap_slots_through_a_save(pool, a, b, path, *, step=True) -> int:
    """Paused session ``a`` (slot 0) saved and removed, a step (``step``), ``b`` (slot 1) paused and resumed into the
    slot ``a`` left, ``a`` loaded into ``b``'s: returns ``a``'s new id, each checked in the other's slot."""
    pool.save(a, path)
    pool.remove(a)
    if step:
        pool.step()
    pool.pause(b)
    pool.resume(b)
    a = pool.load(path)
    assert (pool.session(a).slot, pool.session(b).slot) == (1, 0)  # each in the other's slot
    return a


def test_a_session_in_the_pool_decodes_what_it_decodes_alone(tiny_model, attention, lone_tokens):
    pool = _pool(tiny_model, attention)
    sid = pool.add(PROMPTS[0])
    streamed = [pool.tokens(sid)[0]]
    for _ in range(12):
        out = pool.step()
        assert list(out) == [sid]
        streamed.append(out[sid])
    assert streamed == pool.tokens(sid) == lone_tokens[0]


def test_pause_save_load_and_churn_change_nothing_bit_for_bit(tiny_model, attention, lone_tokens, tmp_path):
    pool = _pool(tiny_model, attention)
    a = pool.add(PROMPTS[0])
    for _ in range(12):
        pool.step()
    pool.pause(a)
    alone = pool.session(a).parked  # the uninterrupted session's whole cache after 12 steps
    pool.remove(a)

    a = pool.add(PROMPTS[0])
    b = pool.add(PROMPTS[1])
    for _ in range(4):
        pool.step()
    compiled = pool.step_compiles()  # 1, or 0 where an earlier test's pool of this layout compiled the step
    pool.pause(a)
    pool.save(a, tmp_path / "a")
    pool.remove(a)
    c = pool.add(PROMPTS[2])  # takes a's slot, then leaves
    pool.step()
    pool.step()
    pool.remove(b)
    a = pool.load(tmp_path / "a")
    assert pool.session(a).slot == 1
    pool.step()
    pool.pause(a)
    pool.step()
    assert pool.tokens(c) == lone_tokens[2][:5]
    pool.remove(c)
    pool.resume(a)  # into the other slot
    assert pool.session(a).slot == 0
    for _ in range(7):
        pool.step()
    assert pool.tokens(a) == lone_tokens[0]
    pool.pause(a)
    resumed = pool.session(a).parked
    for x, y in zip(jax.tree.leaves(alone), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert pool.step_compiles() == compiled <= 1  # joins, leaves, pauses and loads never compiled it again


# a KLT basis in the session statistics; a selection shared across layers (its carry through the pool's step)
@pytest.mark.parametrize("spec,rows", [("fathom_klt:32", "k8v8"), ("sparq:4@share=0@budget=44", None)])
def test_other_methods_and_row_formats_move_between_slots_exactly(tiny_model, spec, rows):
    pool = _pool(tiny_model, decode.from_spec(spec, k=40, rows=rows))
    a, b = pool.add(PROMPTS[0]), pool.add(PROMPTS[1])
    for _ in range(3):
        pool.step()
    pool.pause(a)
    pool.pause(b)
    pool.resume(b)
    pool.resume(a)  # each in the other's slot
    assert (pool.session(a).slot, pool.session(b).slot) == (1, 0)
    for _ in range(3):
        pool.step()
    got = pool.tokens(a), pool.tokens(b)
    pool.remove(a)
    pool.remove(b)
    assert got == tuple(pool_trace.lone_tokens(pool, p, 7) for p in PROMPTS[:2])


def test_more_sessions_than_slots_park_and_a_full_session_leaves_its_slot(tiny_model, attention):
    pool = _pool(tiny_model, attention)
    long = np.resize(PROMPTS[2], CAPACITY - 16)  # full after 16 steps
    a, b, c = pool.add(long), pool.add(PROMPTS[1]), pool.add(PROMPTS[0])
    assert pool.session(a).slot == 0 and pool.session(c).parked is not None and pool.free_slots == 0
    with pytest.raises(ValueError, match="no free slot"):
        pool.resume(c)
    while pool.session(a).slot is not None:
        pool.step()
    assert pool.session(a).length == CAPACITY and len(pool.tokens(a)) == 17  # decoded to the last token, then parked
    pool.resume(c)
    assert sorted(pool.step()) == [b, c] and pool.memory()["host"]["parked"] == 1


def test_bad_requests_fail_by_name_before_any_work(tiny_model, attention, tmp_path):
    pool = _pool(tiny_model, attention)
    with pytest.raises(ValueError, match="prompt must be a non-empty 1-D"):
        pool.add(np.zeros((0,), np.int32))
    with pytest.raises(ValueError, match="capacity 256"):
        pool.add(np.zeros((CAPACITY,), np.int32))
    with pytest.raises(KeyError, match="no session 7"):
        pool.pause(7)
    sid = pool.add(PROMPTS[1])
    with pytest.raises(ValueError, match="pause it first"):
        pool.save(sid, tmp_path / "s")
    with pytest.raises(ValueError, match="slots must be an int >= 1"):
        PoolConfig(slots=0, capacity=8)
    with pytest.raises(TypeError, match="SparseAttention"):
        SessionPool(tiny_model, object(), PoolConfig(slots=1, capacity=64))


def test_a_pool_split_over_two_devices_decodes_the_same(tiny_model, attention, lone_tokens):
    from fathom_jax.placement import Placement, device_mesh

    mesh = device_mesh(2)
    sharded = decode.from_spec("fathom:32", k=40, placement=Placement(mesh=mesh))
    pool = _pool(tiny_model, sharded)
    a, b = pool.add(PROMPTS[0]), pool.add(PROMPTS[1])
    for _ in range(3):
        pool.step()
    pool.pause(b)
    pool.resume(b)
    for _ in range(3):
        pool.step()
    assert pool.tokens(a) == lone_tokens[0][:7] and pool.tokens(b) == lone_tokens[1][:7]
    assert pool.step_compiles() <= 1


def test_the_pool_step_runs_the_methods_kernels(tiny_model):
    from flax import nnx

    from tests.support import jaxpr_pallas_calls

    pool = SessionPool(tiny_model, decode.from_spec("fathom:32", k=40, implementation="triton"),
                       PoolConfig(slots=2, capacity=CAPACITY))
    _, params = nnx.split(tiny_model)
    traced = pool._run.trace(params, np.zeros(2, np.int32), np.array([True, False]), pool._own, cache=pool.cache)
    for name in ("fathom_plane_scan", "topk_", "sparse_attend", "water_line"):  # rows attended where they lie in HBM
        assert len(jaxpr_pallas_calls(traced.jaxpr, name)) >= 1, name


HAS_GPU = jax.default_backend() == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_on_the_gpu_parked_sessions_sit_in_pinned_host_memory_and_decode_bit_for_bit(tiny_model, tmp_path):
    attn = decode.from_spec("fathom:32", k=40, rows="k8v8", implementation="triton")
    pool = _pool(tiny_model, attn)
    a = pool.add(PROMPTS[0])
    for _ in range(12):
        pool.step()
    alone = pool.tokens(a)
    pool.remove(a)
    a, _ = pool.add(PROMPTS[0]), pool.add(PROMPTS[1])
    for _ in range(5):
        pool.step()
    pool.pause(a)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(pool.session(a).parked)} == {"pinned_host"}
    pool.save(a, tmp_path / "a")
    pool.remove(a)
    pool.step()
    a = pool.load(tmp_path / "a")
    for _ in range(7):
        pool.step()
    assert pool.tokens(a) == alone


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_on_the_gpu_a_pool_cache_in_pinned_host_moves_sessions_in_place_bit_for_bit(tiny_model, tmp_path):
    """Issue 47's layout natively: the pool's K/V rows (k8v8) and planes 1-3 in pinned_host, plane 0 in HBM. Sessions
    paused, saved, loaded and resumed decode what they decode uninterrupted; the host arrays are the same ones
    throughout (written in place), and neither slot move copies or returns a host array."""
    from fathom_jax.hlo import host_array_copies
    from fathom_jax.placement import Placement, split_bulk
    from fathom_jax.serve import slots

    placement = Placement("pinned_host", resident_planes=1)
    attn = decode.from_spec("fathom:32", k=40, rows="k8v8", implementation="triton", placement=placement)
    pool = _pool(tiny_model, attn)

    def host_leaves():
        return [x for x, b in zip(jax.tree.leaves(pool.cache), jax.tree.leaves(pool.cache.bulk())) if b is True]

    held = host_leaves()
    assert held and {x.sharding.memory_kind for x in held} == {"pinned_host"}
    assert "device" in jax.tree.leaves(pool.cache.bulk())  # plane 0, resident
    alone = [pool_trace.lone_tokens(pool, p, n) for p, n in ((PROMPTS[0], 12), (PROMPTS[1], 13))]
    a, b = pool.add(PROMPTS[0]), pool.add(PROMPTS[1])
    for _ in range(5):
        pool.step()
    pool.pause(a)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(pool.session(a).parked)} == {"pinned_host"}
    a = swap_slots_through_a_save(pool, a, b, tmp_path / "a")
    for _ in range(6):
        pool.step()
    assert [pool.tokens(a), pool.tokens(b)] == alone
    assert all(x is y for x, y in zip(held, host_leaves()))

    cache, one = pool.cache, slots.extract(pool.cache, 0, 2, placement, "triton")
    assert pool.step_compiles() <= 1
    read = slots._extract.lower(cache, jnp.int32(0), heads=2, by_kernel=True)
    program, in_place = slots.insert_program(cache, placement, "triton")
    write = program.lower(*split_bulk(cache, cache.bulk()), one, jnp.int32(0))
    assert in_place and "slot_read" in read.as_text() and "slot_write" in write.as_text()
    for lowered in (read, write):
        assert host_array_copies(lowered.compile().as_text(), min_bytes=1) == []


def test_an_offloaded_pool_moves_its_slots_by_the_kernels_bit_for_bit(tiny_model, tmp_path):
    """Issue 47's layout (plane 0 resident, the rest and k8v8 rows offloaded; on CPU device memory stands in for
    pinned_host) with the kernels, interpreted: sessions paused, saved, loaded and resumed into the other slot decode
    what they decode uninterrupted, and the slot moves ran the slot_copy kernels."""
    from fathom_jax.placement import Placement
    from fathom_jax.serve import slots
    from tests.support import count_pallas_calls

    attn = decode.from_spec("fathom:32", k=40, rows="k8v8", implementation="triton",
                            placement=Placement("pinned_host", resident_planes=1))
    pool = _pool(tiny_model, attn)
    alone = [pool_trace.lone_tokens(pool, p, 6) for p in PROMPTS[:2]]
    a, b = pool.add(PROMPTS[0]), pool.add(PROMPTS[1])
    pool.step()
    pool.pause(a)
    a = swap_slots_through_a_save(pool, a, b, tmp_path / "a", step=False)
    for _ in range(4):
        pool.step()
    assert [pool.tokens(a), pool.tokens(b)] == alone
    bulk = sum(bool(x) for x in jax.tree.leaves(slots._per_sequence(pool.cache.bulk())))
    assert bulk >= 3  # K/V rows, the offloaded planes, plane 0 in device memory (*_hbm), ...
    moves = dict(placement=attn.placement, implementation="triton")
    assert count_pallas_calls(slots.extract, pool.cache, name="slot_read", slot=1, heads=2, **moves) == bulk
    one = slots.extract(pool.cache, 1, 2, **moves)
    assert count_pallas_calls(slots.insert, pool.cache, one, name="slot_write", slot=0, **moves) == bulk


# Gemma 3 (tiny): the model's own per-sequence state (the local layers' window rings) travels with each session.
GEMMA_CAPACITY = 64
GEMMA_PROMPTS = tuple(np.random.default_rng(1).integers(0, 97, n).astype(np.int32) for n in (21, 34, 13))
GEMMA_SPARSE = dict(k=12, sink=2, local=4, implementation="xla")


@pytest.fixture(scope="module")
def gemma3():
    """(tiny Gemma 3, Fathom over its global layers, each prompt's 10 greedy tokens decoded alone: prefill + decode
    steps, batch 1, the prompt right-padded as the pool pads it)."""
    from flax import nnx

    from fathom_jax.models import gemma3 as G
    from tests.support import TINY_GEMMA3 as CFG

    model, attention = G.Gemma3ForCausalLM(CFG, rngs=nnx.Rngs(3)), decode.from_spec("fathom:16", **GEMMA_SPARSE)
    alone = [decode_alone(model, attention, prompt, padded=GEMMA_CAPACITY, capacity=GEMMA_CAPACITY, count=10)
             for prompt in GEMMA_PROMPTS]
    return model, attention, alone


def test_gemma3_sessions_carry_their_window_rings_through_slots_pause_save_and_load(gemma3, tmp_path):
    import json

    from fathom_jax.serve.session_store import SessionFileError

    model, attention, alone = gemma3
    pool = SessionPool(model, attention, PoolConfig(slots=2, capacity=GEMMA_CAPACITY))
    cfg = model.config
    ring = len(cfg.local_layers) * cfg.n_kv_heads * cfg.sliding_window * cfg.head_dim * 4  # f32 keys, one sequence
    assert pool.memory()["session"]["hbm"]["model_state"] == 2 * ring + 4  # keys, values and the length
    a, b, c = (pool.add(p) for p in GEMMA_PROMPTS)
    assert pool.session(c).parked is not None and int(pool.session(c).parked_state.length[0]) == GEMMA_PROMPTS[2].size
    for _ in range(3):
        pool.step()
    pool.pause(a)
    assert int(pool.session(a).parked_state.length[0]) == pool.session(a).length  # the rings' own length
    pool.save(a, tmp_path / "a")
    pool.remove(a)
    pool.resume(c)  # into a's slot
    for _ in range(2):
        pool.step()
    a = pool.load(tmp_path / "a")  # parked: no free slot
    pool.pause(b)
    pool.resume(a)  # into b's slot
    assert (pool.session(c).slot, pool.session(a).slot) == (0, 1)
    for _ in range(3):
        pool.step()
    pool.pause(c)
    pool.resume(b)  # into c's slot
    for _ in range(3):
        pool.step()
    assert [pool.tokens(s) for s in (a, b, c)] == [alone[0][:10], alone[1][:9], alone[2][:6]]
    assert pool.step_compiles() <= 1  # joins, leaves, pauses, loads and slot swaps never compiled it again

    # A save without the model's state cannot be decoded: refused by name, nothing loaded.
    manifest = tmp_path / "a" / "session.json"
    saved = json.loads(manifest.read_text())
    saved["leaves"] = [x for x in saved["leaves"] if not x["path"].startswith("['model_state']")]
    manifest.write_text(json.dumps(saved))
    held = pool.sessions
    with pytest.raises(SessionFileError, match="holds no model state"):
        pool.load(tmp_path / "a")
    assert pool.sessions.keys() == held.keys()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
def test_on_the_gpu_gemma3_sessions_over_a_pinned_host_cache_decode_bit_for_bit(gemma3, tmp_path):
    """The global layers' pool cache in pinned_host (moved by the slot kernels), the window rings in HBM: parked
    sessions (rings included) sit in pinned host memory and decode what they decode uninterrupted."""
    attn = decode.from_spec("fathom:16", placement="pinned_host", **dict(GEMMA_SPARSE, implementation="triton"))
    pool = SessionPool(gemma3[0], attn, PoolConfig(slots=2, capacity=GEMMA_CAPACITY))
    alone = [pool_trace.lone_tokens(pool, p, 9) for p in GEMMA_PROMPTS[:2]]
    a, b = pool.add(GEMMA_PROMPTS[0]), pool.add(GEMMA_PROMPTS[1])
    for _ in range(3):
        pool.step()
    pool.pause(a)
    parked = jax.tree.leaves((pool.session(a).parked, pool.session(a).parked_state))
    assert {x.sharding.memory_kind for x in parked} == {"pinned_host"}
    a = swap_slots_through_a_save(pool, a, b, tmp_path / "a")
    for _ in range(4):
        pool.step()
    assert [pool.tokens(a), pool.tokens(b)] == [alone[0][:8], alone[1][:9]]
    assert pool.step_compiles() <= 1
