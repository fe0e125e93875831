"""Serving many sessions at once: a pool of decode slots over one model and one sparse attention.

``pool``           :class:`SessionPool` (add, step, pause, resume, remove, save, load) and :class:`PoolConfig`
``slots``          one session's slices of the pool's stacked cache, moved in and out; bytes per slot
``admission``      the memory ledger: a session refused before anything is allocated (:class:`AdmissionError`)
``session_store``  a parked session on disk (one checksummed file), checked whole before it loads; saves replace
                   atomically
"""

from fathom_jax.serve.admission import AdmissionError
from fathom_jax.serve.pool import PoolConfig, Session, SessionPool
from fathom_jax.serve.session_store import SessionFileError

__all__ = ["AdmissionError", "PoolConfig", "Session", "SessionFileError", "SessionPool"]
