"""scripts/row_reuse.py's arithmetic: the fraction of a step's rows that the last W steps did not select."""


import numpy as np
import pytest

from scripts import row_reuse


def test_new_fraction_counts_rows_unseen_in_the_window():
    # one group, 4 steps of 3 union slots (the last slot of step 2 masked out)
    union = np.array([[[1, 2, 3]], [[2, 3, 4]], [[4, 5, 9]], [[1, 5, 6]]])
    mask = np.ones(union.shape, bool)
    mask[2, 0, 2] = False
    # W = 1: step 1 new {4} of 3, step 2 new {5} of 2, step 3 new {1, 6} of 3
    frac, total = row_reuse.new_fraction(union, mask, 1)
    assert total == 8 and frac == pytest.approx(4 / 8)
    # W = 2 (steps 2, 3): step 2 new {5} of 2; step 3 sees steps 1-2 = {2, 3, 4, 5}: new {1, 6} of 3
    assert row_reuse.new_fraction(union, mask, 2) == (pytest.approx(3 / 5), 5)
    # the middle only (rows >= sink 2 and < the local window's start 6 at every step): W = 1
    frac, total = row_reuse.new_fraction(union, mask, 1, (2, np.full(4, 6)))
    assert total == 6 and frac == pytest.approx(2 / 6)  # step 1 {2,3,4}: 4 new; step 2 {4,5}: 5 new; step 3 {5}
