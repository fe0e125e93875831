"""The implementation switch: backend names, None resolved once, the earlier name refused with a message."""

import pytest

from pallas_kernels import backend as B


def test_backends_are_named():
    assert B.IMPLEMENTATIONS == ("xla", "triton")
    assert B.resolve_implementation(None) == ("triton" if B.on_gpu() else "xla")
    for name in B.IMPLEMENTATIONS:
        assert B.resolve_implementation(name) == name


def test_the_earlier_name_and_unknown_ones_are_refused():
    with pytest.raises(ValueError, match="'pallas' is now named after its backend: 'triton'"):
        B.resolve_implementation("pallas")
    with pytest.raises(ValueError, match=r"implementation must be one of \('xla', 'triton'\)"):
        B.resolve_implementation("mosaic_gpu")
