"""Shared helpers of the Pallas kernels: the implementation switch, backend defaults, validation.

Every kernel module exposes ``<kernel>(..., implementation="pallas" | "xla", interpret=None)``:
``"xla"`` runs the module's plain-jnp ``*_reference`` (always available, any backend); ``"pallas"``
runs the ``pallas_call`` on the Triton GPU backend, or in Pallas interpret mode when no GPU is present
(``interpret=None`` picks that automatically).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

IMPLEMENTATIONS = ("pallas", "xla")


def check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


def on_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:  # pragma: no cover
        return False


def resolve_interpret(interpret: bool | None) -> bool:
    """``None`` means: interpret when no GPU backend is present (CPU tests), compile for Triton otherwise."""
    return (not on_gpu()) if interpret is None else bool(interpret)


def compiler_params(num_warps: int, num_stages: int | None = None):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def check_pow2(name: str, value: int) -> None:
    if not is_pow2(int(value)):
        raise ValueError(f"{name} must be a power of two (Triton tensor sizes), got {value}")


def check_array(name: str, x, *, ndim_min: int | None = None, ndim: int | None = None, dtypes=None) -> None:
    """Trace-time (shape/dtype only) validation."""
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {x.shape}")
    if ndim_min is not None and x.ndim < ndim_min:
        raise ValueError(f"{name} must have at least {ndim_min} dims, got shape {x.shape}")
    if dtypes is not None and jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in dtypes]:
        raise TypeError(f"{name} must have dtype in {[str(jnp.dtype(d)) for d in dtypes]}, got {x.dtype}")


def is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def prod(shape) -> int:
    return int(math.prod(shape))


def count_pallas_calls(fn, *args, name: str, **kwargs) -> int:
    """How many ``pallas_call``s named ``name`` the jaxpr of ``fn(*args)`` holds (proves the kernel ran)."""
    jaxpr = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
    return _count(jaxpr.jaxpr, name)


def _count(jaxpr, name: str) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            got = eqn.params.get("name")
            got = getattr(got, "name", got)
            if got == name or (isinstance(got, str) and got.startswith(name)):
                total += 1
        for sub in _subjaxprs(eqn):
            total += _count(sub, name)
    return total


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for item in (v if isinstance(v, (tuple, list)) else (v,)):
            if hasattr(item, "jaxpr") and hasattr(item, "consts"):  # ClosedJaxpr
                yield item.jaxpr
            elif hasattr(item, "eqns"):  # Jaxpr
                yield item


def lower_triton_text(fn, *args, **kwargs) -> str:
    """Lower ``fn(*args)`` for CUDA with the Triton backend on a machine without a GPU (H200 target).

    Checks that a kernel lowers to Triton IR (a CPU-side test of everything but PTX compilation); returns
    the StableHLO text of the exported module.
    """
    from unittest import mock

    from jax._src.pallas.triton import gpu_info as gpu_info_lib

    info = gpu_info_lib.get_gpu_info_from_version(gpu_info_lib.GpuVersion.H200)
    with mock.patch.object(gpu_info_lib, "get_gpu_info", lambda: info):
        specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype), args)
        exported = jax.export.export(
            jax.jit(lambda *a: fn(*a, **kwargs)), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*specs)
    return exported.mlir_module()
