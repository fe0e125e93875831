"""The key index: the typed parts a set of scan methods reads, built at once or appended to.

``key_index``   :class:`KeyIndex` (parts + their data) and build / append / prefix / unpack over any parts
``parts``       the registry of parts (RAW, KLT, LOKI, LANDMARKS, QUEST16 / QUEST8, KEYS) and their types:
                ``part`` (the base), ``plane_part`` (bit-plane stores), ``row_parts`` (a row per block, the keys)
``landmarks``, ``page_bounds``   the 8-token block means and Quest's per-page channel bounds
"""

from fathom_jax.index.key_index import (KeyIndex, append_index, build_index, check_calibration, check_parts,
                                        prefix_index, unpack_index)

__all__ = ["KeyIndex", "append_index", "build_index", "check_calibration", "check_parts", "prefix_index",
           "unpack_index"]
