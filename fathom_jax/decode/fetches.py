"""How a decode step fetches the K/V rows it selected: one strategy object per way, chosen once.

* :class:`RowFetch`: every selected row is fetched from the K/V cache (in device or host memory) by the row-fetch
  kernel (one run per token: each token's key and value sit side by side, as the cache's
  :class:`~fathom_jax.rows.layout.RowLayout` stores them).
* :class:`CachedRowFetch`: rows that the device-memory row cache's slots hold (:mod:`fathom_jax.decode.row_cache`)
  are taken from there, only the misses are fetched; the step returns what to store in the slots. The rows
  attended are the same bits either way.

Both return the rows as stored (the step dequantizes them where it attends) and patch in the newest token's row,
which the stored cache does not hold until the step writes it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fathom_jax.decode.row_cache import RowFill, row_lookup
from pallas_kernels import backend
from pallas_kernels.row_fetch import RowFetchConfig, StoredRows, row_fetch


@dataclasses.dataclass(frozen=True)
class RowFetch:
    """Fetch every selected row (``programs`` persistent programs of the row fetch; 0: one program per 32 rows)."""

    implementation: backend.Implementation = "xla"
    programs: int = 0

    def fetch(self, slots, view, *, group_start: int = 0, after=None):
        """``(rows [Rc, S, W], fill)`` of the union ``slots [Rc, S]`` (-1: padding, a zero row) of groups
        ``group_start ..``; ``fill`` is the :class:`~fathom_jax.decode.row_cache.RowFill` to store (None without a
        row cache). The fetch waits for ``after`` (arrays it never reads)."""
        return _with_new_row(self._rows(slots, view, group_start, after), slots, view.new, view.rows), None

    def _rows(self, wanted, view, group_start, after):
        rows, _, _ = row_fetch(StoredRows(view.kv, layer=view.kv_layer, group_start=group_start), wanted, after=after,
                               implementation=self.implementation, config=RowFetchConfig(programs=self.programs))
        return rows


@dataclasses.dataclass(frozen=True)
class CachedRowFetch(RowFetch):
    """Take the rows the row cache holds from its device-memory slots, fetch only the misses."""

    def fetch(self, slots, view, *, group_start: int = 0, after=None):
        hit, cached = row_lookup(view.row_cache, slots, layer=view.layer, group_start=group_start)
        rows = self._rows(jnp.where(hit, -1, slots), view, group_start, after)  # the kernel skips negative entries
        rows = _with_new_row(jnp.where(hit[..., None], cached, rows), slots, view.new, view.rows)
        return rows, RowFill(tokens=slots, hit=hit, rows=rows)


def _with_new_row(rows, slots, new, layout):
    """The newest token's row patched in (the stored cache lacks it until the step writes it; a row cache then
    stores it as it will be stored)."""
    if new is None:
        return rows
    at_new = (slots == new.position[:, None])[..., None]
    return jnp.where(at_new, layout.join(new.key, new.value)[:, None, :], rows)
