"""Where a cache lives, and what decides it.

``placement``    :class:`Placement`: memory kind (HBM or ``pinned_host``), mesh, resident planes; bulk vs small leaves
``host_memory``  what pinned host memory holds, and the check before a cache is allocated
``residency``    resident planes per layer for an HBM budget; plane and link bytes
``plane_reads``  how often the planner reads each plane (a calibration capture's read frequencies)
"""

from fathom_jax.placement.placement import (GROUP_AXIS, Memory, Placement, attach_bulk, device_mesh,
                                            host_memory_available, join_bulk, split_bulk)

__all__ = ["GROUP_AXIS", "Memory", "Placement", "attach_bulk", "device_mesh", "host_memory_available", "join_bulk",
           "split_bulk"]
