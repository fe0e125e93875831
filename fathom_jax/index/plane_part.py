"""The plane-store part: 4-bit codes as bit planes, of the keys or of a calibration rotation of them."""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float16, UInt32

from fathom_jax import format as fmt
from fathom_jax import store as store_lib
from fathom_jax.calibrate import Calibration
from fathom_jax.format import BLOCK_TOKENS, N_PLANES, WORDS_PER_BLOCK
from fathom_jax.index.part import IndexPart, _small_like
from fathom_jax.store import KeyRotation, PlaneStore


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlaneBlock:
    """A plane store's newest 64-token block after a decode step adds its token: plane ``words [R, D, 4, 2]``, fp16
    ``scale [R, D]`` and the block's raw keys ``tail [R, 64, D]`` (in the store's basis)."""

    words: UInt32[Array, "R D 4 2"]
    scale: Float16[Array, "R D"]
    tail: Float[Array, "R 64 D"]


@dataclasses.dataclass(frozen=True)
class Planes(IndexPart):
    """4-bit codes stored as bit planes: of the keys (``rotation=None``) or of ``(k - mean) @ basis`` for the
    rotation a calibration gives (``rotation(calib)``: Fathom KLT's, Loki's)."""

    name: str
    rotation: Callable[[Calibration], KeyRotation] | None = None

    writes_per_token: ClassVar[int] = 2  # plane words and scales

    @property
    def kind(self) -> str:
        return "planes"

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.rotation is not None

    def build(self, keys, calib, *, capacity, length):
        rotation = None if self.rotation is None else self.rotation(calib)
        return store_lib.build_store(keys, capacity=capacity, length=length, rotation=rotation)

    def append(self, data, keys, length):
        return store_lib.append(data, keys, check=False)

    def prefix(self, data, keys, length):
        return store_lib.truncate(data, keys, length)

    def unpack(self, data):
        return store_lib.unpack_store(data)

    def bulk(self, data):
        mask = _small_like(data, False)
        return dataclasses.replace(mask, planes=True, scales=True)

    def nbytes(self, *, capacity, head_dim):
        return head_dim * (N_PLANES * fmt.plane_words(capacity) * 4 + capacity // BLOCK_TOKENS * 2)

    def empty(self, alloc, length, *, layers, groups, capacity, head_dim):
        small = lambda shape, dtype: alloc(shape, dtype, bulk=False)  # noqa: E731
        d = head_dim
        rotation = None
        if self.rotation is not None:
            rotation = KeyRotation(mean=small((layers, groups, d), jnp.float32),
                                   basis=small((layers, groups, d, d), jnp.float32))
        return PlaneStore(planes=alloc((layers, groups, d, N_PLANES, fmt.plane_words(capacity)), jnp.uint32),
                          scales=alloc((layers, groups, d, capacity // BLOCK_TOKENS), jnp.float16),
                          tail=small((layers, groups, BLOCK_TOKENS, d), jnp.float32), length=length, rotation=rotation)

    def write_layer(self, write, stacked, built, layer, length):
        zero = jnp.zeros(built.length.shape, jnp.int32)
        put = lambda dst, src, axis: write(dst, src[None], zero, axis, layer)  # noqa: E731
        set_small = lambda dst, src: dst.at[layer].set(src.astype(dst.dtype))  # noqa: E731
        rotation = None if stacked.rotation is None else jax.tree.map(set_small, stacked.rotation, built.rotation)
        return PlaneStore(planes=put(stacked.planes, built.planes, 4), scales=put(stacked.scales, built.scales, 3),
                          tail=set_small(stacked.tail, built.tail), length=length, rotation=rotation)

    def add_token(self, stacked, layer, position, key):
        rotation = None if stacked.rotation is None else jax.tree.map(lambda a: a[layer], stacked.rotation)
        rotated = store_lib.rotate_keys(key[:, None, :], rotation)[:, 0]
        words, scale, tail = jax.vmap(store_lib.append_block)(stacked.tail[layer], position, rotated)
        view = PlaneStore(planes=stacked.planes, scales=stacked.scales, tail=tail, length=position + 1,
                          rotation=rotation)
        return view, PlaneBlock(words=words, scale=scale, tail=tail)

    def write_token(self, write, stacked, block, position, layer, due):
        planes, scales = _write_plane_block(write, stacked, block.words, block.scale, position // BLOCK_TOKENS, due,
                                            layer)
        return dataclasses.replace(stacked, planes=planes, scales=scales)

    def commit(self, stacked, block, length):
        return dataclasses.replace(stacked, tail=block.tail, length=length)

    def flush(self, write, stacked, length):
        """Every layer's partial newest block packed from its raw tail and written."""
        count = length % BLOCK_TOKENS
        pack = jax.vmap(jax.vmap(store_lib.pack_block), in_axes=(0, None))  # over layers, then groups
        words, scale = pack(stacked.tail, count)
        planes, scales = _write_plane_block(write, stacked, words, scale, length // BLOCK_TOKENS, count > 0, 0)
        return dataclasses.replace(stacked, planes=planes, scales=scales)


def _write_plane_block(write, store: PlaneStore, words, scale, block, due, layer):
    """``store``'s planes and scales with each group's 64-token block number ``block [R]`` written where ``due``
    (words ``[Ls, R, D, 4, 2]``, scales ``[Ls, R, D]`` for layers ``layer ..``); elsewhere the block index is
    past the end and the writes drop out."""
    block = jnp.where(due, block, store.scales.shape[-1])
    return (write(store.planes, words, block * WORDS_PER_BLOCK, 4, layer),
            write(store.scales, scale[..., None], block, 3, layer))
