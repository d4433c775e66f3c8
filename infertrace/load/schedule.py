"""Arrival schedules for the open loop, computed up front so that sending never waits on random draws."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(rate: float, burstiness: float, rng: np.random.Generator, count: int | None = None,
                    duration_s: float | None = None) -> list[float]:
    """Send times in seconds after the start: the first at 0, then gamma-distributed gaps.

    The gaps have mean 1/rate and shape `burstiness` (1 is a Poisson process; below 1 burstier, above 1 more
    even). Stops after `count` arrivals or at `duration_s`, whichever comes first. An infinite rate sends all
    `count` requests at once.
    """
    assert count is not None or duration_s is not None
    if math.isinf(rate):
        assert count is not None, "an infinite rate needs a request count"
        return [0.0] * count
    if count == 0:
        return []
    scale = 1.0 / (rate * burstiness)
    offsets = [0.0]
    while True:
        batch = min(count - len(offsets), 4096) if count is not None else 4096
        if batch <= 0:
            return offsets
        for t in (offsets[-1] + np.cumsum(rng.gamma(burstiness, scale, batch))).tolist():
            if duration_s is not None and t >= duration_s:
                return offsets
            offsets.append(t)
