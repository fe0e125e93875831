"""fathom-jax: per-query read-depth bit-plane key scans for top-k sparse decoding, in JAX and Pallas.

Modules: ``store`` (bit-plane key store), ``planner`` (reverse water-filling), ``calibrate``
(channel statistics, KLT), ``scorers`` (Fathom and every baseline behind one interface), ``select``
(sink/local/top-k selection, sparse attention), ``fidelity`` and ``study`` (the error-vs-bits
protocol), ``decode`` (sparse decoding in the Flax decoder), ``models`` (Llama / Qwen decoders and
loaders, imported on demand). Kernels live in the sibling package ``pallas_kernels``.
"""

from fathom_jax import calibrate, fidelity, planner, scorers, select, store

__version__ = "0.1.0"

__all__ = ["calibrate", "fidelity", "planner", "scorers", "select", "store", "__version__"]
