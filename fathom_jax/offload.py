"""One sparse-attention step with the key index and the K/V rows in host memory (the paper's regime).

Per (sequence, KV head) group, inside one jitted function and with no host synchronisation:

1. plan: importance (Eq. 3) and depths by bisection (Eq. 4) for the G query heads;
2. read: ``run_gather`` copies the first ``t_j`` planes and the scales of every active channel from the
   host store into an HBM staging buffer - one contiguous run per (channel, plane), a fixed-size run list;
3. scan: ``plane_scan`` over the staged planes (queries reordered to the staged channels);
4. select: 4 sink + 32 local + top-(k - 36) per query head (``topk`` kernel), then the group's union;
5. fetch: ``row_fetch`` copies the union's K/V rows from host memory;
6. attend: exact softmax attention of each head over its own k rows.

On a GPU, :func:`to_host` places the arrays in ``pinned_host`` memory and the Pallas kernels read them
there directly; elsewhere (CPU tests, interpret mode) they stay in device memory and the same code runs.
Host arrays are kept flat (``[B * Hkv, ...]``): inside ``jit`` no XLA op may touch a ``pinned_host``
array, a reshape included, so only the kernels read them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt32

from fathom_jax import planner as planner_lib
from fathom_jax.select import LOCAL_TOKENS, SINK_TOKENS, attend, group_union, select_topk
from fathom_jax.store import PlaneStore
from pallas_kernels.plane_scan import active_channels, plane_scan
from pallas_kernels.row_fetch import row_fetch
from pallas_kernels.run_gather import run_gather


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostKV:
    """The offloaded index and cache of ``BH = batch x KV heads`` groups (flat leading axis)."""

    planes: UInt32[Array, "BH D 4 W"]
    scales: Float[Array, "BH D NB"]
    keys: Float[Array, "BH n Dh"]
    values: Float[Array, "BH n Dh"]
    length: Int[Array, "BH"]


def host_memory_kind() -> str | None:
    """``"pinned_host"`` where the default device offers it (GPUs), else None (stay in device memory)."""
    device = jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    return "pinned_host" if "pinned_host" in kinds and jax.default_backend() == "gpu" else None


def to_host(store: PlaneStore, keys: Float[Array, "*B n Dh"], values: Float[Array, "*B n Dh"]) -> HostKV:
    """Flatten the store and the K/V cache to ``[B * Hkv, ...]`` and move them to host memory (on a GPU).

    ``store`` must be in the raw key basis (no rotation) and cover the same tokens as ``keys``.
    """
    if store.rotation is not None:
        raise ValueError("to_host: the offloaded step scans raw planes; build the store without a rotation")
    batch = store.batch_shape
    if keys.shape[:-2] != batch or values.shape != keys.shape:
        raise ValueError(f"to_host: keys/values must be [*{batch}, n, Dh] like the store, got {keys.shape}, {values.shape}")
    if keys.shape[-2] > store.capacity:
        raise ValueError(f"to_host: {keys.shape[-2]} cached rows exceed the store capacity {store.capacity}")
    flat = lambda x: jnp.asarray(x).reshape(-1, *x.shape[len(batch):])
    arrays = dict(planes=flat(store.planes), scales=flat(store.scales), keys=flat(keys), values=flat(values))
    kind = host_memory_kind()
    if kind is not None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
        arrays = {name: jax.device_put(a, sharding) for name, a in arrays.items()}
    return HostKV(**arrays, length=store.length.reshape(-1))


@functools.partial(
    jax.jit, static_argnames=("budget", "k", "max_active", "sink", "local", "implementation", "interpret")
)
def offload_attention(
    q: Float[Array, "BH G D"],
    host: HostKV,
    variance: Float[Array, "BH D"],
    *,
    budget: int,
    k: int,
    max_active: int | None = None,
    sink: int = SINK_TOKENS,
    local: int = LOCAL_TOKENS,
    implementation: str = "pallas",
    interpret: bool | None = None,
) -> tuple[Float[Array, "BH G Dh"], Float[Array, "BH"]]:
    """Fathom sparse attention of the G query heads of every group against its host-resident cache.

    Returns the attention output and the bits per token the scan read. ``max_active`` (static) sizes
    the run list; the default ``min(D, budget)`` can hold every active channel (each reads >= 1 plane).
    ``implementation="xla"`` runs the kernels' jnp references (for checking; on a GPU it cannot read
    ``pinned_host`` arrays).
    """
    bh, g, d = q.shape
    if host.planes.shape[:2] != (bh, d):
        raise ValueError(f"offload_attention: q is [{bh}, {g}, {d}] but the store holds {host.planes.shape[:2]}")
    if k > host.keys.shape[1]:
        raise ValueError(f"offload_attention: k={k} is larger than the {host.keys.shape[1]} cached rows")
    kernel = dict(implementation=implementation, interpret=interpret)
    plan = planner_lib.plan_bisection(planner_lib.importance(q, variance), budget)
    channels, depths = active_channels(plan.depths, max_active or min(d, budget))
    staged_planes, staged_scales = run_gather(host.planes, host.scales, channels, depths, **kernel)
    q_staged = jnp.take_along_axis(q.astype(jnp.float32), channels[:, None, :], axis=-1)  # [BH, G, C]
    slots = jnp.broadcast_to(jnp.arange(channels.shape[-1], dtype=jnp.int32), channels.shape)
    scores = plane_scan(q_staged, staged_planes, staged_scales, host.length, slots, depths, assume_sorted=True, **kernel)
    idx, mask = select_topk(scores[..., : host.keys.shape[1]], host.length, k, sink=sink, local=local,
                            implementation=implementation)
    union, union_mask, member = group_union(idx, mask)
    k_rows, v_rows, _ = row_fetch(host.keys, host.values, jnp.where(union_mask, union, -1), **kernel)
    return attend(q, k_rows, v_rows, member), plan.bits_per_token
