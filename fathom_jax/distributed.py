"""Past one host: one process per host, ``jax.distributed``, one global mesh over every process's devices.

    from fathom_jax import distributed
    distributed.initialize()                          # from the environment (below), or a no-op for one process
    distributed.initialize("10.0.0.1:1234", 2, 0)     # or given: coordinator, process count, this process's id
    distributed.initialize(..., join_timeout_s=60, waiting=print)   # say what it waits for; give up after 60 s
    mesh = distributed.global_mesh()                  # every device of every process, one axis

:func:`initialize` takes the coordinator address, process count and process id from its arguments, else from
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``; what is still missing JAX's cluster
detection fills in (SLURM: ``srun`` sets ``SLURM_NTASKS``, ``SLURM_PROCID``, ...; Open MPI; Kubernetes). With none of
the three set, a SLURM job step or Open MPI launch of more than one process still joins; otherwise it does nothing
and the program runs as one process. On CPUs the cross-process collectives are gloo's (TCP).

Joining waits for every process of the job, ``join_timeout_s`` at most (:data:`JOIN_TIMEOUT_S`), in a way Ctrl-C
ends: JAX's own connect blocks in C++ (no ``KeyboardInterrupt`` reaches it) and, when its deadline passes, aborts
the process with a C++ stack trace ("another task died"). So the connect runs on a thread of its own, under a JAX
deadline well past ours, while the calling thread waits: Ctrl-C raises ``KeyboardInterrupt`` there, and at our
deadline :class:`JoinError` names the coordinator. Either way the connect still waits on its thread: the process
cannot join again and should end (``os._exit``, as the ``fathom`` program does; :func:`join_pending` says so).

Every process runs the same program on the same inputs (a multi-controller program): it builds the same global
mesh, places only its own shards of the cache (:func:`put`, :func:`zeros`: arrays made shard by shard, never a
whole global array on one host) and issues its host transfers from the main thread in the same order as every
other process. A value pulled back to the host goes through :func:`to_host`.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # JAX's own
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
# A process that stops sending heartbeats is declared dead after this long and every other process fails with an
# error (JAX's default; 30 s declared a live process dead on a 2-core machine loaded 15-fold).
HEARTBEAT_TIMEOUT_S = 100
JOIN_TIMEOUT_S = 120  # how long a process waits for the others to join before it gives up (one line, no abort)
_JAX_EXTRA_S = 600  # JAX's own connect deadline lies this far past ours: it would abort the process (module doc)
_POLL_S = 0.1  # how often the waiting thread looks up (a Ctrl-C lands within this)


class JoinError(RuntimeError):
    """The job's processes did not all join within the timeout (the message names the coordinator)."""


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an int, got {value!r}") from None


# Batch launchers whose environment says how many processes a job has (what ``jax.distributed`` detects among
# them without querying anything over the network).
LAUNCHERS = ("slurm", "ompi")


def _cluster_detected() -> bool:
    """Whether a launcher's environment describes a job of more than one process (SLURM: ``srun`` with more than
    one task; Open MPI: ``mpirun -n 2`` or more)."""
    try:
        from jax._src import clusters

        types = list(clusters.ClusterEnv._cluster_types)
    except (ImportError, AttributeError):  # another JAX: no detection, give the job explicitly
        return False
    for env in types:
        if env.name in LAUNCHERS and env.is_env_present():
            try:
                return env.get_process_count() > 1
            except (KeyError, ValueError):
                return False
    return False


