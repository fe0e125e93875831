"""The parts a key index is made of, each a small static type that knows its own data.

    RAW, KLT, LOKI   bit-plane stores (:class:`~fathom_jax.store.PlaneStore`) of the keys, or of a calibration
                     rotation of them (Fathom KLT, Loki)
    LANDMARKS        fp16 means of every 8-token block (:class:`Landmarks`)
    QUEST16, QUEST8  fp16 per-channel min and max key of every 16- or 8-token page (:class:`PageBounds`: any page
                     dividing the 64-token block; Quest)
    KEYS             the keys as given (the exact oracle; dense attention)

A method names the parts it reads (:attr:`fathom_jax.methods.ScanMethod.parts`); :func:`fathom_jax.index.build_index`
builds the parts it is given. Every part knows how its data is built, appended to and cut to a prefix (the same
bits whichever way), which of its leaves grow with the context (:meth:`IndexPart.bulk`: what a placement may put
in host memory), its bytes, and how a stacked decode cache ``[L, R, ...]`` holds it (:meth:`IndexPart.empty`,
:meth:`IndexPart.add_token`, :meth:`IndexPart.write_token`, ...). A new kind of index data is one class (in a module beside
this one) registered here, and the method that reads it.
"""


from __future__ import annotations

from fathom_jax.calibrate import Calibration, key_rotation, loki_rotation
from fathom_jax.index.part import Alloc, IndexPart, Write
from fathom_jax.index.plane_part import Planes
from fathom_jax.index.plane_stacking import PlaneBlock
from fathom_jax.index.row_parts import (BlockRows, LandmarkBlock, LandmarkMeans, Landmarks, PageBlock, PageBounds,
                                        Pages, StoredKeys)

RAW = Planes("raw")
KLT = Planes("klt", key_rotation)
LOKI = Planes("loki", loki_rotation)
LANDMARKS = LandmarkMeans()
QUEST16 = PageBounds(16)
QUEST8 = PageBounds(8)
KEYS = StoredKeys()
PARTS: tuple[IndexPart, ...] = (RAW, KLT, LOKI, LANDMARKS, QUEST16, QUEST8, KEYS)


def shares_store(a: IndexPart, b: IndexPart, calib: Calibration | None) -> bool:
    """Whether two plane parts store the same codes for ``calib`` (their rotations are one basis object), so that
    one store serves both (Loki reads the KLT store when the calibration gives it the KLT basis)."""
    if not (isinstance(a, Planes) and isinstance(b, Planes)) or calib is None:
        return False
    if a.rotation is None or b.rotation is None:
        return a.rotation is b.rotation
    ra, rb = a.rotation(calib), b.rotation(calib)
    return ra.mean is rb.mean and ra.basis is rb.basis


__all__ = ["Alloc", "BlockRows", "IndexPart", "KEYS", "KLT", "LANDMARKS", "LOKI", "LandmarkBlock", "LandmarkMeans",
           "Landmarks", "PARTS", "PageBlock", "PageBounds", "Pages", "PlaneBlock", "Planes", "QUEST16", "QUEST8", "RAW",
           "StoredKeys", "Write", "shares_store"]
