"""The pinned host allocator's growth, replayed against what the two-H200 host did (NOTES.md, 2026-11-30)."""

import pytest

from fathom_jax import decode
from fathom_jax.models.attention import CacheShape
from fathom_jax.placement import Placement
from fathom_jax.placement import host_memory
from fathom_jax.placement.host_memory import GiB, regions, smallest_limit_gib

# A 1M-token cache with Qwen3-8B shapes (36 layers, 8 KV heads, D = 128), every layer's own K/V, one GPU.
K = V = 72 * GiB
PLANES, SCALES = 18 * GiB, 9 * GiB // 8
LINK = (2 * GiB,)  # the link measurement's buffers leave a region behind


def test_planes_first_leaves_no_region_for_v_under_205_gib():  # run g3: "no region" for V at 186 and 205
    got = regions([PLANES, SCALES, K, V], 205 * GiB, existing=LINK)
    assert got.failed_at == 3 and got.sizes == (2 * GiB, 32 * GiB, 128 * GiB)


def test_planes_first_under_236_gib_pins_more_than_the_host_holds():  # run g1: killed at 247 GB of pinned memory
    got = regions([PLANES, SCALES, K, V], 236 * GiB, existing=LINK)
    assert got.fits and got.total == 236 * GiB  # V took all the cap left: 236 GiB pinned for a 163 GiB cache


def test_kv_first_needs_the_link_regions_room_too():  # run g5: K/V first, 201 GiB, V found no region
    assert not regions([K, V, PLANES, SCALES], 201 * GiB, existing=LINK).fits
    assert regions([K, V, PLANES, SCALES], 201 * GiB).fits  # without them it would have
    assert smallest_limit_gib([K, V, PLANES, SCALES]) == 200


def test_two_gpus_fit_under_106_gib_each():  # run g6: measured
    half = [K // 2, V // 2, PLANES // 2, SCALES // 2]
    got = regions(half, 106 * GiB, existing=LINK)
    assert got.fits and got.sizes == (2 * GiB, 64 * GiB, 40 * GiB)


def test_requests_reuse_free_room_and_regions_double():
    got = regions([3 << 20, 1 << 20, 1 << 20, 4 << 20], 1 * GiB)
    # 2 -> 4 MiB for 3 MiB; 1 MiB fits in it; the next 1 MiB takes a region of the running size (4 MiB),
    # which then doubles: the 4 MiB request gets 8.
    assert got.sizes == (4 << 20, 4 << 20, 8 << 20)
    assert regions([GiB], GiB - 1).failed_at == 0


def test_check_names_the_variable_and_the_cap_to_set(monkeypatch):
    monkeypatch.setenv(host_memory.LIMIT_VARIABLE, "150")
    with pytest.raises(ValueError, match=r"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=150.*at least 200 GiB.*=206"):
        host_memory.check([K, V, PLANES, SCALES], devices=1)


def test_check_refuses_regions_larger_than_the_machine(monkeypatch):
    monkeypatch.setenv(host_memory.LIMIT_VARIABLE, "236")
    monkeypatch.setattr(host_memory, "physical_bytes", lambda: 251 * GiB)
    with pytest.raises(ValueError, match=r"would pin 236 GiB.*251 GiB: lower the cap to 206"):
        host_memory.check([K, V, PLANES, SCALES], devices=1)
    monkeypatch.setenv(host_memory.LIMIT_VARIABLE, "206")
    host_memory.check([K, V, PLANES, SCALES], devices=1)  # 206 GiB of regions: fine


def test_default_cap_when_unset_or_garbled(monkeypatch):
    monkeypatch.delenv(host_memory.LIMIT_VARIABLE, raising=False)
    assert host_memory.limit_gib() == 64
    monkeypatch.setenv(host_memory.LIMIT_VARIABLE, "lots")
    assert host_memory.limit_gib() == 64


def test_init_cache_checks_before_allocating(monkeypatch):
    """A host cache too big for the cap fails in init_cache with nothing allocated (16 GiB arrays here)."""
    monkeypatch.setattr(Placement, "memory_kind", property(lambda self: "pinned_host"))
    monkeypatch.setenv(host_memory.LIMIT_VARIABLE, "8")
    attn = decode.from_spec("fathom:16", k=64, placement="pinned_host")
    with pytest.raises(ValueError, match=r"a cache of 4194304 tokens .* under XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=8"):
        attn.init_cache(CacheShape(layers=4, batch=1, kv_heads=8, capacity=1 << 22, head_dim=64, dtype="bfloat16"))


def test_side_by_side_kv_needs_less_pinned_room():
    """K and V of a token side by side (one [L, R, C, 2 Dh] array, 144 GiB at 1M on one GPU): the cache's
    163 GiB fit in 2 + 164 GiB of regions, where two 72 GiB arrays needed 2 + 128 + 73 (the caps of the two-GPU
    benchmark runs, results/README.md, are set from these)."""
    assert smallest_limit_gib([K + V, PLANES, SCALES], existing=LINK) == 166
    assert smallest_limit_gib([(K + V) // 2, PLANES // 2, SCALES // 2], existing=LINK) == 84


def test_init_cache_allocates_kv_first_as_one_array(monkeypatch):
    seen = []

    def stop(allocations, **_):
        seen.append(allocations)
        raise RuntimeError("stop before allocating")

    monkeypatch.setattr(Placement, "memory_kind", property(lambda self: "pinned_host"))
    monkeypatch.setattr(host_memory, "check", stop)
    attn = decode.from_spec("fathom:16", k=64, placement="pinned_host")
    with pytest.raises(RuntimeError, match="stop"):
        attn.init_cache(CacheShape(layers=4, batch=1, kv_heads=8, capacity=1 << 12, head_dim=64, dtype="bfloat16"))
    kv, planes, scales = seen[0]
    assert kv == 4 * 8 * (1 << 12) * 2 * 64 * 2  # [L, R, C, 2 Dh] bf16
    assert planes == 4 * 8 * 64 * 4 * (1 << 12) // 32 * 4 and scales == 4 * 8 * 64 * (1 << 12) // 64 * 2
