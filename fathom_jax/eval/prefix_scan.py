"""A method's scores at every decode position of a window at once: the numbers of a scan per position, bit
for bit, for the work of about one (XLA:CPU).

At position p the decode-time index is the window's index cut to length ``p + 1``
(:func:`~fathom_jax.index.prefix_index`): its complete blocks are the window's, one block is requantized
(re-averaged for landmarks, its bounds recomputed for Quest), and its scores are ``dot(queries, k_hat)
(+ shift)`` with keys at or past the length masked. The queries and per-channel depths differ per position;
the keys read do not, except in that one block. On XLA:CPU a float32 dot computes every output as one chain
of fused multiply-adds over the contracted axis, in order, starting from zero (pinned by
``tests/eval/test_fidelity.py``). A zero product leaves the running sum as it is (a sum that is exactly zero
is +0, whatever zeros it met), so:

* plane reads: with ``V_t`` the window dequantized at uniform depth t and the contraction laid out as
  (channel, depth) pairs, ``W[n, (d, t)] = V_t[n, d]`` and ``Q[g, (d, t)] = q[g, d]`` where ``t`` is channel
  d's depth, else 0, give ``dot(Q, W)[g, n]`` = the chain of ``q[g, d] * V_{t_d}[n, d]`` over d in order = the
  position's own score. ``W`` is shared, so every position's scores are one matrix product;
* block reads (landmark, Quest) and key reads already share what they read;

and only the requantized block is scored per position, against its own keys.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from fathom_jax import store as store_lib
from fathom_jax.format import BLOCK_TOKENS, N_PLANES
from fathom_jax.index import KeyIndex, prefix_index
from fathom_jax.index.parts import Planes
from fathom_jax.methods.base import BlockRead, KeyRead, PlaneRead, ScanMethod
from fathom_jax.scan import check_scan_inputs, dot, mask_invalid


def prefix_scores(
    method: ScanMethod,
    queries: Float[Array, "P *B G D"],
    full: KeyIndex,
    keys: Float[Array, "*B n D"],
    lengths: Int[Array, "P"],
    calib=None,
    *,
    windows: dict[str, Float[Array, "*B n K"]] | None = None,
) -> tuple[Float[Array, "P *B G n"], Float[Array, "P *B"]]:
    """``scan_scores(method, queries[i], prefix_index(full, keys, lengths[i]), calib)`` for every i, as
    ``(scores, bits_per_token)``. ``full`` is the index of all the ``keys`` with an unpacked store
    (:func:`~fathom_jax.index.unpack_index`) for plane methods; reads use the index only for its rotation.
    ``windows``: :func:`plane_windows` of ``full``, to share between methods (computed here when None)."""

    def read_one(q):
        return method.read(check_scan_inputs(method, q, full, calib), full, calib)

    read = jax.vmap(read_one)(queries)  # plans and rotations: batched, they round the same
    if getattr(read, "shift", None) is not None:
        # A matrix-vector product (the KLT and Loki shift q . mu), which XLA:CPU rounds by its number of rows:
        # position by position, as the scan computes it (XLA drops the rest of this read).
        read = dataclasses.replace(read, shift=jax.lax.map(lambda q: read_one(q).shift, queries))
    scores = read.scores(_PrefixSource(full, keys, lengths, windows))
    batch = lengths.shape + full.batch_shape
    scores = jax.vmap(mask_invalid)(scores, jnp.broadcast_to(lengths.reshape(-1, *[1] * len(full.batch_shape)), batch))
    return scores, read.bits.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _PrefixSource:
    """The :class:`~fathom_jax.methods.base.ReadSource` of every prefix ``lengths [P]`` of ``full`` at once."""

    full: KeyIndex
    keys: Float[Array, "*B n D"]
    lengths: Int[Array, "P"]
    windows: dict[str, Float[Array, "*B n K"]] | None

    def plane_scores(self, read: PlaneRead):
        window = self.windows[read.part] if self.windows else _window(self.full[read.part])
        return _plane_scores(read, window, self.full, self.keys, self.lengths)

    def block_scores(self, read: BlockRead):
        return _block_scores(read, self.full, self.keys, self.lengths)

    def key_scores(self, read: KeyRead):
        return _shared_dot(read.queries, self.full["keys"].astype(jnp.float32))


def plane_windows(full: KeyIndex) -> dict[str, Float[Array, "*B n K"]]:
    """``W`` of every plane store of ``full`` (by part): the window at depths 1..4, ``[*B, n, (D, 4)]``."""
    return {part.name: _window(full[part.name]) for part in full.parts if isinstance(part, Planes)}


def _window(store) -> Float[Array, "*B n K"]:
    window = store_lib.dequantize_levels(store)  # [*B, n, D, 4]
    return window.reshape(*window.shape[:-2], -1)


def _plane_scores(read: PlaneRead, window, full: KeyIndex, keys, lengths):
    levels = jnp.arange(1, N_PLANES + 1)
    picked = read.depths[..., None, :, None] == levels  # [P, *B, 1, D, 4]
    spread = jnp.where(picked, read.queries[..., None], 0.0).reshape(*read.queries.shape[:-1], -1)
    scores = _shared_dot(spread, window)

    def block_scores(queries, depths, length):
        cut = prefix_index(full, keys, length)[read.part]
        return dot(queries, store_lib.dequantize_block(cut, depths))  # [*B, G, 64]

    blocks = jax.vmap(block_scores)(read.queries, read.depths, lengths)
    return _replace_block(scores, blocks, lengths // BLOCK_TOKENS, BLOCK_TOKENS)


def _block_scores(read: BlockRead, full: KeyIndex, keys, lengths):
    size = read.block
    scores = _shared_dot(read.queries, full[read.part].rows.astype(jnp.float32))  # [P, *B, G, n / size]

    def block_scores(queries, length):
        cut = prefix_index(full, keys, length)[read.part].rows
        block = jnp.minimum(length // size, cut.shape[-2] - 1)  # = n / size: no partial block, no row read
        return dot(queries, jax.lax.dynamic_slice_in_dim(cut, block, 1, axis=-2).astype(jnp.float32))  # [*B, G, 1]

    blocks = jax.vmap(block_scores)(read.queries, lengths)
    scores = _replace_block(scores, blocks, lengths // size, 1)
    return jnp.repeat(scores, size, axis=-1)


def _shared_dot(queries: Float[Array, "P *B G K"], rows: Float[Array, "*B n K"]) -> Float[Array, "P *B G n"]:
    """Every position's queries against the same rows: :func:`~fathom_jax.scan.dot` for each position."""
    return jnp.einsum("p...gk,...nk->p...gn", queries, rows, precision=jax.lax.Precision.HIGHEST)


def _replace_block(scores, blocks, block, size):
    """``scores [P, *B, G, n]`` with columns ``[block * size, (block + 1) * size)`` of every position taken
    from ``blocks [P, *B, G, size]`` (none where the block lies past the end)."""
    *lead, n = scores.shape
    in_block = jnp.arange(n // size)[:, None] == block.reshape(-1, *[1] * scores.ndim)  # [P, 1.., n / size, 1]
    return jnp.where(in_block, blocks[..., None, :], scores.reshape(*lead, n // size, size)).reshape(*lead, n)