def is_initialized() -> bool:
    """Whether ``jax.distributed`` is initialized in this process (joined: not a connect still waiting)."""
    from jax._src import distributed as state

    return state.global_state.client is not None and not join_pending()


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None, *,
               heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S, join_timeout_s: float = JOIN_TIMEOUT_S,
               waiting: Callable[[str], None] | None = None) -> bool:
    """Join the job's processes (``jax.distributed.initialize``); returns whether this is a multi-process run.

    ``coordinator`` (``host:port`` of process 0), ``num_processes`` and ``process_id`` default to the environment
    (module docstring). With none of them set and no cluster detected: one process, nothing to do. Call it before
    anything else touches JAX's devices. Calling it again after a successful call does nothing. ``waiting`` is
    called with one line saying what the process waits for, before it waits; past ``join_timeout_s`` seconds
    without every process, :class:`JoinError`; Ctrl-C while waiting, ``KeyboardInterrupt`` (module docstring: after
    either, end the process).
    """
    if join_pending():  # (its client is set already: before is_initialized)
        raise JoinError("an earlier distributed.initialize of this process is still waiting for the job's other "
                        "processes (it timed out or was interrupted): end this process and start it again")
    if is_initialized():
        return jax.process_count() > 1
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    given = (coordinator, num_processes, process_id)
    if all(v is None for v in given) and not _cluster_detected():
        return False
    if num_processes is not None and (not isinstance(num_processes, int) or num_processes < 1):
        raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must lie in [0, num_processes) = [0, {num_processes}), got {process_id!r}")
    if coordinator is not None and ":" not in coordinator:
        raise ValueError(f"coordinator must be host:port (process 0's address), got {coordinator!r}")
    if not join_timeout_s > 0:
        raise ValueError(f"join_timeout_s must be > 0 seconds, got {join_timeout_s!r}")
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("distributed.initialize must run before anything uses JAX's devices (call it first)")
    # gloo: XLA:CPU's cross-process collectives over TCP (GPUs use NCCL; this setting touches only the CPU client)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if waiting is not None:
        where = coordinator or "the launcher's"
        waiting(f"{_who(process_id, num_processes)}: joining the job at coordinator {where}, waiting up to "
                f"{join_timeout_s:g} s for every process (Ctrl-C stops)")
    _connect(coordinator, num_processes, process_id, heartbeat_timeout_s, join_timeout_s)
    return jax.process_count() > 1


def _who(process_id, num_processes) -> str:
    return (f"process {process_id if process_id is not None else '?'} of "
            f"{num_processes if num_processes is not None else '?'}")


_connecting: threading.Thread | None = None  # the connect thread of this process, once started


def join_pending() -> bool:
    """Whether a :func:`initialize` of this process timed out or was interrupted while its connect still waits (the
    process should end with ``os._exit``: an interpreter exit would wait on that call)."""
    return _connecting is not None and _connecting.is_alive()


def _connect(coordinator, num_processes, process_id, heartbeat_timeout_s: int, join_timeout_s: float) -> None:
    """``jax.distributed.initialize`` on a thread of its own, waited for here (Ctrl-C lands here) up to
    ``join_timeout_s`` (module docstring)."""
    global _connecting
    failed: list[BaseException] = []

    def connect():
        try:
            jax.distributed.initialize(coordinator, num_processes, process_id,
                                       initialization_timeout=int(join_timeout_s) + _JAX_EXTRA_S,
                                       heartbeat_timeout_seconds=heartbeat_timeout_s)
        except BaseException as err:  # raised again on the waiting thread
            failed.append(err)

    _connecting = threading.Thread(target=connect, name="fathom-distributed-join", daemon=True)
    _connecting.start()
    deadline = time.monotonic() + join_timeout_s
    while _connecting.is_alive() and time.monotonic() < deadline:
        _connecting.join(_POLL_S)
    if failed:
        raise failed[0]
    if _connecting.is_alive():
        from jax._src import distributed as state

        s = state.global_state
        where = s.coordinator_address or coordinator
        role = " (this process runs the coordinator)" if s.process_id == 0 else ""
        raise JoinError(f"{_who(s.process_id, s.num_processes or num_processes)}: the job's other processes did not "
                        f"join at coordinator {where}{role} within {join_timeout_s:g} s; start every process of the "
                        "job with the same command (each its own process id), or give them longer to start")


def describe() -> str:
    """One line: this process, the processes and their devices."""
    return (f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local "
            f"{jax.default_backend()} device(s) of {jax.device_count()}")


# -- the global mesh -------------------------------------------------------------------------------

