"""Value checks that hold eagerly and under ``jit``: one rule for the store, the planner and selection.

Shapes are static, so shape checks always run at trace time. Values are checked by :func:`fail_if`:
eagerly (a plain ``ValueError`` at the call) when they are concrete, and under tracing by a host
callback inside a ``lax.cond`` that runs only when the check fails, so a correct program pays one
predicate and never calls the host. Under ``vmap`` a ``cond`` runs both branches, so the callback
re-checks its own slice of the predicate and raises only for a failing one.

Under ``jit`` JAX surfaces a callback's exception as ``jax.errors.JaxRuntimeError`` whose message
ends with the original ``ValueError: <message>``; JAX also logs the same traceback once more before
raising. That second copy is dropped for our own errors (a filter on JAX's callback loggers), so
the error reads once, as the ValueError it is.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

_MARK = "_fathom_runtime_check"


def is_traced(*values) -> bool:
    """Whether any of ``values`` is a tracer (its value unknown until run time), the one test of it in the library."""
    return any(isinstance(v, jax.core.Tracer) for v in values)


def _fire(error: Callable[..., str], bad, *operands) -> None:
    if not np.any(np.asarray(bad)):
        return  # vmap ran the callback for an element that passed
    exc = ValueError(error(*(np.asarray(o) for o in operands)))
    setattr(exc, _MARK, True)
    raise exc


def fail_if(bad, error: Callable[..., str], *operands) -> None:
    """Raise ``ValueError(error(*operands))`` where ``bad`` (any element) is true.

    ``error`` formats the message from the operands as numpy arrays (it runs on the host, only on
    failure). Concrete ``bad``: raises now. Traced: raises at run time, at no cost when ``bad`` is false.
    """
    if not is_traced(bad, *operands):
        _fire(error, bad, *operands)
        return
    flag = jnp.any(bad)
    jax.lax.cond(flag, lambda: jax.debug.callback(functools.partial(_fire, error), flag, *operands),
                 lambda: None)


class _DropOwnRuntimeErrors(logging.Filter):
    """Drop JAX's logged copy of an exception raised by :func:`fail_if` (the exception itself still surfaces)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not getattr(exc, _MARK, False)


for _name in ("jax._src.debugging", "jax._src.callback"):
    logging.getLogger(_name).addFilter(_DropOwnRuntimeErrors())
