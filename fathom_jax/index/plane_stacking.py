"""How a decode cache stacks a plane store ``[L, R, ...]``: one tier or two, chosen once from the resident planes.

* :class:`OneTier`: channel-major planes ``[L, R, D, 4, W]`` (a :class:`~fathom_jax.store.PlaneStore`) wherever the
  placement puts bulk leaves; with every plane of every layer resident (``in_hbm``), in device memory whatever the
  placement (the index-in-HBM control).
* :class:`TwoTiers`: planes ``[0, p_l)`` of layer ``l`` and the block scales in device memory, the rest in host
  memory (a :class:`~fathom_jax.store.tiered.TieredPlaneStore`); with ``warm`` slots, copies of that many channel
  planes past the resident ones per layer and group in device memory too, chosen at prefill from the prompt.

Both hold the same codes, built, appended and cut by :class:`~fathom_jax.index.plane_part.Planes` alike; the
stacking only says where a cache's planes sit and how a layer's blocks are written there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float16, UInt32

from fathom_jax import format as fmt
from fathom_jax import store as store_lib
from fathom_jax.format import BLOCK_TOKENS, N_PLANES, WORDS_PER_BLOCK
from fathom_jax.index.part import _small_like
from fathom_jax.store import KeyRotation, PlaneStore
from fathom_jax.store.tiered import TieredPlaneStore, warm_choice, warm_sources


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlaneBlock:
    """A plane store's newest 64-token block after a decode step adds its token: plane ``words [R, D, 4, 2]``, fp16
    ``scale [R, D]`` and the block's raw keys ``tail [R, 64, D]`` (in the store's basis)."""

    words: UInt32[Array, "R D 4 2"]
    scale: Float16[Array, "R D"]
    tail: Float[Array, "R 64 D"]


def stacking(resident: tuple[int, ...], warm: int = 0) -> "OneTier | TwoTiers":
    """The stacking for ``resident[l]`` planes of layer ``l`` in device memory (none: one tier) and ``warm`` channel
    planes per layer and group beside them (two tiers and the warm one, even with no resident plane)."""
    if not any(resident) and not warm:
        return OneTier()
    if all(p == N_PLANES for p in resident):
        return OneTier(in_hbm=True)
    return TwoTiers(tuple(resident), warm)


def _rotation(alloc, rotated: bool, *, layers: int, groups: int, head_dim: int) -> KeyRotation | None:
    if not rotated:
        return None
    small = lambda shape: alloc(shape, jnp.float32, bulk=False)  # noqa: E731
    return KeyRotation(mean=small((layers, groups, head_dim)), basis=small((layers, groups, head_dim, head_dim)))


def _set_small(stacked, built, layer):
    """The small leaves of ``stacked`` (tail, rotation) with layer ``layer`` set to ``built``'s."""
    set_small = lambda dst, src: dst.at[layer].set(src.astype(dst.dtype))  # noqa: E731
    rotation = None if stacked.rotation is None else jax.tree.map(set_small, stacked.rotation, built.rotation)
    return set_small(stacked.tail, built.tail), rotation


def add_token(stacked, layer, position, key):
    """The new token of every group at ``layer``: ``(tail, rotation, block)``; reads no planes (either stacking)."""
    rotation = None if stacked.rotation is None else jax.tree.map(lambda a: a[layer], stacked.rotation)
    rotated = store_lib.rotate_keys(key[:, None, :], rotation)[:, 0]
    words, scale, tail = jax.vmap(store_lib.append_block)(stacked.tail[layer], position, rotated)
    return tail, rotation, PlaneBlock(words=words, scale=scale, tail=tail)


def packed_tails(stacked, length):
    """Every layer's partial newest block packed from its raw tail: ``(words, scales, block, due)``."""
    count = length % BLOCK_TOKENS
    words, scale = jax.vmap(jax.vmap(store_lib.pack_block), in_axes=(0, None))(stacked.tail, count)
    return words, scale, length // BLOCK_TOKENS, count > 0


