"""fathom-jax: per-query read-depth bit-plane key scans for top-k sparse decoding, in JAX and Pallas.

The decode step's data flow, module by module:

``format``     the index format in one place (block size, planes, scale bits, bits per token)
``checks``     the value checks' one rule: eagerly, under ``jit`` (a host callback), or in checkify mode
``store``      the bit-plane key store: its quantizer and planes, pytrees, builds and exact appends, prefix reads
``calibrate``  channel statistics, KLT, Double Sparsity order, Loki basis (corpus or session)
``planner``    per-query read depths by reverse water-filling (Eq. 3 and 4); ``allocation`` within bits as read
``index``      the key index a set of methods reads (its typed parts: plane stores, landmarks, page bounds, keys)
``methods``    Fathom and every baseline as types, with a registry (``methods.parse("fathom:48")``)
``scan``       approximate scores from a method's read (jnp reference or Pallas kernels)
``select``     4 sink + 32 local + top-(k - 36) per head, the group's union, exact attention
``rows``       K/V row formats (bf16, k8v8, ...) and how a decode cache stores a row
``placement``  where the cache lives (HBM or ``pinned_host``, one device or a mesh, resident planes) and what decides it
``distributed``  one process per host (``jax.distributed``): the job, the global mesh, each process's shards
``decode``     sparse decoding: the step (plan -> read -> scan -> select -> union -> fetch -> attend), its
               configuration and strategies, the stacked cache, the decoder's attention hook
``models``     Llama / Qwen / Gemma 3 decoders, loaders, the greedy step and its drivers (imports no sparse code)
``eval``       the attention-error study and the downstream evaluations
``cli``        the ``fathom`` command
Kernels live in the sibling package ``pallas_kernels``.

The package lazily exports a few names of its floor-0 and floor-1 rooms that a program measuring the library reaches
for (:data:`_EXPORTS`): the planner's importance and plan, the index format's block and word sizes, a warm plane
set's choice, the compiled-program readers of ``hlo`` and the multi-host start and read-back of ``distributed``. Importing the
package still loads none of its rooms; the decode hook's own companions (its calibration, placement, row format) are
``fathom_jax.decode``'s.
"""

import importlib

__version__ = "0.2.0"

_MODULES = ("allocation", "calibrate", "checks", "cli", "decode", "distributed", "format", "index", "methods", "placement",
            "planner", "rows", "scan", "select", "store", "models", "eval")


# name -> the module defining it
_EXPORTS = {
    "importance": "planner", "plan_bisection": "planner", "plan_exact": "planner",
    "BLOCK_TOKENS": "format", "WORD_BITS": "format",
    "warm_choice": "store.tiered",
    "hlo_instructions": "hlo", "kernel_launches": "hlo", "hlo_collectives": "hlo",
    "initialize": "distributed", "to_host": "distributed",
}


def __getattr__(name):  # lazy submodules and names: importing the package loads none of them
    if name in _MODULES:
        return importlib.import_module(f"fathom_jax.{name}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"fathom_jax.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'fathom_jax' has no attribute {name!r}")


__all__ = [*_MODULES, *_EXPORTS, "__version__"]
