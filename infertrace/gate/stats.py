"""Medians of repeated runs and seeded bootstrap confidence intervals, so that run-to-run noise does not fail a gate."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence


def bootstrap_interval(
    statistic: Callable[[float, float | None], float],
    current: Sequence[float],
    baseline: Sequence[float] | None,
    *,
    confidence: float,
    resamples: int,
    seed: int,
) -> tuple[float, float]:
    """Percentile interval of `statistic(median of current, median of baseline)` over resamples of both samples.

    The two samples are resampled independently (with replacement, each to its own size), from one seeded
    generator, so the interval is the same on every machine and every call.
    """
    rng = random.Random(seed)
    values = sorted(
        statistic(
            statistics.median(rng.choices(current, k=len(current))),
            None if baseline is None else statistics.median(rng.choices(baseline, k=len(baseline))),
        )
        for _ in range(resamples)
    )
    tail = (1 - confidence) / 2
    low = values[math.floor(tail * resamples)]
    high = values[max(math.ceil((1 - tail) * resamples) - 1, 0)]
    return low, high
