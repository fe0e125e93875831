"""How much pinned host memory a cache really takes in XLA's GPU host allocator, checked before allocating.

XLA allocates ``pinned_host`` arrays from one BFC allocator per GPU (``xla_gpu_host_bfc``), capped by
``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` (GiB, default 64). It grows by *regions*: when no free chunk holds a
request it pins a new region of the next power-of-two size (doubling a running size that starts at 2 MiB),
trimmed to what the cap leaves, and it never returns a region. A cache is therefore bigger in pinned memory
than its bytes: at 1M tokens with Qwen3-8B shapes on one GPU, K (72 GiB) takes a 128 GiB region whose free
part then holds the planes, and V needs a second region of its own. Allocated in the other order, a cache of
every layer's own K/V at 1M tokens reserved far more than its bytes and was killed by the kernel's OOM killer on
the two-H200 host (NOTES.md, "The offloaded decode step"); with K/V first it fits.

:func:`regions` replays the allocator's growth rule for a sequence of allocations; :func:`check` turns it
into a clear error before anything is allocated (the cap too low for the cache, or the regions more than
the machine's memory).
"""

from __future__ import annotations

import dataclasses
import math
import os

GiB = 1 << 30
_FIRST_REGION = 2 << 20  # BFCAllocator's initial region size with allow_growth
_MIN_ALLOCATION = 256  # kMinAllocationSize: sizes round up to it
DEFAULT_LIMIT_GIB = 64
LIMIT_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


@dataclasses.dataclass(frozen=True)
class Regions:
    """The regions one allocator pinned for a sequence of allocations (bytes), or where it failed."""

    sizes: tuple[int, ...]
    failed_at: int | None = None  # the index of the first allocation that found no room

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def fits(self) -> bool:
        return self.failed_at is None


def _rounded(n: int) -> int:
    return -(-n // _MIN_ALLOCATION) * _MIN_ALLOCATION


def regions(allocations: list[int], limit: int, *, existing: tuple[int, ...] = ()) -> Regions:
    """Replay ``BFCAllocator::Extend`` for ``allocations`` (bytes, in order, none freed) under ``limit`` bytes.

    ``existing`` are regions pinned before (full: e.g. the 2 GiB buffers of a link measurement, freed but
    never returned). A request goes to the first region with room (chunks are never freed here, so a
    region's free space is one piece at its end); otherwise a new region of the doubled running size, at
    most what the limit leaves, and the request fails if even that is too small.
    """
    sizes, free = list(existing), [0] * len(existing)
    curr = _FIRST_REGION
    for size in existing:
        while size > curr:
            curr *= 2
    for i, n in enumerate(allocations):
        n = _rounded(n)
        room = [j for j, f in enumerate(free) if f >= n]
        if room:
            free[min(room, key=lambda j: free[j])] -= n  # best fit
            continue
        available = (limit - sum(sizes)) // _MIN_ALLOCATION * _MIN_ALLOCATION
        if n > available:
            return Regions(tuple(sizes), failed_at=i)
        increased = False
        while n > curr:
            curr, increased = curr * 2, True
        region = min(curr, available)
        if not increased:
            curr *= 2
        sizes.append(region)
        free.append(region - n)
    return Regions(tuple(sizes))


def smallest_limit_gib(allocations: list[int], *, existing: tuple[int, ...] = ()) -> int:
    """The smallest whole-GiB cap under which ``allocations`` all find room."""
    need = math.ceil((sum(allocations) + sum(existing)) / GiB)
    for limit in range(need, 4 * need + 2):
        if regions(allocations, limit * GiB, existing=existing).fits:
            return limit
    raise AssertionError("unreachable: a cap of 4x the bytes always holds them")  # pragma: no cover


def limit_gib() -> int:
    """The cap XLA read from the environment at start-up (GiB per GPU)."""
    value = os.environ.get(LIMIT_VARIABLE, "").strip()
    try:
        return int(value) if value else DEFAULT_LIMIT_GIB
    except ValueError:
        return DEFAULT_LIMIT_GIB


def physical_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# Regions a process may already hold (the link measurement's 2 GiB buffers, small host arrays): room the
# suggested cap leaves on top of the cache's own regions.
HEADROOM_GIB = 6


def check(allocations: list[int], *, devices: int, what: str = "the cache") -> None:
    """Raise before allocating if ``allocations`` (per-GPU shard bytes, in allocation order) will not fit.

    Two failures are caught: the cap (:data:`LIMIT_VARIABLE`) leaves no region for some array, and the regions
    of every GPU together exceed the machine's memory (the kernel would kill the process while they fill).
    """
    limit = limit_gib()
    got = regions(allocations, limit * GiB)
    phys = physical_bytes()
    pinned = got.total * devices
    if got.fits and (phys is None or pinned <= 0.9 * phys):
        return
    # Only a failing cache pays for the search of the cap to suggest.
    need = smallest_limit_gib(allocations)
    suggest = need + HEADROOM_GIB
    shards = f"{len(allocations)} arrays, {sum(allocations) / GiB:.1f} GiB per GPU"
    if not got.fits:
        raise ValueError(
            f"{what} ({shards}) does not fit in XLA's pinned host allocator under {LIMIT_VARIABLE}={limit}: it "
            f"pins regions of doubling size, so these arrays need a cap of at least {need} GiB per GPU. Set "
            f"{LIMIT_VARIABLE}={suggest} (with room for other host buffers) before JAX starts."
        )
    raise ValueError(
        f"{what} ({shards}) would pin {pinned / GiB:.0f} GiB of host memory over {devices} GPU(s) in XLA's "
        f"allocator under {LIMIT_VARIABLE}={limit} (regions grow to the cap), more than this machine's "
        f"{phys / GiB:.0f} GiB: lower the cap to {suggest} GiB per GPU"
        + ("" if need * devices * GiB <= 0.9 * phys else ", or use fewer tokens (even that is too much)")
    )
