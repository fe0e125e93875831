"""Host run gather: copy each active channel's first ``t_j`` planes and its scales into an HBM staging buffer.

From a store (on the GPU a ``pinned_host`` array, read directly by the kernel through
``memory_space=pl.ANY``; on CPU / interpret mode the same code on device memory) and a fixed-size run
list ``channels [*, C]`` / ``depths [*, C]`` (one slot per channel; slot ``c`` reads channel
``channels[c]`` to depth ``depths[c]``, 0 = nothing), write::

    staged_planes  u32 [*, C, 4, W]   slot c, plane p < t_c: planes[channels[c], p]; planes p >= t_c: 0
    staged_scales  f16 [*, C, NB]     slot c: scales[channels[c]] if t_c > 0 else 0

inside ``jit`` with no host sync. Each (slot, plane) is one contiguous run of ``W`` words in the
channel-major store; one program copies ``chunk`` words of all four planes of a slot (loads of planes
past ``t`` are masked off, so they move no bytes). The staged buffer is the input of the plane scan
with the identity channel list: ``plane_scan(q_staged, staged_planes, staged_scales, length,
iota(C), depths)`` with ``q_staged = q[..., channels]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _common as C

KERNEL_NAME = "run_gather"


def _validate(planes, scales, channels, depths):
    C.check_array("planes", planes, ndim_min=3, dtypes=(jnp.uint32,))
    C.check_array("scales", scales, ndim_min=2, dtypes=(jnp.float16, jnp.float32))
    C.check_array("channels", channels, ndim_min=1, dtypes=(jnp.int32,))
    C.check_array("depths", depths, ndim_min=1, dtypes=(jnp.int32,))
    *batch, d, four, w = planes.shape
    if four != 4 or w % 2:
        raise ValueError(f"planes must be [*, D, 4, W] with W even, got {planes.shape}")
    if scales.shape != (*batch, d, w // 2):
        raise ValueError(f"scales must be {(*batch, d, w // 2)}, got {scales.shape}")
    if channels.shape[:-1] != tuple(batch) or depths.shape != channels.shape:
        raise ValueError(f"channels/depths must be [*batch, C], got {channels.shape}, {depths.shape}")


def check_values(channels, depths, head_dim: int) -> None:
    if not C.is_concrete(channels, depths):
        return
    ch, dp = np.asarray(channels), np.asarray(depths)
    if np.any((ch < 0) | (ch >= head_dim)) or np.any((dp < 0) | (dp > 4)):
        raise ValueError(f"channels must lie in [0, {head_dim}) and depths in [0, 4]")


def run_gather_reference(planes, scales, channels, depths):
    """Plain-jnp gather of the same staging buffers."""
    _validate(planes, scales, channels, depths)
    sel = jnp.take_along_axis(planes, channels[..., :, None, None], axis=-3)  # [*, C, 4, W]
    keep = jnp.arange(4)[:, None] < depths[..., :, None, None]
    staged_planes = jnp.where(keep, sel, jnp.uint32(0))
    sc = jnp.take_along_axis(scales, channels[..., :, None], axis=-2)
    staged_scales = jnp.where(depths[..., :, None] > 0, sc, jnp.zeros((), scales.dtype))
    return staged_planes, staged_scales


def _run_gather_kernel(
    # inputs
    ch_ref,  # i32 [BH, C]
    dep_ref,  # i32 [BH, C]
    planes_ref,  # u32 [BH, D, 4, W]   (any memory space: HBM or pinned host)
    scales_ref,  # f16 [BH, D, NB]
    # outputs
    out_planes_ref,  # u32 [BH, C, 4, W]
    out_scales_ref,  # f16 [BH, C, NB]
    *,
    chunk: int,
    width: int,
):
    bh, c, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    j = ch_ref[bh, c]
    t = dep_ref[bh, c]
    w0 = i * chunk
    wmask = w0 + jnp.arange(chunk, dtype=jnp.int32) < width
    for p in range(4):
        data = plgpu.load(planes_ref.at[bh, j, jnp.int32(p), pl.ds(w0, chunk)], mask=wmask & (p < t), other=0)
        plgpu.store(out_planes_ref.at[bh, c, jnp.int32(p), pl.ds(w0, chunk)], data, mask=wmask)
    half = chunk // 2
    s0 = i * half
    smask = s0 + jnp.arange(half, dtype=jnp.int32) < width // 2
    sc = plgpu.load(scales_ref.at[bh, j, pl.ds(s0, half)], mask=smask & (t > 0), other=0)
    plgpu.store(out_scales_ref.at[bh, c, pl.ds(s0, half)], sc, mask=smask)


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "interpret"))
def _run_gather_pallas(planes, scales, channels, depths, *, chunk, num_warps, interpret):
    *batch, d, _, w = planes.shape
    bh = C.prod(batch)
    c = channels.shape[-1]
    chunk = min(chunk, pl.next_power_of_2(w))
    kernel = functools.partial(_run_gather_kernel, chunk=chunk, width=w)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out_planes, out_scales = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bh, c, 4, w), jnp.uint32),
            jax.ShapeDtypeStruct((bh, c, w // 2), scales.dtype),
        ),
        grid=(bh, c, pl.cdiv(w, chunk)),
        in_specs=[any_spec, any_spec, any_spec, any_spec],
        out_specs=(any_spec, any_spec),
        interpret=interpret,
        name=KERNEL_NAME,
        compiler_params=C.compiler_params(num_warps),
    )(
        channels.reshape(bh, c),
        depths.reshape(bh, c),
        # no reshape of an already flat store: XLA ops cannot touch a pinned_host array inside jit
        planes if planes.ndim == 4 else planes.reshape(bh, d, 4, w),
        scales if scales.ndim == 3 else scales.reshape(bh, d, w // 2),
    )
    return out_planes.reshape(*batch, c, 4, w), out_scales.reshape(*batch, c, w // 2)


def run_gather(
    planes,  # u32 [*, D, 4, W]   store planes (pinned_host on the GPU, or HBM)
    scales,  # f16 [*, D, NB]
    channels,  # i32 [*, C]
    depths,  # i32 [*, C]
    *,
    implementation: str = "pallas",
    chunk: int = 2048,
    num_warps: int = 4,
    interpret: bool | None = None,
):
    """Staged ``(planes u32 [*, C, 4, W], scales [*, C, NB])`` of the run list (see the module docstring)."""
    C.check_implementation(implementation)
    _validate(planes, scales, channels, depths)
    check_values(channels, depths, planes.shape[-3])
    if implementation == "xla":
        return run_gather_reference(planes, scales, channels, depths)
    C.check_pow2("chunk", chunk)
    if chunk < 2:
        raise ValueError("chunk must be >= 2 words")
    return _run_gather_pallas(planes, scales, channels, depths, chunk=chunk, num_warps=num_warps,
                              interpret=C.resolve_interpret(interpret))
