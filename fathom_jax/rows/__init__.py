"""K/V rows: how a token's key and value rows are stored, compressed or not.

``formats``  the row formats (bf16, k8v8, 4-bit, per group or block, the store's codes as K): encode, decode, bytes
``quant``    the integer quantizers the formats share
``layout``   :class:`RowLayout`: how a decode cache stores a row (the model's dtype or a format's uint32 words)
"""

from fathom_jax.rows.formats import RowFormat, Rows, parse
from fathom_jax.rows.layout import RowLayout

__all__ = ["RowFormat", "RowLayout", "Rows", "parse"]