@dataclasses.dataclass(frozen=True)
class OneTier:
    """Channel-major planes ``[L, R, D, 4, W]``, where the placement puts bulk leaves or (``in_hbm``) in HBM."""

    in_hbm: bool = False
    writes_per_token = 2  # plane words and scales (a decode cache holds a completion token per in-place write)

    @property
    def crosses_link(self) -> bool:
        """Whether a scan of an offloaded cache moves plane bytes over the link (not with every plane in HBM)."""
        return not self.in_hbm

    def bulk(self, data):
        where = "device" if self.in_hbm else True
        return dataclasses.replace(_small_like(data, False), planes=where, scales=where)

    def bulk_bytes(self, part, *, layers, capacity, head_dim) -> dict[str, int]:
        total = layers * part.nbytes(capacity=capacity, head_dim=head_dim)
        return {"planes": 0, "planes_hbm": total} if self.in_hbm else {part.kind: total}

    def empty(self, alloc, length, *, rotated, layers, groups, capacity, head_dim):
        bulk = "device" if self.in_hbm else True
        d = head_dim
        return PlaneStore(
            planes=alloc((layers, groups, d, N_PLANES, fmt.plane_words(capacity)), jnp.uint32, bulk=bulk),
            scales=alloc((layers, groups, d, capacity // BLOCK_TOKENS), jnp.float16, bulk=bulk),
            tail=alloc((layers, groups, BLOCK_TOKENS, d), jnp.float32, bulk=False), length=length,
            rotation=_rotation(alloc, rotated, layers=layers, groups=groups, head_dim=d))

    def write_layer(self, write, stacked, built, layer, length, importance=None):
        del importance  # no warm planes in one tier
        zero = jnp.zeros(built.length.shape, jnp.int32)
        tail, rotation = _set_small(stacked, built, layer)
        planes, tokens = write(stacked.planes, built.planes[None], zero, 4, layer)
        scales, more = write(stacked.scales, built.scales[None], zero, 3, layer)
        return PlaneStore(planes=planes, scales=scales, tail=tail, length=length, rotation=rotation), tokens + more

    def add_token(self, stacked, layer, position, key):
        tail, rotation, block = add_token(stacked, layer, position, key)
        return PlaneStore(planes=stacked.planes, scales=stacked.scales, tail=tail, length=position + 1,
                          rotation=rotation), block

    def write_blocks(self, write, stacked, words, scale, block, due, layer):
        """``(stacked, tokens)`` with each group's 64-token block number ``block [R]`` written where ``due`` (words
        ``[Ls, R, D, 4, 2]``, scales ``[Ls, R, D]`` for layers ``layer ..``); elsewhere the block index is past the
        end and the writes drop out."""
        block = jnp.where(due, block, stacked.scales.shape[-1])
        planes, tokens = write(stacked.planes, words, block * WORDS_PER_BLOCK, 4, layer)
        scales, more = write(stacked.scales, scale[..., None], block, 3, layer)
        return dataclasses.replace(stacked, planes=planes, scales=scales), tokens + more


@dataclasses.dataclass(frozen=True)
class TwoTiers:
    """Planes ``[0, p_l)`` of layer ``l`` and the block scales in HBM, planes ``[p_l, 4)`` in host memory, each tier
    plane-major (:class:`~fathom_jax.store.tiered.TieredPlaneStore`); written with one ``tier_write`` per layer.

    ``warm`` > 0: a warm tier ``[L, R, warm, W]`` in HBM holds copies of that many channel planes past the resident
    ones per layer and group (with no resident plane at all: from plane 0, the scales in HBM too), chosen when the
    layer is prefilled (from the prompt's importance) and written with every block after; the cold tier still holds
    them, so a read is the same bits wherever a plane comes from."""

    resident: tuple[int, ...]
    warm: int = 0

    crosses_link = True  # some layer keeps a plane in host memory (all four resident everywhere is one tier in HBM)

    @property
    def writes_per_token(self) -> int:
        """Both tiers in one write and the scales, and the warm rows where there are some: a decode cache allocates a
        completion token per write (a count that changed would change the step's signature)."""
        return 3 if self.warm else 2

    def bulk(self, data):
        warm = {} if self.warm == 0 else {"warm": "device", "warm_map": "device"}  # kernels read both at a group offset
        return dataclasses.replace(_small_like(data, False), hot="device", cold=True, scales="device", **warm)

    @property
    def hot_rows(self) -> int:
        """Rows of the hot tier: every layer's resident planes (one unread row where there are none: the warm tier
        beside a store with no resident plane, whose kernels take a hot tier all the same)."""
        return max(sum(self.resident), 1)

    def bulk_bytes(self, part, *, layers, capacity, head_dim) -> dict[str, int]:
        plane = head_dim * fmt.plane_words(capacity) * 4
        scales = layers * head_dim * (capacity // BLOCK_TOKENS) * 2
        warm = layers * self.warm * fmt.plane_words(capacity) * 4 + (layers * head_dim * N_PLANES * 4 if self.warm else 0)
        return {"planes": layers * N_PLANES * plane - sum(self.resident) * plane,
                "planes_hbm": self.hot_rows * plane + scales + warm}

    def empty(self, alloc, length, *, rotated, layers, groups, capacity, head_dim):
        d, w, hot = head_dim, fmt.plane_words(capacity), sum(self.resident)
        warm = {}
        if self.warm:  # a map of zeros: nothing warm until a layer is prefilled
            warm = dict(warm=alloc((layers, groups, self.warm, w), jnp.uint32, bulk="device"),
                        warm_map=alloc((layers, groups, d, N_PLANES), jnp.int32, bulk="device"))
        return TieredPlaneStore(
            cold=alloc((layers * N_PLANES - hot, groups, d, w), jnp.uint32),  # largest first (host memory)
            hot=alloc((self.hot_rows, groups, d, w), jnp.uint32, bulk="device"),
            scales=alloc((layers, groups, d, capacity // BLOCK_TOKENS), jnp.float16, bulk="device"),
            tail=alloc((layers, groups, BLOCK_TOKENS, d), jnp.float32, bulk=False), length=length,
            rotation=_rotation(alloc, rotated, layers=layers, groups=groups, head_dim=d), resident=self.resident,
            **warm)

    def write_layer(self, write, stacked, built, layer, length, importance=None):
        """Layer ``layer`` prefilled; with warm planes, ``importance [R, D]`` chooses them
        (:func:`~fathom_jax.store.tiered.warm_choice`)."""
        start = jnp.zeros(built.length.shape, jnp.int32)
        (hot, cold), tokens = write.tiers(stacked.tiers(layer), built.planes[None], start)
        tail, rotation = _set_small(stacked, built, layer)
        scales, more = write(stacked.scales, built.scales[None], start, 3, layer)
        stacked = dataclasses.replace(stacked, hot=hot, cold=cold, tail=tail, length=length, rotation=rotation,
                                      scales=scales)
        tokens += more
        if not self.warm:
            return stacked, tokens
        if importance is None:
            raise ValueError(f"a plane store with warm planes (warm_planes={self.warm}) chooses them from the prompt: "
                             "write_prompt needs its queries")
        resident = jnp.asarray(self.resident, jnp.int32)[layer]
        warm_map = warm_choice(importance, resident, self.warm)[None]  # [1, R, D, 4]
        # written like the other bulk leaves (in place where they live: a program returns no bulk leaf)
        warm_map_data, more = write(stacked.warm_map, warm_map, start, 3, layer)
        stacked = dataclasses.replace(stacked, warm_map=warm_map_data)
        stacked, warm_tokens = self._write_warm(write, stacked, built.planes[None], start, layer, warm_map)
        return stacked, tokens + more + warm_tokens

    def _write_warm(self, write, stacked, words, start, layer, warm_map=None):
        """``(stacked, tokens)`` with the warm rows of layers ``layer ..`` written from their plane words ``words [Ls,
        R, D, 4, M]`` at word ``start [R]`` (``warm_map [Ls, R, D, 4]``: theirs, by default the store's)."""
        ls, r, d, _, m = words.shape
        if warm_map is None:
            warm_map = jax.lax.dynamic_slice_in_dim(stacked.warm_map, jnp.asarray(layer, jnp.int32), ls)
        sources, _ = warm_sources(warm_map, self.warm)  # [Ls, R, S]: rows no plane is mapped to copy a harmless one
        rows = jnp.take_along_axis(words.reshape(ls, r, d * N_PLANES, m), sources[..., None], axis=2)
        warm, tokens = write(stacked.warm, rows, start, 3, layer)
        return dataclasses.replace(stacked, warm=warm), tokens

    def add_token(self, stacked, layer, position, key):
        tail, rotation, block = add_token(stacked, layer, position, key)
        return dataclasses.replace(stacked, tail=tail, length=position + 1, rotation=rotation), block

    def write_blocks(self, write, stacked, words, scale, block, due, layer):
        """As :meth:`OneTier.write_blocks`, each plane to its tier (and to its warm row where it has one)."""
        block = jnp.where(due, block, stacked.scales.shape[-1])
        (hot, cold), tokens = write.tiers(stacked.tiers(layer), words, block * WORDS_PER_BLOCK)
        scales, more = write(stacked.scales, scale[..., None], block, 3, layer)
        stacked = dataclasses.replace(stacked, hot=hot, cold=cold, scales=scales)
        if not self.warm:
            return stacked, tokens + more
        stacked, warm_tokens = self._write_warm(write, stacked, words, block * WORDS_PER_BLOCK, layer)
        return stacked, tokens + more + warm_tokens