def mesh_devices(devices: int) -> list:
    """``devices`` devices for a one-axis mesh: the first ``devices`` of one process, or with several processes the
    first ``devices / processes`` of each, process by process (every process holds a share of the cache)."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices must be an int >= 1, got {devices!r}")
    have = jax.devices()
    if devices > len(have):
        raise ValueError(f"{devices} devices asked for, {len(have)} {jax.default_backend()} device(s) available"
                         + (f" over {jax.process_count()} processes" if jax.process_count() > 1 else ""))
    processes = jax.process_count()
    if processes == 1:
        return have[:devices]
    if devices % processes:
        raise ValueError(f"{devices} devices do not split evenly over the {processes} processes: every process "
                         f"holds a share of the mesh, so use a multiple of {processes}")
    per = devices // processes
    by_process: dict[int, list] = {}
    for d in have:
        by_process.setdefault(d.process_index, []).append(d)
    if any(len(ds) < per for ds in by_process.values()):
        raise ValueError(f"{devices} devices need {per} on each of the {processes} processes; the fewest any has "
                         f"is {min(len(ds) for ds in by_process.values())}")
    return [d for p in sorted(by_process) for d in sorted(by_process[p], key=lambda d: d.id)[:per]]


def global_mesh(devices: int | None = None, axis: str = "x") -> Mesh | None:
    """A one-axis mesh of ``devices`` devices (default: all of every process) spread evenly over the processes; None
    for one device."""
    devices = jax.device_count() if devices is None else devices
    chosen = mesh_devices(devices)
    return None if devices == 1 else Mesh(np.array(chosen), (axis,))


# -- placing and fetching: each process its own shards ----------------------------------------------

def _spans_processes(sharding) -> bool:
    return not sharding.is_fully_addressable


def _put_one(x, sharding):
    if not _spans_processes(sharding):
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)  # already global: a reshard over the same devices
    # Every process holds the same value; each copies only the shards of its own devices (a process-local
    # transfer: no cross-process check, no global copy on any host).
    x = x if isinstance(x, jax.Array) else np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index], dtype=x.dtype)


def put(tree, shardings):
    """``jax.device_put(tree, shardings)`` where every sharding lies in this process; otherwise each leaf (the same
    value on every process: a host array or a process-local one) is placed shard by shard, each process copying only
    its own shards. Leaves go in tree order, the same on every process."""
    leaves, treedef = jax.tree.flatten(tree)
    shard_leaves = treedef.flatten_up_to(shardings)
    if not any(_spans_processes(s) for s in shard_leaves):
        return jax.device_put(tree, shardings)
    return jax.tree.unflatten(treedef, [_put_one(x, s) for x, s in zip(leaves, shard_leaves)])


def zeros(shape, dtype, sharding):
    """A zero-filled host-built array of ``shape`` on ``sharding``, each process filling only its own shards."""
    if not _spans_processes(sharding):
        return jax.device_put(np.zeros(shape, dtype), sharding)
    shard = sharding.shard_shape(tuple(shape))
    return jax.make_array_from_callback(tuple(shape), sharding, lambda _: np.zeros(shard, dtype), dtype=dtype)


def check_same(x, what: str) -> None:
    """Raise ValueError unless every process passes the same host array ``x`` (e.g. the prompt's token ids): each
    process places only its own shards of what it is given, so different inputs would decode wrong tokens silently.
    One small all-gather (a digest of ``x``); nothing with one process."""
    if jax.process_count() == 1:
        return
    digests = np.asarray(multihost_utils.process_allgather(_digest(x)))
    differ = [p for p in range(digests.shape[0]) if not np.array_equal(digests[p], digests[0])]
    if differ:
        raise ValueError(f"{what} must be the same on every process of a multi-process run; process(es) {differ} "
                         "differ from process 0")


def _digest(x) -> np.ndarray:
    """SHA-256 of an array's shape, dtype and bytes, as 32 uint8."""
    x = np.ascontiguousarray(x)
    return np.frombuffer(hashlib.sha256(repr((x.shape, x.dtype.str)).encode() + x.tobytes()).digest(), np.uint8)


def to_host(x) -> np.ndarray:
    """The whole value of ``x`` as a numpy array on every process (an all-gather where it spans processes and is not
    replicated: every process must call this for the same arrays in the same order)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def local_bytes(tree) -> int:
    """Bytes of ``tree``'s arrays held by this process (its shards; a replicated array counts once per local
    device holding it)."""
    return sum(shard.data.nbytes for x in jax.tree.leaves(tree) for shard in x.addressable_shards)


def local_share(mesh: Mesh | None) -> float:
    """The fraction of ``mesh``'s devices that belong to this process (1 without a mesh): its share of a cache split
    over them."""
    if mesh is None:
        return 1.0
    devices = list(mesh.devices.flat)
    return sum(d.process_index == jax.process_index() for d in devices) / len(devices)


def holding(nbytes: dict[str, int], mesh: Mesh | None) -> str:
    """One line: what this process holds of arrays split evenly over ``mesh`` whose bytes over all devices are
    ``nbytes`` by kind (e.g. :func:`fathom_jax.decode.cache_bytes`)."""
    share = local_share(mesh)
    kinds = ", ".join(f"{kind} {_size(n * share)}" for kind, n in nbytes.items())
    total = sum(nbytes.values())
    return f"{describe()}; holds {_size(total * share)} of the cache's {_size(total)} ({kinds})"


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
