"""Shared fixtures: the paper's Appendix A example, seeded random keys, a tiny random decoder."""

import os
import types

# Keep XLA from grabbing every core twice on the 2-core CI machine, and compile without LLVM's optimisation
# passes: most of the suite is compile-bound (interpreted Pallas kernels, small decoders; ~20% faster each),
# though the few compute-bound real-model tests run ~2x slower (NOTES.md). XLA:CPU uses no fast-math, so the
# numbers, and every bit-exact comparison, are the same. Skipping LLVM's expensive passes as well took ~8% off
# the heaviest compile-bound tests (2026-11-30: 61 -> 55 s for three of them).
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0 "
                                   "--xla_llvm_disable_expensive_passes=true")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)
jax.config.update("jax_num_cpu_devices", 2)  # two host devices: the sharded decode step runs over them


def _share_compiled_programs() -> None:
    """The run's two pytest-xdist workers share their compiled programs through one compilation cache, made for this
    run and removed with it (``pytest_sessionfinish``): each compiles many of the same small programs."""
    from tests.support import oracle_dir

    jax.config.update("jax_compilation_cache_dir", os.path.join(oracle_dir(), "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_share_compiled_programs()


def _max_mappings() -> int:
    """70% of the kernel's vm.max_map_count (65530 by default): a test adds at most a few thousand mappings."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(0.7 * int(f.read()))
    except (OSError, ValueError):
        return 45000


MAX_MAPPINGS = _max_mappings()


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Drop JAX's compiled programs once the process holds many memory mappings. Every XLA:CPU executable maps its
    code: a decode test adds ~700 mappings, and a pytest-xdist worker that kept them all passed the kernel's limit of
    65530 and crashed inside XLA's compiler (a segfault or abort in ``backend_compile_and_load``, 2026-12-01, three
    runs of the suite; NOTES.md). Programs compiled after the release are compiled again, nothing else changes.
    Each release costs seconds (a worker drops ~15,000 programs), so it waits until 70% of the limit."""
    yield
    try:
        with open("/proc/self/maps") as f:
            mappings = sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to watch
        return
    if mappings > MAX_MAPPINGS:
        import gc

        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def appendix():
    """Appendix A (reconstructed in DESIGN.md): six keys, four channels, one block; heads A and B."""
    keys = np.array(
        [
            [1.8, 0.4, -0.2, 0.05],
            [-1.1, 0.9, 0.3, -0.02],
            [0.3, -1.2, 0.1, 0.04],
            [1.2, 0.7, 0.4, 0.01],
            [-0.6, -0.3, -0.5, 0.03],
            [0.9, 1.1, -0.3, -0.05],
        ],
        np.float32,
    )
    return types.SimpleNamespace(
        keys=keys,
        var=np.array([1.222, 0.755, 0.127, 0.001], np.float32),
        q=np.array([[3.0, 1.0, 2.0, 0.1], [1.0, 2.0, -1.0, 0.2]], np.float32),
        exact_scores=np.array([[5.40, -1.80, -0.10, 5.10, -3.10, 3.19], [2.81, 0.40, -2.19, 2.20, -0.69, 3.39]]),
        right=[{0, 3}, {5, 0}],  # the true top-2 of heads A and B
    )


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


def _random_keys(rng, shape, *, lognormal_channels=True):
    """Keys with log-normal per-channel scales, like real post-RoPE keys (a few loud channels)."""
    keys = rng.standard_normal(shape).astype(np.float32)
    if lognormal_channels:
        keys *= np.exp(rng.normal(0.0, 1.0, size=shape[-1])).astype(np.float32)
    return keys


@pytest.fixture(scope="session")
def random_keys():
    """``random_keys(rng, shape)``: keys with log-normal per-channel scales."""
    return _random_keys


@pytest.fixture(scope="session")
def tiny_config():
    """A tiny Qwen3-style decoder (q/k/v bias, q/k norm): 3 layers, 6 query heads over 2 KV heads, D = 8."""
    from fathom_jax.models.config import LlamaConfig

    return LlamaConfig(vocab=97, hidden=32, intermediate=48, n_layers=3, n_heads=6, n_kv_heads=2, head_dim=8,
                       rope_theta=1e4, rms_norm_eps=1e-6, attention_bias=True, qk_norm=True)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    from flax import nnx

    from fathom_jax.models.llama import LlamaForCausalLM

    return LlamaForCausalLM(tiny_config, rngs=nnx.Rngs(0))


def pytest_sessionfinish(session, exitstatus):
    """The owner of the run (a plain pytest, or pytest-xdist's controller) removes the HF oracle's directory
    (tests/models/conftest.py) once every worker is done."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        import shutil

        from tests.support import oracle_dir

        shutil.rmtree(oracle_dir(os.getpid()), ignore_errors=True)


@pytest.fixture
def full_f32_matmuls():
    """f32 GEMMs at full precision (no TF32 on a GPU) while the test runs. The K rows a test compares come from two
    programs (the sparse prefill, capture_qkv): with TF32 they differed by 1.6e-4 in run s1 and by 2.3e-3 at layer 2
    in run v5, after other tests had compiled in the same process (the same cases passed alone, run v6)."""
    with jax.default_matmul_precision("highest"):
        yield
