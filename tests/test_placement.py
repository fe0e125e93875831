"""Placement: where cache arrays are allocated (the GPU path itself runs in `pytest -m gpu` and the benchmark)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax.placement import Placement, _fits_in_hbm


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    limit: int | None
    in_use: int = 0

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit, "bytes_in_use": self.in_use}


@dataclasses.dataclass(frozen=True)
class FakeSharding:
    devices: tuple
    split: int = 1

    @property
    def device_set(self):
        return set(self.devices)

    def shard_shape(self, shape):
        return (shape[0], shape[1] // self.split, *shape[2:])


@pytest.mark.parametrize(
    "limit, in_use, split, fits",
    [
        (10 * 2**20 // 9 + 1, 0, 1, True),  # a 1 MiB shard in 10/9 MiB free: 90%
        (10 * 2**20 // 9 - 1, 0, 1, False),
        (2 * 2**20, 2**20 - 2**19, 1, True),
        (2 * 2**20, 2**20, 1, False),  # in-use bytes count
        (2**20, 0, 2, True),  # split over two devices: half the array each (whole: 1 MiB > 90%)
        (None, 0, 1, False),  # a backend without memory statistics: the host path
    ],
)
def test_fits_in_hbm_compares_one_shard_with_free_memory(limit, in_use, split, fits):
    sharding = FakeSharding(tuple(FakeDevice(limit, in_use) for _ in range(split)), split)
    assert _fits_in_hbm((2, 4, 2**15), jnp.float32, sharding) is fits  # 1 MiB in all


@pytest.mark.parametrize("memory", ["device", "pinned_host"])
def test_zeros_are_zero_and_placed(memory):
    placement = Placement(memory)
    x = placement.zeros((2, 3, 5), jnp.uint32)
    assert x.shape == (2, 3, 5) and x.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(x), 0)
    assert x.sharding.memory_kind == placement.memory_kind


def test_pipeline_is_checked_and_asks_xla_for_concurrent_kernels():
    for name, bad in (("pipeline", 0), ("pipeline", 2.0), ("pipeline", True), ("pipeline", "eight")):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1 or 'auto'"):
            Placement("pinned_host", **{name: bad})
    for bad in (-1, 1.5, False):
        with pytest.raises(ValueError, match="gather_programs must be an int >= 0 or 'auto'"):
            Placement("pinned_host", gather_programs=bad)
    with pytest.raises(ValueError, match="streams=2 and pipeline=4: choose one"):
        Placement("pinned_host", streams=2, pipeline=4)
    placement = Placement("pinned_host", pipeline=4, gather_programs=132)
    with pytest.raises(ValueError, match="pipeline=4 must divide the 6 groups"):
        placement.check_groups(6)
    placement.check_groups(8)
    concurrent = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    assert placement.compiler_options == concurrent and Placement("pinned_host").compiler_options == concurrent
    for plain in (Placement("pinned_host", pipeline=1), Placement(), Placement("pinned_host", read="direct"),
                  Placement("pinned_host", streams=2)):
        assert plain.compiler_options == {}
    import jax

    jax.jit(lambda x: x + 1, compiler_options=placement.compiler_options)(jnp.ones(2))  # XLA knows the option


def test_auto_pipeline_chunks_by_context_in_real_host_memory():
    from unittest import mock

    auto = Placement("pinned_host")
    assert auto.chunks(8, 1 << 20) == 1 and auto.resolved(8, 1 << 20).pipeline == 1  # device memory here: no chunks
    assert Placement("pinned_host", pipeline=4).chunks(8, 1000) == 4
    with mock.patch.object(Placement, "memory_kind", new_callable=mock.PropertyMock, return_value="pinned_host"):
        assert [auto.chunks(8, c) for c in (1 << 17, (1 << 19) - 1, 1 << 19, 1 << 20)] == [2, 2, 8, 8]
        assert auto.chunks(3, 1 << 20) == 3 and auto.chunks(6, 1 << 20) == 6 and auto.chunks(3, 4096) == 1
        assert auto.chunks(12, 1 << 20) == 6  # the largest divisor up to 8
        assert Placement("pinned_host", read="direct").chunks(8, 1 << 20) == 1
        assert Placement("pinned_host", streams=2).chunks(8, 1 << 20) == 1


def test_streams_are_checked_and_split_per_group_leaves_only():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="streams must be an int >= 1"):
            Placement("pinned_host", streams=bad)
    placement = Placement("pinned_host", streams=2)
    with pytest.raises(ValueError, match="streams=2 must divide the 3 groups"):
        placement.check_groups(3)
    placement.check_groups(4)

    @dataclasses.dataclass(frozen=True)
    class Cache:  # a bulk leaf (stacked [L, R, ...]: every chunk gets it whole) and a per-group leaf
        planes: jnp.ndarray
        tail: jnp.ndarray

    import jax

    jax.tree_util.register_dataclass(Cache, data_fields=["planes", "tail"], meta_fields=[])
    cache = Cache(planes=jnp.arange(2 * 4).reshape(2, 4), tail=jnp.arange(4) * 10)
    q = jnp.arange(4 * 3).reshape(4, 3)
    outs = placement.per_stream(lambda start, size, q, c, s: (start, size, q, c.planes, c.tail, s), 4, (q, cache),
                                (jnp.int32(7),))
    for i, (start, size, qc, planes, tail, shared) in enumerate(outs):
        assert (start, size, int(shared)) == (2 * i, 2, 7)
        np.testing.assert_array_equal(qc, q[2 * i:2 * i + 2])
        np.testing.assert_array_equal(tail, cache.tail[2 * i:2 * i + 2])
        np.testing.assert_array_equal(planes, cache.planes)  # bulk: whole, read at the group offset by the kernels


def test_scan_writes_take_effect_where_the_cache_is_written_in_place():
    from unittest import mock

    with pytest.raises(ValueError, match="scan_writes must be a bool, got 'yes'"):
        Placement("pinned_host", scan_writes="yes")
    assert not Placement().writes_in_scan and not Placement("pinned_host").writes_in_scan  # CPU: functional updates
    with mock.patch.object(Placement, "memory_kind", new_callable=mock.PropertyMock, return_value="pinned_host"):
        assert Placement("pinned_host").writes_in_scan
        assert not Placement("pinned_host", scan_writes=False).writes_in_scan


def test_row_fetch_programs_and_extra_xla_options():
    from unittest import mock

    for bad in (-1, 1.5, True, "many"):
        with pytest.raises(ValueError, match="fetch_programs must be an int >= 0 or 'auto'"):
            Placement("pinned_host", fetch_programs=bad)
    assert Placement("pinned_host").row_fetch_programs == 0  # device memory here: one program per 32 rows
    assert Placement("pinned_host", fetch_programs=7).row_fetch_config.programs == 7
    with mock.patch.object(Placement, "memory_kind", new_callable=mock.PropertyMock, return_value="pinned_host"):
        auto = Placement("pinned_host")
        assert auto.row_fetch_programs >= 1 and auto.resolved(8, 1 << 20).fetch_programs == auto.row_fetch_programs
    # extra options: a dict or pairs, kept as sorted pairs (hashable: placements are static), on top of the pipeline's
    extra = Placement("pinned_host", xla_options={"xla_b": 1, "xla_a": True})
    assert extra.xla_options == (("xla_a", True), ("xla_b", 1)) and hash(extra)
    assert extra == Placement("pinned_host", xla_options=(("xla_b", 1), ("xla_a", True)))
    assert extra.compiler_options == {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT", "xla_a": True, "xla_b": 1}
    assert Placement(xla_options={"xla_a": 2}).compiler_options == {"xla_a": 2}
    for bad in ({"gpu_enable": True}, (("xla_a",),), "xla_a=1"):
        with pytest.raises(ValueError, match="xla_options must map XLA option names"):
            Placement(xla_options=bad)


def test_layer_unroll_is_checked():
    assert Placement().layer_unroll == 1
    assert Placement("pinned_host", layer_unroll=4).layer_unroll == 4
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="layer_unroll must be an int >= 1"):
            Placement(layer_unroll=bad)


def test_decode_programs_read_each_layers_weights_in_place_on_a_gpu():
    """The decode-step programs ask XLA for cuBLAS GEMMs under its dynamic-slice fusion on a GPU (no copy of each
    layer's weights out of the stacked arrays); elsewhere only the placement's options; XLA knows both names."""
    import jax
    from unittest import mock

    from fathom_jax.models import sparse
    from pallas_kernels import backend

    assert sparse.decode_compiler_options() is None and sparse.decode_compiler_options({"xla_a": 1}) == {"xla_a": 1}
    with mock.patch.object(backend, "on_gpu", return_value=True):
        got = sparse.decode_compiler_options({"xla_gpu_enable_triton_gemm": True})
    assert got == {"xla_gpu_enable_triton_gemm": True, "xla_gpu_enable_dynamic_slice_fusion": True}  # extra wins
    jax.jit(lambda x: x @ x, compiler_options=sparse.WEIGHT_GEMM_OPTIONS)(jnp.ones((4, 4)))


def test_device_memory_programs_take_the_placements_xla_options(tiny_model):
    """generate and decode_loop in device memory compile with the placement's XLA options on top of their own, as
    the offloaded step programs do (the same program again for the same options)."""
    from unittest import mock

    from fathom_jax import decode
    from fathom_jax.models import sparse

    extra = {"xla_gpu_enable_triton_gemm": False}
    attn = decode.from_spec("fathom:16", k=48, placement=Placement(xla_options=extra))
    prompt = np.random.default_rng(2).integers(0, 97, (1, 60)).astype(np.int32)
    seen = []
    for name in ("generate_program", "decode_loop_program"):
        real = getattr(sparse, name)
        with mock.patch.object(sparse, name, side_effect=lambda options=None, real=real: seen.append(options) or
                               real(options)):
            if name == "generate_program":
                out = sparse.generate(tiny_model, prompt, np.array([60]), 3, capacity=128, attn=attn)
            else:
                logits, cache, branched = sparse.prefill(tiny_model, prompt, np.array([60]), attn, 128)
                out, _ = sparse.decode_loop(tiny_model, jnp.argmax(logits, -1).astype(jnp.int32), cache, branched, 3)
        assert out.shape == (1, 3)
    assert seen == [extra, extra]
    assert sparse.decode_loop_program(extra) is sparse.decode_loop_program(dict(extra))
    assert sparse.decode_loop_program(extra) is not sparse.decode_loop_program()
