"""Placement: where cache arrays are allocated (the GPU path itself runs in `pytest -m gpu` and the benchmark)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from fathom_jax.decode import StepConfig
from fathom_jax.placement import Placement
from fathom_jax.placement.placement import _fits_in_hbm


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
    def addressable_devices(self):  # this process's devices: here all of them
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


def resolve(config, placement, groups=8, capacity=1000, implementation="triton"):
    return config.resolve(placement, groups=groups, capacity=capacity, implementation=implementation)


def test_pipeline_is_checked_and_asks_xla_for_concurrent_kernels():
    for name, bad in (("pipeline", 0), ("pipeline", 2.0), ("pipeline", True), ("pipeline", "eight")):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1 or 'auto'"):
            StepConfig(**{name: bad})
    for bad in (-1, 1.5, False):
        with pytest.raises(ValueError, match="gather_programs must be an int >= 0 or 'auto'"):
            StepConfig(gather_programs=bad)
    host = Placement("pinned_host")
    config = StepConfig(pipeline=4, gather_programs=132)
    with pytest.raises(ValueError, match="pipeline=4 must divide the 6 groups"):
        resolve(config, host, groups=6)
    resolve(config, host, groups=8)
    concurrent = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    assert resolve(config, host).options == concurrent and resolve(StepConfig(), host).options == concurrent
    for plain, placement in ((StepConfig(pipeline=1), host), (StepConfig(), Placement()),
                             (StepConfig(read="direct"), host)):
        assert resolve(plain, placement).options == {}
    import jax

    jax.jit(lambda x: x + 1, compiler_options=resolve(config, host).options)(jnp.ones(2))  # XLA knows the option


def test_auto_pipeline_chunks_by_positions_of_the_groups_in_real_host_memory():
    from unittest import mock

    auto, host = StepConfig(), Placement("pinned_host")
    assert resolve(auto, host, capacity=1 << 20).chunks == 1  # device memory here: no chunks
    assert resolve(StepConfig(pipeline=4), host).chunks == 4
    with mock.patch.object(Placement, "memory_kind", new_callable=mock.PropertyMock, return_value="pinned_host"):
        # 8 groups (batch 1): 2 from 32k to 128k, 4 at 256k, 8 from 512k on
        assert [resolve(auto, host, capacity=c).chunks for c in (1 << 15, 1 << 17, 1 << 18, (1 << 19) - 1, 1 << 19,
                                                                  1 << 20)] == [2, 2, 4, 4, 8, 8]
        assert [resolve(auto, host, g, 1 << 17).chunks for g in (16, 32, 64)] == [4, 8, 8]  # batch 2, 4, 8 at 128k
        assert resolve(auto, host, 3, 1 << 20).chunks == 3 and resolve(auto, host, 6, 1 << 20).chunks == 6
        assert resolve(auto, host, 3, 4096).chunks == 1  # the largest divisor of 3 up to 2
        assert resolve(auto, host, 12, 1 << 20).chunks == 6  # the largest divisor up to 8
        assert resolve(StepConfig(read="direct"), host, 8, 1 << 20).chunks == 1
        # every plane resident: only the row fetches overlap, 2 chunks at most; any plane on the host: by positions
        for resident, chunks in ((4, 2), ((4, 4, 4), 2), ((4, 3, 4), 8), (2, 8)):
            tiers = Placement("pinned_host", resident_planes=resident)
            assert auto.resolve(tiers, groups=8, capacity=1 << 20, implementation="triton", layers=3).chunks == chunks
        assert resolve(auto, Placement("pinned_host", resident_planes=4), 8, 1 << 15).chunks == 2
        assert resolve(StepConfig(pipeline=8), Placement("pinned_host", resident_planes=4), 8, 1 << 20).chunks == 8


def test_reads_and_fetches_are_chosen_once():
    """The resolved step holds one read strategy and one fetch strategy, picked from where the cache lives and how
    the step runs."""
    from unittest import mock

    from fathom_jax.decode.fetches import CachedRowFetch, RowFetch
    from fathom_jax.decode.reads import DeviceRead, DirectRead, StagedRead, TieredRead

    host = Placement("pinned_host")
    assert resolve(StepConfig(), Placement()).reader == DeviceRead("triton")
    assert resolve(StepConfig(), host, implementation="xla").reader == DeviceRead("xla")
    assert resolve(StepConfig(), host).reader == StagedRead("triton", 0)
    assert resolve(StepConfig(read="direct"), host).reader == DirectRead("triton")
    # the stacking picks the read: resident or warm planes read in place beside a tiered gather (whatever the read
    # mode: it is about host-only planes), every plane resident scanned in place with nothing gathered
    for placement in (Placement("pinned_host", resident_planes=1), Placement("pinned_host", warm_planes=8)):
        for mode in ("staged", "direct"):
            assert resolve(StepConfig(read=mode), placement).reader == TieredRead("triton", 0)
    in_hbm = resolve(StepConfig(), Placement("pinned_host", resident_planes=4)).reader
    assert in_hbm == DirectRead("triton", planes_in_hbm=True) and in_hbm.stages
    assert not DirectRead("triton").stages and StagedRead("triton").stages and not DeviceRead("triton").stages
    assert type(resolve(StepConfig(), host).fetcher) is RowFetch
    assert type(resolve(StepConfig(row_cache=8), host).fetcher) is CachedRowFetch
    assert not resolve(StepConfig(), host).in_place  # device memory here: functional writes
    with mock.patch.object(Placement, "memory_kind", new_callable=mock.PropertyMock, return_value="pinned_host"):
        assert resolve(StepConfig(), host).in_place


def test_row_fetch_programs_and_extra_xla_options():
    from unittest import mock

    for bad in (-1, 1.5, True, "many"):
        with pytest.raises(ValueError, match="fetch_programs must be an int >= 0 or 'auto'"):
            StepConfig(fetch_programs=bad)
    host = Placement("pinned_host")
    assert resolve(StepConfig(), host).fetcher.programs == 0  # device memory here: one program per 32 rows
    assert resolve(StepConfig(fetch_programs=7), host).fetcher.programs == 7
    with mock.patch.object(Placement, "memory_kind", new_callable=mock.PropertyMock, return_value="pinned_host"), \
            mock.patch("jax.default_backend", return_value="gpu"):
        assert resolve(StepConfig(), host).fetcher.programs >= 1
    # extra options: a dict or pairs, kept as sorted pairs (hashable: configurations are static), on top of the
    # pipeline's
    extra = StepConfig(xla_options={"xla_b": 1, "xla_a": True})
    assert extra.xla_options == (("xla_a", True), ("xla_b", 1)) and hash(extra)
    assert extra == StepConfig(xla_options=(("xla_b", 1), ("xla_a", True)))
    assert resolve(extra, host).options == {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT", "xla_a": True,
                                            "xla_b": 1}
    assert resolve(StepConfig(xla_options={"xla_a": 2}), Placement()).options == {"xla_a": 2}
    for bad in ({"gpu_enable": True}, (("xla_a",),), "xla_a=1"):
        with pytest.raises(ValueError, match="xla_options must map XLA option names"):
            StepConfig(xla_options=bad)


def test_layer_unroll_is_checked():
    assert StepConfig().layer_unroll == 1
    assert StepConfig(layer_unroll=4).layer_unroll == 4
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="layer_unroll must be an int >= 1"):
            StepConfig(layer_unroll=bad)


def test_step_config_parses_the_clis_text():
    from pallas_kernels.plane_scan import PlaneScanConfig
    from pallas_kernels.topk import TopkConfig

    got = StepConfig.parse("read=direct, pipeline=8,index_writes=full_blocks,row_cache=16,xla_gpu_x=true,"
                           "topk.token_splits=2,scan.lanes=8,scan.tile=256,scan.num_warps=4")
    assert got == StepConfig(read="direct", pipeline=8, index_writes="full_blocks", row_cache=16,
                             xla_options={"xla_gpu_x": True}, topk=TopkConfig(token_splits=2),
                             scan=PlaneScanConfig(lanes=8, tile=256, num_warps=4))
    assert resolve(got, Placement("pinned_host")).reader.scan == got.scan
    assert StepConfig.parse("") == StepConfig() and StepConfig.parse("pipeline=auto").pipeline == "auto"
    assert StepConfig.parse("scan.math=f16x2").scan == PlaneScanConfig(math="f16x2", lanes=32, tile=1024)
    for bad, match in (("scan.math=f16x2,scan.lanes=16", "needs lanes=32"), ("scan.math=bf16", "math must be one of"),
                       ("streams=2", "unknown key 'streams'"), ("pipeline", "expected key=value"),
                       ("pipeline=0", "pipeline must be an int >= 1"), ("read=disk", "read must be one of"),
                       ("topk.nope=1", "step config topk"), ("scan.variant=mma", "step config scan: "),
                       ("scan=lanes", "unknown key 'scan'")):
        with pytest.raises(ValueError, match=match):
            StepConfig.parse(bad)


def test_decode_programs_read_each_layers_weights_in_place_on_a_gpu():
    """The decode-step programs ask XLA for cuBLAS GEMMs under its dynamic-slice fusion on a GPU (no copy of each
    layer's weights out of the stacked arrays); elsewhere only the placement's options; XLA knows both names."""
    import jax
    from unittest import mock

    from fathom_jax.models import generation

    assert generation.decode_compiler_options() is None
    assert generation.decode_compiler_options({"xla_a": 1}) == {"xla_a": 1}
    with mock.patch("jax.default_backend", return_value="gpu"):
        got = generation.decode_compiler_options({"xla_gpu_enable_triton_gemm": True})
    assert got == {"xla_gpu_enable_triton_gemm": True, "xla_gpu_enable_dynamic_slice_fusion": True}  # extra wins
    jax.jit(lambda x: x @ x, compiler_options=generation.WEIGHT_GEMM_OPTIONS)(jnp.ones((4, 4)))


def test_device_memory_programs_take_the_step_configs_xla_options(tiny_model):
    """generate and decode_loop in device memory compile with the step configuration's XLA options on top of their
    own, as the offloaded step programs do (the same program again for the same options)."""
    from unittest import mock

    from fathom_jax import decode
    from fathom_jax.models import generation

    extra = {"xla_gpu_enable_triton_gemm": False}
    attn = decode.from_spec("fathom:16", k=48, step=StepConfig(xla_options=extra))
    prompt = np.random.default_rng(2).integers(0, 97, (1, 60)).astype(np.int32)
    seen = []
    for name in ("generate_program", "decode_loop_program"):
        real = getattr(generation, name)
        with mock.patch.object(generation, name, side_effect=lambda options=None, real=real: seen.append(options) or
                               real(options)):
            if name == "generate_program":
                out = generation.generate(tiny_model, prompt, 3, capacity=128, lengths=np.array([60]),
                                          attention_fn=attn)
            else:
                logits, cache, bound = generation.prefill(tiny_model, prompt, np.array([60]), attn, 128)
                out, _ = generation.decode_loop(tiny_model, jnp.argmax(logits, -1).astype(jnp.int32), cache, bound, 3)
        assert out.shape == (1, 3)
    assert seen == [extra, extra]
    assert generation.decode_loop_program(extra) is generation.decode_loop_program(dict(extra))
    assert generation.decode_loop_program(extra) is not generation.decode_loop_program()
