"""Value checks that hold eagerly, under ``jit`` and under ``vmap``, with one message: one rule for the store,
the planner, calibration and selection.

Shapes and dtypes are static, so their checks run at trace time and raise at the call, jitted or not. Values
go through :func:`fail_if`, which raises :class:`CheckError` (a ``ValueError``) with the same message however
the function runs:

* **Concrete values** (an eager call): at the call.
* **Traced values, default.** A host callback inside a ``lax.cond`` that runs only when the check fails, so a
  correct program pays one predicate and never calls the host (under ``vmap`` the ``cond`` runs both branches:
  the callback re-checks its own slice and raises only for a failing one). JAX reports a callback's exception
  as ``jax.errors.JaxRuntimeError`` (``INTERNAL: CpuCallback error ...``, the message on its last line);
  :func:`reraise` turns that back into the :class:`CheckError` it was, and the library's entry points that run
  compiled programs themselves (``models.generate``, the eval sweeps) call it. JAX's logged copy of the
  callback's traceback is dropped for our own errors.
* **Traced values on the decode hot path** (``fail_if(..., hot=True)``: depths, importances, lengths and
  indices a decode step computes every step) are not checked by default, because even a callback that never
  fires needs the predicate on the host on a GPU, a sync per step. Their documented defaults apply instead
  (NaN reads, clamped lengths); each function's docstring says which.
* **checkify mode** (:func:`checked`, or :func:`checking` around ``jax.experimental.checkify``): every check,
  hot ones included, is a functional ``checkify.check``: no host callback, and :func:`throw` raises the
  :class:`CheckError` with the eager message.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from pallas_kernels.backend import is_traced  # noqa: F401 (one test of a traced value, the kernels' and the library's)

_MARK = "_fathom_runtime_check"
# Which traced checks run: "callback" (the default) or "checkify". A jit-cache-sensitive context: a program
# traced in one mode is traced again in the other.
_MODE = jax.make_user_context("callback")
# Messages of the callback checks that fired lately, for reraise (the callback may run on another thread).
_FIRED: collections.deque[str] = collections.deque(maxlen=32)


class CheckError(ValueError):
    """A value outside what a function accepts, found by one of the library's checks (the message names the
    argument and what it must be)."""


def _fire(error: Callable[..., str], bad, *operands) -> None:
    if not np.any(np.asarray(bad)):
        return  # vmap ran the callback for an element that passed
    message = error(*(np.asarray(o) for o in operands))
    _FIRED.append(message)
    # A plain ValueError: JAX prints its type on the runtime error's last line; reraise makes it a CheckError.
    exc = ValueError(message)
    setattr(exc, _MARK, True)
    raise exc


class _Message(str):
    """A ``checkify.check`` message formatted by the check's own message function (so checkify reports the
    eager message); the string itself is a unique label, so two checks' messages never compare equal."""

    _count = 0

    def __new__(cls, error: Callable[..., str]):
        cls._count += 1
        self = super().__new__(cls, f"fathom_jax check #{cls._count}")
        self.error = error
        return self

    def format(self, *args, **kwargs) -> str:
        return self.error(*(np.asarray(a) for a in args))


def fail_if(bad, error: Callable[..., str], *operands, hot: bool = False) -> None:
    """Raise ``CheckError(error(*operands))`` where ``bad`` (any element) is true.

    ``error`` formats the message from the operands as numpy arrays (on the host, only on failure). Concrete
    ``bad``: raises now. Traced: see the module docstring; ``hot`` marks a check on the decode hot path, which
    runs only in checkify mode.
    """
    if not is_traced(bad, *operands):
        if np.any(np.asarray(bad)):
            raise CheckError(error(*(np.asarray(o) for o in operands)))
        return
    if _MODE.value == "checkify":
        checkify.check(~jnp.any(bad), _Message(error), *(jnp.asarray(o) for o in operands), debug=True)
        return
    if hot:
        return
    flag = jnp.any(bad)
    jax.lax.cond(flag, lambda: jax.debug.callback(functools.partial(_fire, error), flag, *operands),
                 lambda: None)


def checking():
    """A context in which traced checks are ``checkify`` checks (hot ones included) instead of host callbacks.

    Use it around the first call (the trace) of a ``checkify.checkify``-ed function, then :func:`throw` its
    error; :func:`checked` does both."""
    return _MODE("checkify")


def throw(err: checkify.Error) -> None:
    """Raise the first failed check of a checkify ``Error`` as :class:`CheckError` (the eager message)."""
    exc = err.get_exception()
    if exc is None:
        return
    mapping = getattr(exc, "error_mapping", None)  # vmap inside checkify: one error per failing index
    first = next(iter(mapping.values())) if mapping else exc
    message = getattr(first, "fmt_string", None)
    if isinstance(message, _Message):
        raise CheckError(message.format(*first.args, **first.kwargs)) from None
    err.throw()


def checked(fn: Callable) -> Callable:
    """``fn`` with every check on, hot ones included, raising :class:`CheckError`: ``fn`` runs under
    ``jax.experimental.checkify`` in :func:`checking` mode. Pass a jitted function to run it compiled
    (``checked(jax.jit(f))``); the checks cost what their predicates cost, and no host callback."""
    checkified = checkify.checkify(fn, errors=checkify.user_checks)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with checking():
            err, out = checkified(*args, **kwargs)
        throw(err)
        return out

    return run


@contextlib.contextmanager
def reraise():
    """Turn a ``JaxRuntimeError`` raised by a failed callback check into the :class:`CheckError` it was.

    For a program run in the ``with`` block (block on its results inside it: errors surface when they are
    ready), or as a decorator. Other runtime errors pass through unchanged."""
    try:
        yield
    except jax.errors.JaxRuntimeError as err:
        text = str(err)
        for message in reversed(_FIRED):
            if message in text:
                raise CheckError(message) from None
        raise


class _DropOwnRuntimeErrors(logging.Filter):
    """Drop JAX's logged copy of an exception raised by :func:`fail_if` (the exception itself still surfaces)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not getattr(exc, _MARK, False)


for _name in ("jax._src.debugging", "jax._src.callback"):
    logging.getLogger(_name).addFilter(_DropOwnRuntimeErrors())
