"""The key store's pytrees and their memory layout: :class:`PlaneStore`, :class:`UnpackedStore`, :class:`KeyRotation`.

Memory layout, per sequence and KV head (leading batch axes ``*B`` in front of everything)::

    planes  uint32  [*B, D, 4, W]   W = capacity / 32; token i of a plane is bit (i % 32) of word i // 32
    scales  float16 [*B, D, NB]     NB = capacity / 64
    tail    float32 [*B, 64, D]     raw keys of the last, partially filled block (for requantization)
    length  int32   [*B]            valid tokens

Channel-major means that the first ``t`` planes of channel ``j`` are one contiguous run of
``t * capacity / 8`` bytes (``planes[..., j, :t, :]``), and its scales are a second run of
``capacity / 32`` bytes. At 32k tokens a plane is 4 KiB, at 1M tokens 128 KiB, so a per-query read is
a short list of long contiguous runs: one per active channel (plus one for its scales). Across
sequences and heads the runs of ``(b, h, j)`` start at word ``((b * H + h) * D + j) * 4 * W``.

The codes and planes are :mod:`fathom_jax.store.quantizer`'s; :mod:`fathom_jax.store` builds, appends to and cuts a
store, :mod:`fathom_jax.store.read` reads it (both re-exported by ``fathom_jax.store``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float16, Int, UInt32

from fathom_jax import format as fmt
from fathom_jax.format import BLOCK_TOKENS
from pallas_kernels.operands import StorePlanes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyRotation:
    """A fixed orthogonal change of key basis: ``k -> (k - mean) @ basis``.

    ``basis`` columns are ordered by decreasing calibration score variance (see ``calibrate.py``);
    ``mean`` is subtracted from keys only: ``q . mean`` is the same for every key, so rankings and
    softmax weights are unchanged.
    """

    mean: Float[Array, "*B D"]
    basis: Float[Array, "*B D D"]


def rotate_keys(keys: Float[Array, "*B n D"], rotation: KeyRotation | None) -> Float[Array, "*B n D"]:
    """``(k - mean) @ basis``, computed the same way for every token.

    A matmul (or a ``sum`` reduction) may add in a different order for different token counts, and the
    store must come out the same whether its keys arrive at once or one by one, so the product is an
    explicit left fold over the input channels: ``acc += (k - mean)_j * basis[j, :]`` for j = 0..D-1,
    the same sequence of rounded operations for every token whatever the batch of tokens.
    """
    if rotation is None:
        return keys
    centered = keys - rotation.mean[..., None, :]
    basis = rotation.basis

    def body(j, acc):
        col = jax.lax.dynamic_index_in_dim(centered, j, axis=-1, keepdims=True)  # [*B, n, 1]
        row = jax.lax.dynamic_index_in_dim(basis, j, axis=-2, keepdims=True)  # [*B, 1, D]
        return acc + col * row

    return jax.lax.fori_loop(0, centered.shape[-1], body, jnp.zeros(centered.shape, jnp.result_type(centered, basis)))


def rotate_queries(q: Float[Array, "*B G D"], rotation: KeyRotation | None) -> Float[Array, "*B G D"]:
    if rotation is None:
        return q
    return jnp.einsum("...gd,...de->...ge", q, rotation.basis)


class BlockScaled:
    """What every store type knows from its fp16 block scales ``[*B, D, NB]``: one per channel and 64-token block."""

    scales: jax.Array

    @property
    def capacity(self) -> int:
        return self.scales.shape[-1] * BLOCK_TOKENS

    @property
    def head_dim(self) -> int:
        return self.scales.shape[-2]

    @property
    def num_blocks(self) -> int:
        return self.scales.shape[-1]

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return self.scales.shape[:-2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlaneStore(BlockScaled):
    """Bit-plane key store for a batch of sequences (see the module docstring for the layout)."""

    planes: UInt32[Array, "*B D 4 W"]
    scales: Float16[Array, "*B D NB"]
    tail: Float[Array, "*B 64 D"]
    length: Int[Array, "*B"]
    rotation: KeyRotation | None = None

    def plane_run_bytes(self) -> int:
        """Bytes of one plane of one channel: the unit of a contiguous read."""
        return fmt.plane_run_bytes(self.capacity)

    def planes_at(self, layer=None, group_start: int = 0) -> StorePlanes:
        """The planes as the kernels read them in place: of layer ``layer`` of a stacked ``[L, R, ...]`` store for
        groups ``group_start ..`` (None: the store as it is; :meth:`TieredPlaneStore.tiers` is the two tiers')."""
        return StorePlanes(self.planes, self.scales, layer, group_start)

    def layer_store(self, layer, groups: slice, length) -> "PlaneStore":
        """Layer ``layer``'s ``groups`` of a stacked ``[L, R, ...]`` store, ``length`` long (as a two-tier store's)."""
        return dataclasses.replace(self, planes=self.planes[layer, groups], scales=self.scales[layer, groups],
                                   length=length)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UnpackedStore(BlockScaled):
    """A plane store with its 4-bit codes unpacked token-major (``uint8 [*B, capacity, D]``; rows at or
    past ``length`` are ignored), the block holding token ``length`` kept apart (``block_codes``).

    A reader that scans one window many times (the fidelity sweep: one read per decode position) keeps
    this instead of extracting the same bits from the planes at every read. Reads from it
    (:func:`read_codes`, :func:`dequantize`, the ``"xla"`` scan) give the packed store's values bit for
    bit; the Pallas kernels read only packed planes. Make one with :func:`unpack_store`.

    ``block_codes`` ``[*B, 64, D]`` are the codes of block ``length // 64`` and take the place of that
    block's rows of ``codes``: :func:`truncate` requantizes that block only and leaves ``codes`` as it is,
    so the cuts of one window to many lengths (vmapped) share one copy of its codes.
    """

    codes: Int[Array, "*B n D"]
    block_codes: Int[Array, "*B 64 D"]
    scales: Float16[Array, "*B D NB"]
    tail: Float[Array, "*B 64 D"]
    length: Int[Array, "*B"]
    rotation: KeyRotation | None = None

