"""Where the key index and the K/V cache live: a placement is data, not a second code path.

    Placement()                          # everything in device memory (HBM)
    Placement("pinned_host")             # index planes/scales, landmarks and K/V rows in host memory
    Placement("pinned_host", mesh=mesh)  # ... sharded over the local GPUs on the group axis
    Placement("pinned_host", streams=2)  # ... each device's groups in two halves on two GPU streams
    Placement("pinned_host", pipeline=8) # ... each layer's groups in 8 chunks, transfers chained

A cache is a pytree whose *bulk* leaves (the fields named in :data:`BULK_FIELDS`: bit planes, block
scales, landmarks, stored keys, K/V rows) grow with the context; everything else (raw tails, lengths,
rotations) is small and always stays in device memory. :meth:`Placement.put` puts each leaf where it
belongs; the decode step reads bulk leaves through :meth:`Placement.stage` or the Pallas kernels (which
read ``pinned_host`` arrays in place), and writes them through the in-place ``cache_write`` kernel.

Host memory is reached only through the kernels: inside ``jit`` no XLA op may touch a ``pinned_host``
array (a slice or a reshape included), so with ``"pinned_host"`` on a GPU the implementation must be
``"pallas"``. Where the backend has no ``pinned_host`` memory (CPU tests, interpret mode), the same
layout and the same code run in device memory, and :attr:`Placement.note` says so.

Stacked caches are ``[L, R, ...]``: layers first, then the group axis ``R = batch x KV heads`` (sequence
major). Under a mesh, ``R`` is split over the mesh axis: each device scans, selects and fetches for
its own groups from its own slice of host memory. With ``streams > 1`` each device's groups are split
again, into chunks whose decode steps run on their own GPU streams (``jax.experimental.compute_on``): the
kernels of one layer are serial within a chunk, so streams are how one chunk's plane transfer could overlap
another's scan, selection and row fetch. On the H200 it has not paid so far (``results/streams_h200.md``:
XLA's command buffers put every kernel on one stream; without them the chunks overlap but contend for SMs).
Elsewhere the chunks run one after the other (same results).

With ``pipeline > 1`` each layer's groups are split into that many chunks in one stream of work: the plan
covers every group, then chunk ``i + 1``'s plane transfer (the run gather) is ordered after chunk ``i``'s and
depends on nothing else, so a runtime that runs independent kernels concurrently moves the next chunk's
planes over the link while this chunk is scanned, selected and its rows fetched. The programs of such a
placement ask XLA for exactly that (:attr:`Placement.compiler_options`: CUDA-graph nodes scheduled by
their data dependencies alone), and the gather runs as ``gather_programs`` persistent programs so that it
leaves SMs to the kernels beside it. One order is imposed beyond the data's: the next-to-last chunk's row fetch
waits for the last chunk's scan, which the rest of the layer waits on and which ran at half speed beside it
(:data:`fathom_jax.sparse_step.FETCH_AFTER_NEXT_SCAN`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config as jax_config  # the compute-type context (see _on_stream)
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from pallas_kernels import backend
from pallas_kernels.row_fetch import RowFetchConfig, row_fetch

Memory = Literal["device", "pinned_host"]
MEMORIES: tuple[str, ...] = get_args(Memory)
ReadMode = Literal["direct", "staged"]
IndexWrites = Literal["every_step", "full_blocks"]
BULK_FIELDS = frozenset({"planes", "scales", "landmarks", "keys", "kv"})
GROUP_AXIS = 1  # of every stacked cache leaf [L, R, ...]


def host_memory_available() -> bool:
    """Whether the default device offers ``pinned_host`` memory (GPUs do; CPUs here do not)."""
    if jax.default_backend() != "gpu":
        return False
    return "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}


def device_mesh(devices: int, axis: str = "x") -> jax.sharding.Mesh | None:
    """A one-axis mesh of the first ``devices`` devices for ``Placement(mesh=...)``; None for one device."""
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an int >= 1, got {devices!r}")
    have = jax.devices()
    if devices > len(have):
        raise ValueError(f"{devices} devices asked for, {len(have)} {jax.default_backend()} device(s) available")
    return None if devices == 1 else jax.sharding.Mesh(np.array(have[:devices]), (axis,))


def is_bulk(path) -> bool:
    """Whether a leaf at ``path`` (from ``tree_flatten_with_path``) is a bulk cache array."""
    last = path[-1] if path else None
    return isinstance(last, jax.tree_util.GetAttrKey) and last.name in BULK_FIELDS


def group_window(tree, start: int, size: int):
    """``tree`` with every per-group ``[R, ...]`` leaf cut to groups ``start .. start + size - 1``; bulk leaves
    (stacked ``[L, R, ...]`` cache arrays, possibly in host memory, where no XLA op may slice them) stay whole
    for the kernels to read at that group offset."""
    return jax.tree_util.tree_map_with_path(lambda path, x: x if is_bulk(path) else x[start:start + size], tree)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where bulk cache arrays live (``memory``), over which devices (``mesh``, ``axis``), and how a
    host-resident plane store is scanned (``read``): ``"staged"`` (the default: a run gather copies the
    planned runs to HBM at the link rate, then the scan reads HBM) or ``"direct"`` (the plane scan reads
    the planes from host memory as it computes; on the H200 it reaches under half the link: 165.9 against
    102.6 ms per 36-layer step at 1M tokens, NOTES.md).

    ``streams``: GPU streams per device over which each layer's groups are split (module docstring; 1, the
    default, measured fastest: ``results/streams_h200.md``). ``index_writes``: when a decode step writes the
    newest 64-token block of the plane stores, ``"every_step"`` (the stores always hold every key) or
    ``"full_blocks"`` (only the step that fills a block writes it: the partial block lives in device memory as
    the stores' raw ``tail``, from which every step scores it anyway; :meth:`SparseAttention.flush
    <fathom_jax.decode.SparseAttention.flush>` writes it on demand). In host memory each block write is 4 x D
    scattered 8-byte words per group and layer, ~5.5 ms of a 1M-token step on the H200.

    ``pipeline``: chunks per layer whose plane transfers are chained (module docstring; 1: no chunks);
    ``gather_programs``: persistent programs of the run gather (0: one program per copied chunk of a run).
    Both default to ``"auto"`` (:meth:`chunks`, :attr:`run_gather_programs`): on the H200, Fathom 48's
    36-layer step at 1M tokens took 79.9 ms in one chunk and 64.6 ms in 8 chunks with 66 gather programs;
    at 128k 19.5 and 18.2 ms with 2 chunks (``results/pipeline_h200.md``).

    ``scan_writes``: where the cache is written in place (:attr:`writes_in_place`), each layer writes its new
    K/V row and index blocks inside the layer scan, right after its step is planned, beside its transfers
    (:attr:`writes_in_scan`); False: every layer's at once after the scan. Device memory is always updated
    after the scan (functionally: XLA then writes the donated buffers in place).

    ``fetch_programs``: persistent programs of the row fetch (0: one program per 32 rows; "auto":
    :attr:`row_fetch_programs`). ``xla_options``: more XLA compiler options for the programs that run a step
    (``{name: value}``, stored as sorted pairs; added to :attr:`compiler_options`): the offloaded step programs and,
    in device memory, the generation and decode-loop programs. ``layer_unroll``: layers per iteration of the decode
    step's layer scan (``lax.scan(unroll=)``; 1, the default: one loop iteration per layer).

    ``row_cache``: device-memory slots per layer and group for K/V rows recent steps fetched (0, the default: none;
    :class:`fathom_jax.sparse_cache.RowCache`): a step then fetches only the rows its slots miss. It costs
    ``L x R x slots x (2 Dh x itemsize + 4)`` bytes of HBM and gives the same rows bit for bit."""

    memory: Memory = "device"
    mesh: jax.sharding.Mesh | None = None
    axis: str | None = None
    read: ReadMode = "staged"
    streams: int = 1
    index_writes: IndexWrites = "every_step"
    pipeline: int | Literal["auto"] = "auto"
    gather_programs: int | Literal["auto"] = "auto"
    scan_writes: bool = True
    fetch_programs: int | Literal["auto"] = "auto"
    xla_options: tuple = ()
    layer_unroll: int = 1
    row_cache: int = 0

    def __post_init__(self):
        if self.memory not in MEMORIES:
            raise ValueError(f"placement memory must be one of {MEMORIES}, got {self.memory!r}")
        if self.read not in get_args(ReadMode):
            raise ValueError(f"placement read must be 'direct' or 'staged', got {self.read!r}")
        if self.index_writes not in get_args(IndexWrites):
            raise ValueError(f"placement index_writes must be one of {get_args(IndexWrites)}, got {self.index_writes!r}")
        for name, least, auto in (("streams", 1, False), ("pipeline", 1, True), ("gather_programs", 0, True),
                                  ("fetch_programs", 0, True), ("layer_unroll", 1, False), ("row_cache", 0, False)):
            value = getattr(self, name)
            if auto and value == "auto":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                allowed = f"an int >= {least}" + (" or 'auto'" if auto else "")
                raise ValueError(f"placement {name} must be {allowed}, got {value!r}")
        try:
            options = dict(self.xla_options)  # a dict or (name, value) pairs
        except (TypeError, ValueError):
            options = {None: None}
        if not all(isinstance(name, str) and name.startswith("xla_") for name in options):
            raise ValueError(f"placement xla_options must map XLA option names (xla_...) to values, got {self.xla_options!r}")
        object.__setattr__(self, "xla_options", tuple(sorted(options.items())))
        if not isinstance(self.scan_writes, bool):
            raise ValueError(f"placement scan_writes must be a bool, got {self.scan_writes!r}")
        if self.streams > 1 and self.pipeline not in (1, "auto"):
            raise ValueError(f"placement streams={self.streams} and pipeline={self.pipeline}: choose one way to split "
                             "a layer's groups")
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
    def note(self) -> str | None:
        """A sentence for the user when the offloaded layout runs in device memory."""
        if self.offloaded and self.memory_kind != "pinned_host":
            return (f"the {jax.default_backend()} backend has no pinned_host memory: running the offloaded "
                    "layout (and its kernels) in device memory")
        return None

    @property
    def writes_in_place(self) -> bool:
        """Bulk arrays in real host memory are written in place by the kernels as a side effect, and the jitted
        programs take them as inputs only (XLA would copy a host array it had to return: see
        ``pallas_kernels.cache_write.cache_write_in_place``). Device memory keeps functional updates."""
        return self.memory_kind == "pinned_host"

    @property
    def writes_in_scan(self) -> bool:
        """Each layer's new K/V row and index blocks are written inside the layer scan (``scan_writes`` where the
        writes are in place)."""
        return self.scan_writes and self.writes_in_place

    @property
    def num_shards(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape[self.axis]

    def check(self, implementation: backend.Implementation | None) -> backend.Implementation:
        """Resolve the implementation for this placement (host memory is read by the kernels only)."""
        implementation = backend.resolve_implementation(implementation)
        if self.memory_kind == "pinned_host" and implementation != "pallas":
            raise ValueError(
                "placement 'pinned_host' on a GPU needs implementation='pallas': XLA ops cannot read host "
                "memory inside jit, only the Pallas kernels can"
            )
        return implementation

    def check_groups(self, groups: int) -> None:
        if groups % self.num_shards:
            raise ValueError(
                f"the mesh axis {self.axis!r} has {self.num_shards} devices but there are {groups} groups "
                f"(batch x KV heads); use a batch that makes batch x KV heads a multiple of {self.num_shards}"
            )
        for name in ("streams", "pipeline"):
            if getattr(self, name) != "auto" and (groups // self.num_shards) % getattr(self, name):
                raise ValueError(
                    f"placement {name}={getattr(self, name)} must divide the {groups // self.num_shards} groups "
                    f"(batch x KV heads) of each device; use a divisor of it"
                )

    # -- pipelined chunks ----------------------------------------------------------------------
    @property
    def pipelines(self) -> bool:
        """Whether a step may run in pipelined chunks (host memory, staged reads, no streams)."""
        return self.offloaded and self.read == "staged" and self.streams == 1 and self.pipeline != 1

    def chunks(self, groups: int, capacity: int) -> int:
        """Pipelined chunks of a step over ``groups`` groups (of one device) in a cache of ``capacity`` tokens.

        ``"auto"``: with staged reads from real host memory (a GPU), the largest divisor of ``groups`` up to 8 from
        512k tokens on and up to 2 below (each chunk adds its own top-k and glue, which at 128k cost more than the
        overlap gains; measured on the H200, ``results/pipeline_h200.md``); else 1 (elsewhere the chunks would run
        one after the other: the same results, more launches)."""
        if self.pipeline != "auto":
            return self.pipeline
        if not self.pipelines or self.memory_kind != "pinned_host":
            return 1
        most = 8 if capacity >= 1 << 19 else 2
        return max(d for d in range(1, min(most, groups) + 1) if groups % d == 0)

    @property
    def run_gather_programs(self) -> int:
        """Persistent programs of the run gather: ``"auto"`` is half the GPU's SMs (66 on the H200, the fastest of
        33 / 66 / 132 in the pipelined 1M step) on a GPU, else one program per work item (0)."""
        if self.gather_programs != "auto":
            return self.gather_programs
        if jax.default_backend() != "gpu" or not (self.offloaded and self.read == "staged"):
            return 0
        return _half_the_sms()

    @property
    def row_fetch_programs(self) -> int:
        """Persistent programs of the row fetch: ``"auto"`` is half the GPU's SMs from real host memory (rows in
        flight from a few groups' regions at a time, and SMs left to the kernels beside it), else one program
        per 32 rows (0)."""
        if self.fetch_programs != "auto":
            return self.fetch_programs
        if self.memory_kind != "pinned_host":
            return 0
        return _half_the_sms()

    @property
    def row_fetch_config(self) -> RowFetchConfig:
        return RowFetchConfig(programs=self.row_fetch_programs)

    def resolved(self, groups: int, capacity: int) -> "Placement":
        """This placement with ``pipeline``, ``gather_programs`` and ``fetch_programs`` as a step over ``groups``
        groups (of the whole mesh) in a cache of ``capacity`` tokens runs them."""
        return dataclasses.replace(self, pipeline=self.chunks(groups // self.num_shards, capacity),
                                   gather_programs=self.run_gather_programs, fetch_programs=self.row_fetch_programs)

    @property
    def compiler_options(self) -> dict[str, str]:
        """XLA options for the programs that run a step with this placement (``jax.jit(compiler_options=)``).

        A pipelined step needs the GPU to run a chunk's transfer beside the previous chunk's kernels. XLA
        launches a program's kernels as CUDA graphs whose default ("LHS") edges follow its sequential
        schedule; "CONCURRENT" keeps only the data dependencies (and assigns buffers so that concurrent
        kernels never share one). :attr:`xla_options` come on top."""
        options = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"} if self.pipelines else {}
        return options | dict(self.xla_options)

    # -- running per-group work on several GPU streams ---------------------------------------
    def per_stream(self, fn, groups: int, args: tuple, shared: tuple = ()):
        """``fn(group_start, size, *chunk_args, *shared)`` for each of :attr:`streams` equal chunks of ``groups``;
        returns the list of their outputs. Every chunk but the last runs as one computation on a GPU stream of its
        own, the last on XLA's main stream, so the scheduler can put the main stream's kernels between the
        others' start and done (two async computations are one resource to it and never overlap each other).

        ``args`` are pytrees whose leaves are per-group ``[R, ...]`` arrays, cut to the chunk, except bulk
        leaves (stacked ``[L, R, ...]`` cache arrays, possibly in host memory: no XLA op may slice them),
        which every chunk gets whole and reads at its ``group_start`` through the kernels; ``shared`` (e.g.
        a layer index) goes to every chunk as it is.
        """
        if groups % self.streams:
            raise ValueError(f"placement streams={self.streams} must divide the {groups} groups of a device")
        size = groups // self.streams
        outs = []
        for i in range(self.streams):
            start = i * size
            chunk = tuple(group_window(a, start, size) for a in args)
            run = functools.partial(fn, start, size)
            if i < self.streams - 1:
                run = _on_stream(run, i + 1)
            outs.append(run(*chunk, *shared))
        return outs

    # -- shardings ----------------------------------------------------------------------------
    def sharding(self, ndim: int, *, bulk: bool, split: bool = True) -> jax.sharding.Sharding:
        """The sharding of a cache leaf of rank ``ndim`` (group axis 1 split over the mesh if ``split``)."""
        kind = self.memory_kind if bulk else "device"
        if self.mesh is None:
            return SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
        spec = P(None, self.axis) if split and ndim >= 2 else P()
        return NamedSharding(self.mesh, spec, memory_kind=kind)

    def replicated(self) -> jax.sharding.Sharding:
        if self.mesh is None:
            return SingleDeviceSharding(jax.devices()[0])
        return NamedSharding(self.mesh, P())

    def replicate(self, tree):
        """``tree`` replicated over the mesh (weights, hook statistics); unchanged without a mesh."""
        return tree if self.mesh is None else jax.device_put(tree, self.replicated())

    def shardings(self, tree):
        """Per-leaf shardings of a cache pytree (bulk leaves in :attr:`memory_kind`, the rest on device)."""
        def one(path, x):
            split = x.ndim >= 2 and self.mesh is not None and x.shape[GROUP_AXIS] % self.num_shards == 0
            return self.sharding(x.ndim, bulk=is_bulk(path), split=split)

        return jax.tree_util.tree_map_with_path(one, tree)

    @staticmethod
    def detach_bulk(tree):
        """``tree`` with its bulk leaves replaced by None (what a program that wrote them in place returns)."""
        return jax.tree_util.tree_map_with_path(lambda path, x: None if is_bulk(path) else x, tree)

    @staticmethod
    def split_bulk(tree):
        """``(small, bulk)``: ``tree`` with its bulk leaves replaced by None, and with its other leaves replaced by
        None (a program can then donate the small leaves alone; :meth:`join_bulk` is the inverse)."""
        return Placement.detach_bulk(tree), jax.tree_util.tree_map_with_path(
            lambda path, x: x if is_bulk(path) else None, tree)

    @staticmethod
    def join_bulk(small, bulk):
        """The tree :meth:`split_bulk` split."""
        return jax.tree.map(lambda a, b: b if a is None else a, small, bulk, is_leaf=lambda x: x is None)

    @staticmethod
    def attach_bulk(small, full):
        """The inverse of :meth:`detach_bulk`: ``small``'s leaves, with the bulk leaves of ``full``."""
        rest = iter(jax.tree.leaves(small))
        return jax.tree_util.tree_map_with_path(lambda path, x: x if is_bulk(path) else next(rest), full)

    def put(self, tree):
        """``tree`` with every leaf placed (see :meth:`shardings`)."""
        return jax.device_put(tree, self.shardings(tree))

    def zeros(self, shape, dtype, *, bulk: bool = True):
        """A zero-filled cache array of ``shape`` placed where it belongs.

        A host array whose shard fits in 90% of the free HBM is made there and copied out: a
        ``device_put`` of host data into ``pinned_host`` passes through a second host buffer of the same
        size, so filling a cache that way needs its bytes plus its largest array in host memory (a 1M-token
        cache with every layer's own K/V, 171 GB, was killed on a 256 GiB host). A larger array (a cache
        bigger than HBM) still comes from (lazily allocated) zero pages on the host.
        """
        sharding = self.sharding(len(shape), bulk=bulk, split=len(shape) >= 2)
        if bulk and self.memory_kind == "pinned_host" and not _fits_in_hbm(shape, dtype, sharding):
            return jax.device_put(np.zeros(shape, dtype), sharding)
        return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)()

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
        lengths); ``out_axes`` likewise for the outputs (an int for all, or a pytree of outputs whose
        leaves' ranks decide, as for ``axes``). The Pallas kernels run per shard, on each device's own
        groups and its own slice of host memory. Without a mesh this is ``fn(*args)``.
        """
        if self.mesh is None:
            return fn(*args)
        in_specs = tuple(jax.tree.map(lambda x, ax=ax: self.group_spec(x, ax), a) for a, ax in zip(args, axes))
        if isinstance(out_axes, int):
            out_specs = P(*([None] * out_axes), self.axis)
        else:  # (a pytree shaped like the output, its group axis)
            like, axis_of = out_axes
            out_specs = jax.tree.map(lambda x: self.group_spec(x, axis_of), like)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

    # -- reading bulk arrays inside the step -------------------------------------------------
    def stage(self, x, layer, implementation: backend.Implementation, columns: tuple[int, int] | None = None,
              groups: tuple[int, int] | None = None):
        """``x[layer]`` (``[R, N, F]`` of a stacked ``[L, R, N, F]`` bulk array) in device memory; with
        ``columns=(start, width)`` only those features (the keys of the K/V cache); with ``groups=(start,
        size)`` only those groups (one stream's chunk).

        Device memory: an XLA slice (free inside a fusion). Offloaded: a row-fetch kernel copies the
        layer's rows (host memory is not an XLA operand).
        """
        window = (lambda a: a) if columns is None else (lambda a: a[..., columns[0]:columns[0] + columns[1]])
        if layer is None:
            return window(x)
        start, size = (0, x.shape[1]) if groups is None else groups
        if not self.offloaded or implementation == "xla":
            return window(x[layer, start:start + size])
        n = x.shape[-2]
        index = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (size, n))
        rows, _, _ = row_fetch(x, None, index, layer=layer, columns=columns, group_start=start,
                               implementation=implementation)
        return rows


def _on_stream(fn, stream: int):
    """``fn`` as one computation on GPU stream ``stream`` (``compute_on("gpu_stream:N")``; inlined elsewhere).

    JAX 0.11.2 also marks every op traced inside ``compute_on`` with the stream; XLA then wraps those ops (the
    kernel calls, a reshape) into async computations of their own inside the stream's computation and fails
    to compile ("No ExecutionStreamId found for call-start ..."). The body is traced with the compute type
    cleared, so only the outer call carries the annotation and everything in it runs on that stream.
    """
    def body(*args):
        previous = jax_config.compute_on_context_manager.swap_local(None)
        try:
            return fn(*args)
        finally:
            jax_config.compute_on_context_manager.set_local(previous)

    return compute_on(body, compute_type=f"gpu_stream:{stream}", out_memory_spaces=jax.memory.Space.Device)


def _half_the_sms() -> int:
    """Half the default GPU's streaming multiprocessors (66 on the H200): persistent programs that wait on the link
    leave the other half to the kernels running beside them."""
    return max(1, getattr(jax.devices()[0], "core_count", 132) // 2)


def _fits_in_hbm(shape, dtype, sharding, fraction: float = 0.9) -> bool:
    """Whether one shard of a ``shape`` array takes at most ``fraction`` of every device's free memory."""
    shard = np.prod(sharding.shard_shape(tuple(shape)), dtype=np.int64) * np.dtype(dtype).itemsize
    for device in sharding.device_set:
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return False
        if shard > fraction * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)):
            return False
    return True
