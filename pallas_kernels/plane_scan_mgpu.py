"""A Mosaic GPU probe of the plane scan's tensor-core product (:mod:`pallas_kernels.plane_scan_mma`): one warpgroup
per (group, 64-token block) expands the block's plane words into signed fp16 scales in registers (the wgmma
accumulator's layout) and multiplies them by fp16 hi/lo query weights in shared memory with ``wgmma``.

A probe, not a variant: which of its primitives Mosaic GPU lowers and compiles at this JAX version is the question
it answers. Its operands are the product rows already gathered (by plain jnp, from the row table of
:func:`pallas_kernels.plane_scan_mma.row_table`): the in-kernel gather of runs and the tiers are not here.

    words  u32 [R, NB, 2, K]   the block's two plane words of each product row
    scales f16 [R, NB, K]      the block scale of each product row's channel
    w      f16 [R, 2, K, 16]   hi and lo weights, 16 head columns (heads padded)
    out    f32 [R, NB, 64, 16] scores, token-major
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int, UInt

from pallas_kernels.plane_scan_mma import row_table

KERNEL_NAME = "fathom_plane_scan_mgpu"
TOKENS = 64  # one block per program: the wgmma's M
HEADS = 16  # the wgmma's N (heads padded)


def product_rows(q: Float[Array, "R G D"], planes: UInt[Array, "R D 4 W"], scales: Float[Array, "R D NB"],
                 channels: Int[Array, "R C"], depths: Int[Array, "R C"]):
    """The probe's operands for a store and a run list, gathered in plain jnp from the mma variant's row table:
    ``(words [R, NB, 2, K], scales [R, NB, K], w [R, 2, K, 16], unscale [R])``, ``K`` the most read rows of any
    group rounded up to 16 (rows past a group's read ones weigh 0). Eager: ``K`` is read from the table."""
    slot, plane, hi, lo, steps, unscale = row_table(jnp.take_along_axis(q, channels[:, None, :], -1), depths)
    k = max(HEADS, HEADS * int(jnp.max(steps)))
    slot, plane, hi, lo = slot[:, :k], plane[:, :k], hi[..., :k], lo[..., :k]
    ch = jnp.take_along_axis(channels, slot, axis=-1)  # [R, K]
    rows = jnp.take_along_axis(planes, ch[..., None, None], axis=1)  # [R, K, 4, W]
    words = jnp.take_along_axis(rows, plane[..., None, None], axis=2)[:, :, 0]  # [R, K, W]
    words = words.reshape(*words.shape[:2], -1, 2).transpose(0, 2, 3, 1)  # [R, NB, 2, K]
    a = jnp.take_along_axis(scales, ch[..., None], axis=1).transpose(0, 2, 1)  # [R, NB, K]
    w = jnp.stack([hi, lo], axis=1)[:, :, :HEADS].transpose(0, 1, 3, 2)  # [R, 2, K, 16]
    return words, a, w, unscale


def plane_product_reference(words: UInt[Array, "R NB 2 K"], scales: Float[Array, "R NB K"],
                            w: Float[Array, "R 2 K 16"]) -> Float[Array, "R NB 64 16"]:
    """The same product in plain jnp (f32)."""
    t = jnp.arange(TOKENS)
    word = jnp.where((t < 32)[:, None], words[:, :, 0, None, :], words[:, :, 1, None, :])  # [R, NB, 64, K]
    bits = (word >> (t % 32).astype(jnp.uint32)[:, None]) & 1
    a = scales.astype(jnp.float32)[:, :, None, :]
    lhs = jnp.where(bits != 0, a, -a)
    weights = w.astype(jnp.float32).sum(axis=1)  # hi + lo
    return jnp.einsum("rbtk,rkh->rbth", lhs, weights, precision=lax.Precision.HIGHEST)


def _body(words_gmem, scales_gmem, w_gmem, out_gmem, words_smem, scales_smem, w_smem, out_smem, barriers):
    r, b = lax.axis_index("r"), lax.axis_index("b")
    plgpu.copy_gmem_to_smem(words_gmem.at[r, b], words_smem, barriers.at[0])
    plgpu.copy_gmem_to_smem(scales_gmem.at[r, b], scales_smem, barriers.at[1])
    plgpu.copy_gmem_to_smem(w_gmem.at[r], w_smem, barriers.at[2])
    for i in range(3):
        plgpu.barrier_wait(barriers.at[i])
    k = scales_smem.shape[0]
    row = plgpu.Layout.WGMMA.reduce(0)  # a [K] vector, broadcast over the 64 token rows
    w0 = lax.broadcast_in_dim(plgpu.load(words_smem.at[0], layout=row), (TOKENS, k), [1])
    w1 = lax.broadcast_in_dim(plgpu.load(words_smem.at[1], layout=row), (TOKENS, k), [1])
    a = lax.broadcast_in_dim(plgpu.load(scales_smem, layout=row), (TOKENS, k), [1])
    t = plgpu.broadcasted_iota(jnp.int32, (TOKENS, k), 0, layout=plgpu.Layout.WGMMA)
    word = jnp.where(t < 32, w0, w1)
    bits = (word >> (t % 32).astype(jnp.uint32)) & jnp.uint32(1)
    lhs = jnp.where(bits != 0, a, -a)

    def product(acc):
        plgpu.wgmma(acc, lhs, w_smem.at[0])
        plgpu.wgmma(acc, lhs, w_smem.at[1])
        plgpu.wgmma_wait(0)
        return acc[...]

    out_smem[...] = pl.run_scoped(product, plgpu.ACC((TOKENS, HEADS), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[r, b])
    plgpu.wait_smem_to_gmem(0)


def plane_product_mgpu(words: UInt[Array, "R NB 2 K"], scales: Float[Array, "R NB K"],
                       w: Float[Array, "R 2 K 16"]) -> Float[Array, "R NB 64 16"]:
    """The product on the GPU through Mosaic GPU (``K`` a multiple of 16)."""
    r, nb, _, k = words.shape
    if k % 16 or w.shape != (r, 2, k, HEADS) or scales.shape != (r, nb, k):
        raise ValueError(f"words [R, NB, 2, K] (K % 16 == 0), scales [R, NB, K], w [R, 2, K, {HEADS}]: got "
                         f"{words.shape}, {scales.shape}, {w.shape}")
    swizzle = plgpu.find_swizzle(HEADS * 16, "rhs")
    transforms = (plgpu.TilingTransform((8, 8 * swizzle // 16)), plgpu.SwizzleTransform(swizzle))
    call = plgpu.kernel(
        _body,
        out_type=jax.ShapeDtypeStruct((r, nb, TOKENS, HEADS), jnp.float32),
        scratch_types=[plgpu.SMEM((2, k), jnp.uint32), plgpu.SMEM((k,), jnp.float16),
                       plgpu.SMEM((2, k, HEADS), jnp.float16, transforms=transforms),
                       plgpu.SMEM((TOKENS, HEADS), jnp.float32), plgpu.Barrier(num_barriers=3)],
        grid=(r, nb),
        grid_names=("r", "b"),
        kernel_name=KERNEL_NAME,
    )
    return call(words, scales, w)
