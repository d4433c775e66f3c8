"""Interval arithmetic on integer nanoseconds: unions, their overlaps, and time covered before a point.

Intervals are half-open `[start, end)`; two intervals that touch are merged, as HTA's `merge_kernel_intervals`
merges them.
"""

from __future__ import annotations

import numpy as np


def union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The disjoint, sorted segments covered by the intervals."""
    if starts.size == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    return s[first], np.maximum.reduceat(e, first)


def covered(seg_starts: np.ndarray, seg_ends: np.ndarray) -> int:
    return int((seg_ends - seg_starts).sum())


def covered_before(seg_starts: np.ndarray, seg_ends: np.ndarray, t: np.ndarray) -> np.ndarray:
    """For each time in `t`, how much of the segments lies before it."""
    t = np.asarray(t, dtype=np.int64)
    if seg_starts.size == 0:
        return np.zeros(t.shape, dtype=np.int64)
    prefix = np.concatenate(([0], np.cumsum(seg_ends - seg_starts)))
    k = np.searchsorted(seg_starts, t, side="right")  # segments starting at or before t
    inside = np.zeros(t.shape, dtype=np.int64)
    has = k > 0
    last = k[has] - 1
    inside[has] = np.minimum(t[has], seg_ends[last]) - seg_starts[last]
    return np.where(has, prefix[np.maximum(k - 1, 0)] + inside, 0)


def covered_between(seg_starts: np.ndarray, seg_ends: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """For each window `[lo, hi)`, how much of the segments lies inside it."""
    return covered_before(seg_starts, seg_ends, hi) - covered_before(seg_starts, seg_ends, lo)


def overlap_by_mask(unions: list[tuple[np.ndarray, np.ndarray]]) -> dict[int, int]:
    """Time spent in each combination of the given unions, keyed by bit mask (bit i set: union i active).

    Each union must be disjoint (from `union`), so a running sum of +2**i / -2**i is exactly the mask."""
    times, deltas = [], []
    for bit, (s, e) in enumerate(unions):
        times += [s, e]
        deltas += [np.full(s.size, 1 << bit, dtype=np.int64), np.full(e.size, -(1 << bit), dtype=np.int64)]
    if not times:
        return {}
    t = np.concatenate(times)
    d = np.concatenate(deltas)
    order = np.argsort(t, kind="stable")
    t, running = t[order], np.cumsum(d[order])
    span = np.diff(t)
    mask = running[:-1]
    keep = (span > 0) & (mask > 0)
    masks, which = np.unique(mask[keep], return_inverse=True)
    sums = np.zeros(masks.size, dtype=np.int64)
    np.add.at(sums, which, span[keep])
    return {int(m): int(v) for m, v in zip(masks, sums)}
