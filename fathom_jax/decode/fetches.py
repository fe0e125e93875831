"""How a decode step fetches the K/V rows it selected and attends over them: one strategy object per way, chosen once.

* :class:`RowFetch`: every selected row is read from the K/V cache (in device or host memory; one run per token:
  each token's key and value sit side by side, as the cache's :class:`~fathom_jax.rows.layout.RowLayout` stores
  them). With the kernels and rows in the model dtype, the attention kernel (:mod:`pallas_kernels.sparse_attend`)
  reads each row by its index where it lies in device memory (no gathered copy); from host memory the row-fetch
  kernel first copies the rows to device memory, the moment the selection is made, and the attention kernel reads
  that buffer. Compressed rows, and the reference, are fetched, dequantized and attended by XLA.
* :class:`CachedRowFetch`: rows that the device-memory row cache's slots hold (:mod:`fathom_jax.decode.row_cache`)
  are taken from there, only the misses are fetched; the step returns what to store in the slots. The rows
  attended are the same bits either way.

The newest token's row, which the stored cache does not hold until the step writes it, is put in where its slot is.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fathom_jax.decode.row_cache import RowFill, row_lookup
from fathom_jax.select import attend
from pallas_kernels import backend
from pallas_kernels.row_fetch import RowFetchConfig, StoredRows, row_fetch
from pallas_kernels.sparse_attend import sparse_attend


@dataclasses.dataclass(frozen=True)
class RowFetch:
    """Fetch every selected row (``programs`` persistent programs of the row fetch; 0: one program per 32 rows);
    ``in_host``: the rows are the offloaded layout's (fetched before they are attended, not read where they lie)."""

    implementation: backend.Implementation = "xla"
    programs: int = 0
    in_host: bool = False
    kernel: bool = True  # the attention kernel (else the rows gathered, then attended by XLA)

    def _by_xla(self, view) -> bool:
        return (not self.kernel or self.implementation == "xla" or view.rows.compressed
                or not _is_pow2(view.rows.head_dim))

    def attend(self, q, slots, member, view, *, group_start: int = 0, after=None):
        """``(out [Rc, G, Dh], fill)``: each head of groups ``group_start ..`` attends its member slots of the union
        ``slots [Rc, S]``; ``fill`` as :meth:`fetch` returns it. The rows' read waits for ``after``."""
        if self._by_xla(view):
            rows, fill = self.fetch(slots, view, group_start=group_start, after=after)
            k_rows, v_rows = view.rows.split(rows)
            return attend(q, k_rows, v_rows, member), fill
        new = view.new
        new_row = None if new is None else view.rows.join(new.key, new.value)
        if not self.in_host:  # read by index where they lie
            rows = StoredRows(view.kv, layer=view.kv_layer, group_start=group_start)
            return sparse_attend(q, rows, slots, member, new_row=new_row,
                                 new_position=None if new is None else new.position,
                                 implementation=self.implementation), None
        fetched = self._rows(slots, view, group_start, after)  # [Rc, S, W]: slot u's row at u
        return _attend_fetched(q, fetched, slots, member, new, new_row, self.implementation), None

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

    def attend(self, q, slots, member, view, *, group_start: int = 0, after=None):
        rows, fill = self.fetch(slots, view, group_start=group_start, after=after)  # the new row already in
        if self._by_xla(view):
            k_rows, v_rows = view.rows.split(rows)
            return attend(q, k_rows, v_rows, member), fill
        return _attend_fetched(q, rows, slots, member, None, None, self.implementation), fill

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


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _attend_fetched(q, fetched, slots, member, new, new_row, implementation):
    """The attention kernel over fetched rows ``[Rc, S, W]`` (slot ``u``'s row at ``u``; ``new``: the token whose
    ``new_row`` replaces its slot's, where it has one)."""
    index = jnp.where(slots >= 0, jnp.arange(slots.shape[-1], dtype=jnp.int32), -1)
    at_new = None
    if new is not None:  # the slot holding the new token (none: -1)
        at_new = jnp.max(jnp.where(slots == new.position[:, None], index, -1), axis=-1)
    return sparse_attend(q, StoredRows(fetched), index, member, new_row=new_row, new_position=at_new,
                         implementation=implementation)
