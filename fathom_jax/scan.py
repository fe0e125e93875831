"""Approximate scores of every key for the G query heads of each KV group, from any method's read.

    result = scan_scores(method, q, index, calib)          # jit with method static; vmap over layers
    result.scores [*B, G, n] (f32, -inf past length), result.bits_per_token [*B], result.depths [*B, D]

A method plans its read (:meth:`~fathom_jax.methods.ScanMethod.read`); :func:`execute` carries it out:

* plane reads: ``implementation="xla"`` dequantizes the store (the reference); ``"triton"`` runs the
  plane-scan kernel over the active channels only (never a dequantized copy). A decode cache's stacked
  ``[L, R, ...]`` stores, in device or host memory, are read by :mod:`fathom_jax.decode.reads`;
* block reads score one row per block of tokens (the landmark's 8-token block mean, Quest's page bounds) and
  spread the score over the block;
* key reads score the keys themselves (the exact oracle; dense attention).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from fathom_jax import store as store_lib
from fathom_jax.calibrate import Calibration
from fathom_jax.index import KeyIndex
from fathom_jax.methods.base import BlockRead, KeyRead, PlaneRead, Read, ScanMethod
from pallas_kernels import backend
from pallas_kernels.plane_scan import PlaneScanConfig, plane_scan


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScanResult:
    """Approximate scores ``[*B, G, n]`` (f32, ``-inf`` past length) and bits per token ``[*B]``.

    ``depths [*B, D]`` are the planes read per channel (in the scanned store's basis) for the
    plane-store methods (the union for the SparQ union); None for landmark, Quest, exact and dense.
    """

    scores: Float[Array, "*B G n"]
    bits_per_token: Float[Array, "*B"]
    depths: Int[Array, "*B D"] | None = None


def dot(q: jax.Array, k: jax.Array) -> jax.Array:
    return jnp.einsum("...gd,...nd->...gn", q, k, precision=jax.lax.Precision.HIGHEST)


def check_scan_inputs(method: ScanMethod, q, index: KeyIndex, calib: Calibration | None, where: str = "scan_scores"):
    """Trace-time checks of a scan's arguments; returns ``q`` as f32."""
    if not isinstance(method, ScanMethod):
        raise TypeError(f"{where}: method must be a ScanMethod (fathom_jax.methods), got {method!r}")
    if not isinstance(index, KeyIndex):
        raise TypeError(f"{where}: index must be a KeyIndex (from build_index), got {type(index).__name__}")
    q = jnp.asarray(q)
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(f"{where}: q must be floating point, got dtype {q.dtype}")
    batch, d = index.batch_shape, index.head_dim
    if q.ndim != len(batch) + 2:
        raise ValueError(f"{where}: q must be [*B, G, D] with *B = {batch} (rank {len(batch) + 2}), got shape {q.shape}")
    if q.shape[:-2] != batch:
        raise ValueError(f"{where}: q leading axes {q.shape[:-2]} do not match the index's {batch}")
    if q.shape[-1] != d:
        raise ValueError(f"{where}: q head_dim {q.shape[-1]} does not match the keys' head_dim {d}")
    method.validate(d)
    missing = sorted(part.name for part in method.parts if part not in index.parts)
    if missing:
        raise ValueError(f"{where}: {method.label} needs index parts {missing}; pass it to build_index")
    if method.needs_calibration:
        if calib is None:
            raise ValueError(f"{where}: {method.label} needs calib")
        if calib.head_dim != d:
            raise ValueError(f"{where}: calib head_dim {calib.head_dim} does not match q head_dim {d}")
        if calib.batch_shape != batch:
            raise ValueError(f"{where}: calib leading axes {calib.batch_shape} do not match q's {batch}")
    return q.astype(jnp.float32)


def execute(read: Read, index: KeyIndex, length: Int[Array, "*B"], *,
            implementation: backend.Implementation = "xla") -> Float[Array, "*B G n"]:
    """Raw scores ``read.queries . k_hat`` (plus the read's shift) of every stored position of an index in device
    memory; positions past ``length`` are not masked here (:func:`mask_invalid`). The decode step's reads of a
    stacked cache, in device or host memory, are :mod:`fathom_jax.decode.reads`."""
    return read.scores(IndexSource(index, length, implementation))


@dataclasses.dataclass(frozen=True)
class IndexSource:
    """The :class:`~fathom_jax.methods.base.ReadSource` of an index in device memory."""

    index: KeyIndex
    length: Int[Array, "*B"]
    implementation: backend.Implementation = "xla"
    scan: PlaneScanConfig | None = None  # the plane scan's configuration (None: its default)

    def plane_scores(self, read: PlaneRead) -> Float[Array, "*B G n"]:
        store = dataclasses.replace(self.index[read.part], length=self.length)
        if self.implementation == "xla":
            return dot(read.queries, store_lib.dequantize(store, read.depths))
        if isinstance(store, store_lib.UnpackedStore):
            raise ValueError("an unpacked store (fathom_jax.store.UnpackedStore) is read by the 'xla' scan only; "
                             "the Pallas kernels read packed planes")
        return plane_scan(read.queries, store.planes_at(), self.length, read.runs(), implementation=self.implementation,
                          config=self.scan)

    def block_scores(self, read: BlockRead) -> Float[Array, "*B G n"]:
        return block_scores(read, self.index[read.part].rows)

    def key_scores(self, read: KeyRead) -> Float[Array, "*B G n"]:
        return dot(read.queries, self.index["keys"].astype(jnp.float32))


def block_scores(read: BlockRead, rows: Float[Array, "*B NB F"]) -> Float[Array, "*B G n"]:
    """``read.queries . row`` of every block's row, spread over the block's tokens."""
    return jnp.repeat(dot(read.queries, rows.astype(jnp.float32)), read.block, axis=-1)


def mask_invalid(scores: jax.Array, length: jax.Array) -> jax.Array:
    valid = jnp.arange(scores.shape[-1]) < length[..., None, None]
    return jnp.where(valid, scores, -jnp.inf)


def scan_scores(
    method: ScanMethod,
    q: Float[Array, "*B G D"],
    index: KeyIndex,
    calib: Calibration | None = None,
    *,
    implementation: backend.Implementation | None = None,
) -> ScanResult:
    """Approximate scores of every key for the G query heads of each KV group, and the bits read.

    jit with ``method`` (and ``implementation``) static (``jax.jit(scan_scores, static_argnums=0,
    static_argnames="implementation")``); vmap over leading axes of ``q``, ``index`` and ``calib``
    together (e.g. layers). ``implementation``: ``"xla"`` (the reference), ``"triton"`` (the plane-scan
    kernel), ``None`` (triton on a GPU, xla elsewhere).
    """
    implementation = backend.resolve_implementation(implementation)
    q = check_scan_inputs(method, q, index, calib)
    read = method.read(q, index, calib, implementation=implementation)
    scores = execute(read, index, index.length, implementation=implementation)
    return ScanResult(scores=mask_invalid(scores, index.length), bits_per_token=read.bits.astype(jnp.float32),
                      depths=read.depths)
