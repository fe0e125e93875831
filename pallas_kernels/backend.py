"""The one implementation switch of the kernels and the library, and what every kernel module shares.

``implementation`` names a backend, with one meaning everywhere (kernels, scans, selection, the decoder), as
jax's own Pallas ops and tokamax name theirs:

* ``"xla"``: plain jnp / XLA ops only - every kernel's independent ``*_reference``;
* ``"triton"``: the Pallas kernels lowered by Pallas' Triton backend for the GPU, or run in Pallas interpret mode
  where there is no GPU (``interpret=None`` picks that).

A kernel with a variant for another Pallas backend (Mosaic GPU) would add its name here and accept it where it has
that variant; none has one (NOTES.md: what each kernel would need). ``"pallas"``, this switch's earlier name for
``"triton"``, is refused with a message saying so.

``None`` (the default everywhere) resolves once, here: ``"triton"`` on a GPU backend, ``"xla"``
elsewhere. Host-resident (``pinned_host``) arrays can only be read by the kernels, so the offloaded
placement on a GPU needs ``"triton"`` (the library's placement checks it).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Implementation = Literal["xla", "triton"]
IMPLEMENTATIONS: tuple[str, ...] = get_args(Implementation)


def is_traced(*values) -> bool:
    """Whether any of ``values`` is a tracer (its value unknown until run time): eager-only checks skip it."""
    return any(isinstance(v, jax.core.Tracer) for v in values)


def on_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:  # pragma: no cover
        return False


def resolve_implementation(implementation: Implementation | None) -> Implementation:
    """Validate ``implementation``; ``None`` means "triton" on a GPU, "xla" elsewhere."""
    if implementation is None:
        return "triton" if on_gpu() else "xla"
    if implementation == "pallas":
        raise ValueError("implementation 'pallas' is now named after its backend: 'triton' (the Pallas kernels as "
                         "Pallas' Triton backend lowers them), or 'xla' for the references")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} (or None: triton on a GPU, "
                         f"xla elsewhere), got {implementation!r}")
    return implementation


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


def check_starts(start) -> None:
    """Write offsets ``start`` (a write kernel's, per group) must be >= 0 (eager only: skipped when traced)."""
    if not is_traced(start) and np.any(np.asarray(start) < 0):
        raise ValueError("start must be >= 0")


def prod(shape) -> int:
    return int(math.prod(shape))


def layered(x, layer, inner_ndim: int, name: str):
    """``(x as [L, R, *inner], layer i32[1])`` for a kernel operand.

    With ``layer=None``, ``x`` is ``[*B, *inner]`` in device memory and is viewed as ``[1, prod(B), *inner]``
    at layer 0 (a free reshape). With a layer index, ``x`` must already be ``[L, R, *inner]``: a stacked
    cache, possibly in host memory, where no XLA op (a reshape included) may touch it, so the kernel
    indexes the layer itself.
    """
    if layer is None:
        batch = x.shape[: x.ndim - inner_ndim]
        return x.reshape(1, prod(batch), *x.shape[x.ndim - inner_ndim:]), jnp.zeros((1,), jnp.int32)
    if x.ndim != inner_ndim + 2:
        raise ValueError(f"{name}: with a layer index it must be [L, R, ...] ({inner_ndim + 2} dims), got {x.shape}")
    return x, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))


def request_groups(store_batch: tuple, request_batch: tuple, layer, group_start, name: str) -> tuple:
    """The batch shape of a kernel's per-group operands, checked against the store it reads.

    A plain store (``layer=None``) is read whole: the operands carry its batch shape. A stacked ``[L, R, ...]``
    store read at a layer may be read for a window of its groups: operands over ``Rc`` groups read groups
    ``group_start .. group_start + Rc - 1`` (static), so work split over groups (GPU streams) never slices the
    store, which may be a ``pinned_host`` array no XLA op may touch.
    """
    if not isinstance(group_start, int) or isinstance(group_start, bool) or group_start < 0:
        raise ValueError(f"{name}: group_start must be an int >= 0, got {group_start!r}")
    if layer is None:
        if group_start:
            raise ValueError(f"{name}: group_start={group_start} needs a stacked [L, R, ...] store read at a layer")
        return tuple(store_batch)
    if len(store_batch) != 1:
        raise ValueError(f"{name}: with a layer index the store must be [L, R, ...] (one group axis), got groups "
                         f"{tuple(store_batch)}")
    (groups,) = store_batch
    if len(request_batch) != 1 or not 1 <= request_batch[0] <= groups - group_start:
        raise ValueError(f"{name}: the per-group operands must be [Rc, ...] with 1 <= Rc <= {groups - group_start} "
                         f"(groups {group_start}.. of the store's {groups}), got batch {tuple(request_batch)}")
    return tuple(request_batch)


def any_spec():
    """A kernel operand passed as a raw pointer (any memory space: HBM or pinned host)."""
    return pl.BlockSpec(memory_space=pl.ANY)
