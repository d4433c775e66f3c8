"""Interval unions on integer nanoseconds."""

from __future__ import annotations

import numpy as np

from infertrace.analyze.intervals import (
    covered,
    covered_between,
    overlap_by_mask,
    union,
)


def test_union_merges_overlapping_and_touching():
    s, e = union(np.array([30, 0, 5, 10, 12]), np.array([31, 4, 10, 11, 20]))
    assert s.tolist() == [0, 5, 12, 30] and e.tolist() == [4, 11, 20, 31]
    assert covered(s, e) == 4 + 6 + 8 + 1


def test_covered_between_windows():
    s, e = np.array([0, 5, 12]), np.array([4, 11, 20])
    got = covered_between(s, e, np.array([-5, 2, 4, 11, 0, 25]), np.array([0, 7, 5, 12, 100, 30]))
    assert got.tolist() == [0, 2 + 2, 0, 0, 18, 0]


def test_overlap_by_mask():
    a = union(np.array([0, 10]), np.array([5, 20]))
    b = union(np.array([3]), np.array([12]))
    assert overlap_by_mask([a, b]) == {1: 3 + 8, 2: 5, 3: 2 + 2}
    assert overlap_by_mask([union(np.array([], dtype=np.int64), np.array([], dtype=np.int64))]) == {}
