"""The bit-plane key store: 4-bit block-scaled key codes held channel-major as bit planes.

``quantizer``  the 4-bit block quantizer and its bit planes (the arithmetic every store is made of)
``layout``     the pytrees (:class:`PlaneStore`, :class:`UnpackedStore`, :class:`KeyRotation`) and their memory layout
``build``      build from keys, append decode tokens (exactly), cut to a prefix
``read``       reads at per-channel depths: codes, the t-bit values, scales

The KLT variant stores planes of ``(k - mu) V`` (:class:`KeyRotation`); a store built with a rotation remembers it,
and queries are rotated with :func:`rotate_queries` before scoring. The public names of the four are here.
"""

from fathom_jax.store.build import append, append_block, build_store, check_capacity, truncate, unpack_store
from fathom_jax.store.layout import KeyRotation, PlaneStore, UnpackedStore, rotate_keys, rotate_queries
from fathom_jax.store.quantizer import (block_tail, check_depth, dequantize_codes, exact_cell, pack_block, pack_planes,
                                        quantize_blocks, unpack_planes, unpack_planes_channels)
from fathom_jax.store.read import (dequantize, dequantize_block, dequantize_channels, dequantize_levels, read_codes,
                                   token_scales)

__all__ = ["KeyRotation", "PlaneStore", "UnpackedStore", "append", "append_block", "block_tail", "build_store",
           "check_capacity", "check_depth", "dequantize", "dequantize_block", "dequantize_channels",
           "dequantize_codes", "dequantize_levels", "exact_cell", "pack_block", "pack_planes", "quantize_blocks",
           "read_codes", "rotate_keys", "rotate_queries", "token_scales", "truncate", "unpack_planes",
           "unpack_planes_channels", "unpack_store"]
