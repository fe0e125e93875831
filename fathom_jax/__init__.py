"""fathom-jax: per-query read-depth bit-plane key scans for top-k sparse decoding, in JAX and Pallas.

The decode step's data flow, module by module:

``format``     the index format in one place (block size, planes, scale bits, bits per token)
``store``      the bit-plane key store (4-bit codes, fp16 block scales, exact prefix reads, appends); its
               quantizer and planes are ``planes``, its pytrees ``store_layout``, its reads ``store_read``
``checks``     the value checks' one rule: eagerly, under ``jit`` (a host callback), or in checkify mode
``calibrate``  channel statistics, KLT, Double Sparsity order, Loki basis (corpus or session)
``planner``    per-query read depths by reverse water-filling (Eq. 3 and 4)
``methods``    Fathom and every baseline as types, with a registry (``methods.parse("fathom:48")``)
``index_parts``  the typed parts of a key index (plane stores, landmarks, Quest's page bounds, keys)
``index``      the key index a set of methods reads, built at once or appended to
``scan``       approximate scores from a method's read (jnp reference or Pallas kernels)
``select``     4 sink + 32 local + top-(k - 36) per head, the group's union, exact attention
``placement``  where the cache lives (HBM or ``pinned_host``, one device or a mesh)
``distributed``  one process per host (``jax.distributed``): the job, the global mesh, each process's shards
``decode``     sparse decoding: the step (plan -> read -> scan -> select -> union -> fetch -> attend), its
               configuration and strategies, the stacked cache, the decoder's attention hook
``models``     Llama / Qwen decoders, loaders, the greedy step and its drivers (imports no sparse code)
``eval``       the attention-error study and the downstream evaluations
Kernels live in the sibling package ``pallas_kernels``.
"""

import importlib

__version__ = "0.2.0"

_MODULES = ("calibrate", "checks", "decode", "distributed", "format", "index", "index_parts", "landmarks", "methods",
            "page_bounds", "placement", "planes", "planner", "scan", "select", "store", "store_layout", "store_read",
            "models", "eval")


def __getattr__(name):  # lazy submodules: `pallas_kernels` imports `fathom_jax.format` without a cycle
    if name in _MODULES:
        return importlib.import_module(f"fathom_jax.{name}")
    raise AttributeError(f"module 'fathom_jax' has no attribute {name!r}")


__all__ = [*_MODULES, "__version__"]
