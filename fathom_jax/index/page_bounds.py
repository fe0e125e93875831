"""Quest's page upkeep: the fp16 per-channel min and max key of every ``P``-token page, built at once or appended
token by token.

A page's bounds are over its valid tokens; min and max do not depend on the order of their operands, and each is
rounded once (f32 to fp16, to nearest, as the landmark means are: not outward, which Quest does not do either), so
the index after appends equals the index built from all keys, bit for bit. A page's row is ``[min | max]``
(``2 D`` fp16 values); a page with no valid token is zeros. The raw keys of the partially filled last page (``tail``)
are kept so an append can recompute that page's bounds, as :mod:`fathom_jax.index.landmarks` does for its 8-token blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Float16, Int

from fathom_jax.format import BLOCK_TOKENS


def check_page(page, where: str = "Quest") -> None:
    """Pages tile the 64-token plane block (so every capacity): ``page`` a power of two dividing it."""
    if not isinstance(page, int) or isinstance(page, bool) or page < 1 or BLOCK_TOKENS % page:
        raise ValueError(f"{where}: page must be an int dividing {BLOCK_TOKENS} (1, 2, 4, ..., {BLOCK_TOKENS}), "
                         f"got {page!r}")


def page_bounds(pages: Float[Array, "... P D"], count: Int[Array, "..."]) -> Float16[Array, "... 2D"]:
    """fp16 ``[min | max]`` over the first ``count`` rows of ``[..., P, D]`` pages (zeros where ``count`` is 0)."""
    valid = (jnp.arange(pages.shape[-2]) < count[..., None])[..., None]
    lo = jnp.min(jnp.where(valid, pages, jnp.inf), axis=-2)
    hi = jnp.max(jnp.where(valid, pages, -jnp.inf), axis=-2)
    return jnp.where(count[..., None] > 0, jnp.concatenate([lo, hi], axis=-1), 0.0).astype(jnp.float16)


def build(keys: Float[Array, "*B n D"], length: Int[Array, "*B"], page: int) -> Float16[Array, "*B NP 2D"]:
    """fp16 ``[min | max]`` of each ``page``-token page over its valid tokens, ``[*B, n / page, 2 D]``."""
    *batch, n, d = keys.shape
    starts = jnp.arange(n // page) * page
    count = jnp.clip(length[..., None] - starts, 0, page)
    return page_bounds(keys.reshape(*batch, n // page, page, d), count)


def truncate(bounds: Float16[Array, "*B NP 2D"], tail: Float[Array, "*B P D"], length: Int[Array, "*B"]
             ) -> Float16[Array, "*B NP 2D"]:
    """The bounds of the first ``length`` tokens, from those of a longer prefix of the same keys.

    ``tail`` holds the raw keys of the page at ``length`` (zeros from ``length`` on, as
    :func:`fathom_jax.store.block_tail` gives). Equals :func:`build` with ``length``, bit for bit: earlier pages
    are complete and shared, that page's bounds are recomputed, later pages are emptied.
    """
    page = tail.shape[-2]
    current = (length // page)[..., None, None]
    index = jnp.arange(bounds.shape[-2])[:, None]
    row = page_bounds(tail, length % page)[..., None, :]
    return jnp.where(index < current, bounds, jnp.where(index == current, row, jnp.float16(0)))


def append_page(tail: Float[Array, "P D"], length: Int[Array, ""], key: Float[Array, "D"]
                ) -> tuple[Float16[Array, "2D"], Float[Array, "P D"]]:
    """The bounds of the last page after appending one key at ``length``, and the new raw tail."""
    offset = length % tail.shape[-2]
    tail = jnp.where(offset == 0, 0.0, tail).at[offset].set(key)
    return page_bounds(tail, offset + 1), tail


def append_one(bounds: Float16[Array, "NP 2D"], tail, length, key):
    """Append one key ``[D]`` to one sequence's bounds (recompute its page)."""
    row, tail = append_page(tail, length, key)
    bounds = jax.lax.dynamic_update_slice(bounds, row[None], (length // tail.shape[-2], 0))
    return bounds, tail
