"""Medians of repeated runs and seeded bootstrap confidence intervals, so that run-to-run noise does not fail a gate.

Against a baseline, each side is resampled from its own median and the runs' pooled scatter (every run's distance
from its side's median, both signs, on the log scale for a relative bound), not from its own runs alone. A side
with one run has no scatter of its own: resampled alone, one run at half the baseline's throughput was a point
and failed, while three such runs spread over their own range and passed as "within noise". With the scatter
pooled, one run is taken to be as noisy as the runs beside it, and more runs of the same slowdown only narrow
the interval. Without a baseline (--min, --max) the median is resampled from the runs themselves.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence


def change_interval(current: Sequence[float], baseline: Sequence[float], *, relative: bool, confidence: float,
                    resamples: int, seed: int) -> tuple[float, float]:
    """Percentile interval of the change of the median, `current` against `baseline`: the relative change (a
    fraction, median_now / median_before - 1) or the absolute difference, over resamples of both sides drawn
    from each side's median plus the pooled, symmetric scatter (see above). One run on each side has no scatter:
    the interval is the point. Seeded, so the same on every machine and every call."""
    transform = math.log if relative else float
    now, before = [transform(v) for v in current], [transform(v) for v in baseline]
    centre_now, centre_before = statistics.median(now), statistics.median(before)
    scatter = [v - centre_now for v in now] + [v - centre_before for v in before]
    scatter += [-d for d in scatter]
    rng = random.Random(seed)
    values = sorted(
        (centre_now + statistics.median(rng.choices(scatter, k=len(now))))
        - (centre_before + statistics.median(rng.choices(scatter, k=len(before))))
        for _ in range(resamples)
    )
    low, high = _percentiles(values, confidence)
    if relative:
        return math.expm1(low), math.expm1(high)
    return low, high


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
    return _percentiles(values, confidence)


def _percentiles(values: list[float], confidence: float) -> tuple[float, float]:
    """The two-sided `confidence` percentile interval of sorted `values`."""
    tail = (1 - confidence) / 2
    return values[math.floor(tail * len(values))], values[max(math.ceil((1 - tail) * len(values)) - 1, 0)]
