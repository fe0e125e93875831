"""Pallas GPU kernels of fathom-jax, one file per kernel, each beside a plain-jnp ``*_reference``.

Kernels: ``plane_scan`` (Fathom's bit-plane scan), ``nibble_scan`` (fixed-channel 4-bit scan of the baselines),
``run_gather`` and ``tier_gather`` (plane runs from ``pinned_host`` to HBM, from one store or the cold tier of two),
``row_fetch`` (winner K/V rows), ``topk`` (sink + local + top-k selection), ``water_line`` (Fathom's bisection
planner in one launch), ``cache_write`` and ``tier_write`` (new entries into a stacked cache, in place),
``slot_copy`` (one sequence's groups of a stacked array read out or written in, in place).
Every kernel takes ``implementation="triton" | "xla"`` and ``interpret=None`` (interpret mode when no GPU
is present).

What they share, and no kernel imports another: ``backend`` (the implementation switch, operand checks and
helpers), ``plane_layout`` (the format constants the kernels are built for, run-list checks, the tiered store's
rows), ``operands`` (what the plane kernels take for a layer's planes and a run list: ``StorePlanes``,
``LayerTiers``, ``RunList``), ``gather`` (the two gathers' work items and ``pallas_call``), ``topk_radix`` (the top-k's radix path and the
keys and windows of both its paths).

The package stands alone: it imports nothing from the library, which imports it.
"""
