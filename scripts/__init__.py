"""The benchmarks and studies of fathom-jax, each a module run from the repository root, e.g.
``python3 -m scripts.bench_offload --preset attn --out $OUT``; their shared helpers are modules beside them
(``harness``, ``offload_*``, ``kernel_*``). Not installed with the library."""
