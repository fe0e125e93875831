"""A compiled program over a placed sparse cache: how every program that takes and returns the cache is made.

A program over a cache takes it as two arguments, its small leaves and its bulk leaves (:func:`~fathom_jax.placement.
split_bulk`). The small leaves are donated (XLA updates them in place: lengths, tails, a row cache of gigabytes). In
device memory the bulk leaves are donated too and the whole cache is returned. In host memory the kernels write the
bulk arrays in place and the program returns the cache without them: returning a host array from a program makes
XLA copy it, and donating one it does not return would free it.

The decoder's prefill-layer and decode-step programs are made this way (:meth:`SparseAttention.program`), and so are
:mod:`fathom_jax.decode.programs`'.
"""

from __future__ import annotations

import functools

import jax

from fathom_jax.decode.cache import SparseCache
from fathom_jax.placement import attach_bulk, join_bulk, split_bulk


def cache_program(attn, fn, cache: SparseCache, *, static: tuple = (), options: dict | None = None):
    """``run(*args, cache=cache) -> (outs, cache)`` running ``fn(*static, attn, *args, cache)`` as one program
    (``attn``: the bound :class:`~fathom_jax.decode.SparseAttention`): the cache donated (see the module docstring),
    ``outs`` replicated over the mesh, compiled with the step's XLA options and ``options`` on top. Programs are made once per (fn, static, hook, cache layout, options)."""
    placement = attn.placement
    bulk = cache.bulk()
    in_place = placement.in_host_memory
    leaves, treedef = jax.tree.flatten(placement.shardings(cache, bulk))
    merged = dict(attn.context.run.compiler_options) | dict(options or {})
    attn_leaves, attn_static = jax.tree.flatten(attn)
    jitted = _compiled(fn, static, attn_static, (treedef, tuple(leaves)), in_place, tuple(sorted(merged.items())),
                       placement.replicated())

    def run(*args, cache: SparseCache):
        small, bulk_leaves = split_bulk(cache, bulk)
        # Committed where the program runs (replicated over a mesh): an uncommitted argument (a fresh token array)
        # is another jit signature than the committed one the previous step returned, and would compile again.
        args, hook_leaves = jax.device_put((args, attn_leaves), placement.replicated())
        outs, small = jitted(hook_leaves, args, small, bulk_leaves)
        return outs, (attach_bulk(small, cache, bulk) if in_place else small)

    run.lower = lambda *args, cache: jitted.lower(attn_leaves, args, *split_bulk(cache, bulk))  # nothing runs
    run.trace = lambda *args, cache: jitted.trace(attn_leaves, args, *split_bulk(cache, bulk))  # its jaxpr
    run.jit = jitted  # the program itself (its arguments: the hook's leaves, the args, small and bulk leaves)
    return run


@functools.lru_cache(maxsize=None)
def _compiled(fn, static, attn_static, cache_shardings, in_place, options, out_sharding):
    def detach(cache):
        return split_bulk(cache, cache.bulk())[0] if in_place else cache

    def body(attn_leaves, args, small, bulk):
        attention = jax.tree.unflatten(attn_static, attn_leaves)
        outs, cache = fn(*static, attention, *args, join_bulk(small, bulk))
        return outs, detach(cache)

    shardings = jax.tree.unflatten(*cache_shardings)
    out_shardings = detach(shardings) if in_place else shardings
    donate = (2,) if in_place else (2, 3)  # the small leaves, and the bulk ones unless written in place
    return jax.jit(body, donate_argnums=donate, out_shardings=(out_sharding, out_shardings),
                   compiler_options=dict(options) or None)
