"""Where the key index and the K/V cache live: a placement is data, not a second code path.

    Placement()                          # everything in device memory (HBM)
    Placement("pinned_host")             # index planes/scales, landmarks and K/V rows in host memory
    Placement("pinned_host", mesh=mesh)  # ... split over the mesh's devices on the group axis
    Placement("pinned_host", resident_planes=1)   # ... but the top plane of every channel (and the scales) in HBM
    Placement("pinned_host", resident_planes=1, warm_planes=16)  # ... and 16 more channel planes per layer and group
    Placement("pinned_host", warm_planes=40)   # ... or no whole plane: 40 channel planes per layer and group, scales

A cache is a pytree whose *bulk* leaves grow with the context (bit planes, block scales, landmark means, K/V rows:
each cache type says which of its leaves are bulk, as a tree like it: True for a bulk leaf, ``"device"`` for a bulk
leaf kept in device memory whatever the placement, False for a small one); everything else (raw tails, lengths,
rotations) is small and always stays in device memory. ``resident_planes`` keeps the top planes of every plane
store's channels in device memory (per layer, or one count for all;
:mod:`fathom_jax.index.plane_stacking`); ``warm_planes`` keeps that many more channel planes per layer and KV group
there (and the block scales), the ones past the resident planes the prompt's queries make the planner read most
(:func:`fathom_jax.store.tiered.warm_choice`; ``results/plane_reuse.md``). :meth:`Placement.put` and :meth:`Placement.zeros`
put each leaf where it belongs. How a decode step reads and writes a placed cache is
:class:`fathom_jax.decode.StepConfig`'s business, not the placement's.

Host memory is reached only through the Pallas kernels: inside ``jit`` no XLA op may touch a ``pinned_host``
array (a slice or a reshape included), so with ``"pinned_host"`` on a GPU the implementation must be
``"triton"``. Where the backend has no ``pinned_host`` memory (CPU tests, interpret mode), the same layout and
the same code run in device memory, and :attr:`Placement.note` says so.

Stacked caches are ``[L, R, ...]``: layers first, then the group axis ``R = batch x KV heads`` (sequence major).
Under a mesh, ``R`` is split over the mesh axis: each device scans, selects and fetches for its own groups from its
own slice of host memory (:meth:`Placement.per_group`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from fathom_jax import distributed
from pallas_kernels import backend

Memory = Literal["device", "pinned_host"]
MEMORIES: tuple[str, ...] = get_args(Memory)
GROUP_AXIS = 1  # of every stacked cache leaf [L, R, ...]


def host_memory_available() -> bool:
    """Whether the default device offers ``pinned_host`` memory (GPUs do; CPUs here do not)."""
    if jax.default_backend() != "gpu":
        return False
    return "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}


def device_mesh(devices: int, axis: str = "x") -> jax.sharding.Mesh | None:
    """A one-axis mesh of the first ``devices`` devices for ``Placement(mesh=...)``; None for one device. With
    several processes (:mod:`fathom_jax.distributed`) it spans them all, ``devices / processes`` from each."""
    return distributed.global_mesh(devices, axis)


# -- bulk and small leaves ----------------------------------------------------------------------------------
# ``bulk`` below is a tree like the cache with a bool per leaf (``cache.bulk()``): True where the leaf grows with the
# context. An absent part (None) is None in both.

def _with_mask(fn, tree, bulk):
    return jax.tree.map(fn, tree, bulk)


def split_bulk(tree, bulk):
    """``(small, bulk_leaves)``: ``tree`` with its bulk leaves replaced by None, and with its other leaves replaced
    by None (a program can then donate the small leaves alone; :func:`join_bulk` is the inverse)."""
    small = _with_mask(lambda x, b: None if b else x, tree, bulk)
    return small, _with_mask(lambda x, b: x if b else None, tree, bulk)


def join_bulk(small, bulk_leaves):
    """The tree :func:`split_bulk` split."""
    return jax.tree.map(lambda a, b: b if a is None else a, small, bulk_leaves, is_leaf=lambda x: x is None)


def attach_bulk(small, full, bulk):
    """``small`` (a program's output without the bulk leaves it wrote in place) with the bulk leaves of ``full``."""
    return join_bulk(small, split_bulk(full, bulk)[1])


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where bulk cache arrays live (``memory``) and over which devices (``mesh``, split on ``axis``)."""

    memory: Memory = "device"
    mesh: jax.sharding.Mesh | None = None
    axis: str | None = None
    resident_planes: int | tuple[int, ...] = 0
    warm_planes: int = 0

    def __post_init__(self):
        if self.memory not in MEMORIES:
            raise ValueError(f"placement memory must be one of {MEMORIES}, got {self.memory!r}")
        counts = self.resident_planes if isinstance(self.resident_planes, tuple) else (self.resident_planes,)
        if not counts or not all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= 4 for p in counts):
            raise ValueError(f"placement resident_planes must be an int in [0, 4] or a tuple of them (one per layer), "
                             f"got {self.resident_planes!r}")
        if any(counts) and not self.offloaded:
            raise ValueError("placement resident_planes keeps planes in device memory out of a pinned_host index: "
                             "use it with memory='pinned_host' (in device memory every plane is resident)")
        if not isinstance(self.warm_planes, int) or isinstance(self.warm_planes, bool) or self.warm_planes < 0:
            raise ValueError(f"placement warm_planes must be an int >= 0 (channel planes per layer and KV group), got "
                             f"{self.warm_planes!r}")
        if self.warm_planes and not self.offloaded:
            raise ValueError(f"placement warm_planes={self.warm_planes} keeps channel planes of a pinned_host index in "
                             "device memory: use it with memory='pinned_host' (in device memory every plane is)")
        if self.mesh is not None:
            if self.axis is None:
                object.__setattr__(self, "axis", self.mesh.axis_names[0])
            if self.axis not in self.mesh.axis_names:
                raise ValueError(f"placement axis {self.axis!r} is not an axis of the mesh {self.mesh.axis_names}")

    @classmethod
    def parse(cls, spec: "str | Placement | None", **kwargs) -> "Placement":
        """``"device"`` / ``"hbm"`` / ``"pinned_host"`` / ``"host"`` (or a Placement, or None = device)."""
        if isinstance(spec, Placement):
            return spec
        aliases = {None: "device", "device": "device", "hbm": "device", "pinned_host": "pinned_host", "host": "pinned_host"}
        if spec not in aliases:
            raise ValueError(f"placement must be one of 'device' (alias 'hbm') or 'pinned_host' (alias 'host'), got {spec!r}")
        return cls(aliases[spec], **kwargs)

    # -- where things are ---------------------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        """The offloaded layout was asked for (the code path; the memory may still be the device's)."""
        return self.memory == "pinned_host"

    @property
    def memory_kind(self) -> str:
        """The memory bulk arrays really go to: ``pinned_host`` where the backend has it, else ``device``."""
        return "pinned_host" if self.offloaded and host_memory_available() else "device"

    @property
    def in_host_memory(self) -> bool:
        """Bulk arrays are in real host memory: the kernels read and write them in place, XLA never touches them."""
        return self.memory_kind == "pinned_host"

    def resident(self, layers: int) -> tuple[int, ...]:
        """Resident planes per layer for a cache of ``layers`` layers (ValueError if a per-layer tuple disagrees)."""
        if isinstance(self.resident_planes, tuple):
            if len(self.resident_planes) != layers:
                raise ValueError(f"placement resident_planes has {len(self.resident_planes)} entries, the cache has "
                                 f"{layers} layers")
            return self.resident_planes
        return (self.resident_planes,) * layers

    @property
    def note(self) -> str | None:
        """A sentence for the user when the offloaded layout runs in device memory."""
        if self.offloaded and self.memory_kind != "pinned_host":
            return (f"the {jax.default_backend()} backend has no pinned_host memory: running the offloaded "
                    "layout (and its kernels) in device memory")
        return None

    @property
    def num_shards(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape[self.axis]

    @property
    def local_shards(self) -> int:
        """The shards this process holds (its own devices of the mesh; all of them in one process)."""
        return round(self.num_shards * distributed.local_share(self.mesh))

    def check(self, implementation: backend.Implementation | None) -> backend.Implementation:
        """Resolve the implementation for this placement (host memory is read by the kernels only)."""
        implementation = backend.resolve_implementation(implementation)
        if self.in_host_memory and implementation != "triton":
            raise ValueError(
                "placement 'pinned_host' on a GPU needs implementation='triton': XLA ops cannot read host "
                "memory inside jit, only the Pallas kernels can"
            )
        return implementation

    def check_groups(self, groups: int) -> None:
        if groups % self.num_shards:
            raise ValueError(
                f"the mesh axis {self.axis!r} has {self.num_shards} devices but there are {groups} groups "
                f"(batch x KV heads); use a batch that makes batch x KV heads a multiple of {self.num_shards}"
            )

    # -- shardings ----------------------------------------------------------------------------
    def sharding(self, ndim: int, *, bulk: bool | str, split: bool = True) -> jax.sharding.Sharding:
        """The sharding of a cache leaf of rank ``ndim`` (group axis 1 split over the mesh if ``split``); ``bulk``
        True: in :attr:`memory_kind`; False or ``"device"``: in device memory."""
        kind = self.memory_kind if bulk is True else "device"
        if self.mesh is None:
            return SingleDeviceSharding(jax.local_devices()[0], memory_kind=kind)
        spec = P(None, self.axis) if split and ndim >= 2 else P()
        return NamedSharding(self.mesh, spec, memory_kind=kind)

    def replicated(self) -> jax.sharding.Sharding:
        if self.mesh is None:
            return SingleDeviceSharding(jax.local_devices()[0])
        return NamedSharding(self.mesh, P())

    def replicate(self, tree):
        """``tree`` replicated over the mesh (weights, hook statistics); unchanged without a mesh."""
        if self.mesh is None:
            return tree
        return distributed.put(tree, jax.tree.map(lambda _: self.replicated(), tree))

    def shardings(self, tree, bulk):
        """Per-leaf shardings of a cache pytree (bulk leaves in :attr:`memory_kind`, the rest on device)."""
        def one(x, is_bulk):
            split = x.ndim >= 2 and self.mesh is not None and x.shape[GROUP_AXIS] % self.num_shards == 0
            return self.sharding(x.ndim, bulk=is_bulk, split=split)

        return _with_mask(one, tree, bulk)

    def put(self, tree, bulk):
        """``tree`` with every leaf placed (see :meth:`shardings`; across processes each places its own shards)."""
        return distributed.put(tree, self.shardings(tree, bulk))

    def zeros(self, shape, dtype, *, bulk: bool | str = True):
        """A zero-filled cache array of ``shape`` placed where it belongs.

        A host array whose shard fits in 90% of the free HBM is made there and copied out: a
        ``device_put`` of host data into ``pinned_host`` passes through a second host buffer of the same
        size, so filling a cache that way needs its bytes plus its largest array in host memory (a cache
        larger than half the host's memory could not be filled). A larger array (a cache bigger than HBM)
        still comes from (lazily allocated) zero pages on the host.
        """
        sharding = self.sharding(len(shape), bulk=bulk, split=len(shape) >= 2)
        if bulk is True and self.in_host_memory and not _fits_in_hbm(shape, dtype, sharding):
            return distributed.zeros(shape, dtype, sharding)
        return _zeros_program(tuple(shape), jnp.dtype(dtype), sharding)()

    # -- running per-group work over the mesh ------------------------------------------------
    def group_spec(self, x, group_axis: int | None) -> P:
        """The partition spec of ``x`` whose groups sit on ``group_axis`` (None: replicated)."""
        if group_axis is None or jnp.ndim(x) <= group_axis:
            return P()
        return P(*([None] * group_axis), self.axis)

    def per_group(self, fn, *args, axes, out_axes):
        """``fn(*args)``, run per shard of the group axis under ``shard_map`` when there is a mesh.

        ``axes[i]`` is the group axis of every leaf of ``args[i]`` (0 for ``[R, ...]``, 1 for stacked
        ``[L, R, ...]``, None: replicated; a leaf with fewer dimensions is replicated, e.g. per-sequence
        lengths); ``out_axes`` likewise for the outputs (an int for all, or a pair of a pytree shaped like the
        output and its group axis). The Pallas kernels run per shard, on each device's own groups and its own
        slice of host memory. Without a mesh this is ``fn(*args)``.
        """
        if self.mesh is None:
            return fn(*args)
        in_specs = tuple(jax.tree.map(lambda x, ax=ax: self.group_spec(x, ax), a) for a, ax in zip(args, axes))
        if isinstance(out_axes, int):
            out_specs = P(*([None] * out_axes), self.axis)
        else:
            like, axis_of = out_axes
            out_specs = jax.tree.map(lambda x: self.group_spec(x, axis_of), like)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def _fits_in_hbm(shape, dtype, sharding, fraction: float = 0.9) -> bool:
    """Whether one shard of a ``shape`` array takes at most ``fraction`` of every device's free memory."""
    shard = np.prod(sharding.shard_shape(tuple(shape)), dtype=np.int64) * np.dtype(dtype).itemsize
    for device in sharding.addressable_devices:  # another process's devices are its own business
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return False
        if shard > fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _zeros_program(shape: tuple[int, ...], dtype, sharding):
    """The program that makes zeros of ``shape`` placed by ``sharding``: one per (shape, dtype, sharding), so every
    cache of a layout allocates through programs compiled once (a fresh ``jit`` per call compiled each time)."""
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)
