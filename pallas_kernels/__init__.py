"""Pallas GPU kernels of fathom-jax, one file per kernel, each beside a plain-jnp ``*_reference``.

``plane_scan`` (Fathom's bit-plane scan), ``nibble_scan`` (fixed-channel 4-bit scan of the baselines),
``run_gather`` (contiguous plane runs from ``pinned_host`` to HBM), ``row_fetch`` (winner K/V rows),
``topk`` (sink + local + top-k selection; its radix path in ``topk_radix``), ``water_line`` (Fathom's bisection
planner in one launch).
Every kernel takes ``implementation="pallas" | "xla"`` and ``interpret=None`` (interpret mode when no GPU
is present).
"""
