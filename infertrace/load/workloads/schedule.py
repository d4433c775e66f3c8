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


def ramp_rate(strategy: str, start_rps: float, end_rps: float, progress: float) -> float:
    """The request rate at `progress` in [0, 1] of a ramp (vLLM 0.33's meaning, vllm/benchmarks/serve.py):
    linear goes from start to end in equal steps, exponential by a constant ratio."""
    if strategy == "linear":
        return start_rps + (end_rps - start_rps) * progress
    assert strategy == "exponential", strategy
    return start_rps * (end_rps / start_rps) ** progress


def ramp_up_offsets(strategy: str, start_rps: float, end_rps: float, burstiness: float, rng: np.random.Generator,
                    count: int) -> list[float]:
    """Send times of `count` requests whose rate ramps from `start_rps` to `end_rps`.

    Request i is due at progress i / (count - 1), and the gap before it is gamma-distributed with mean 1/rate(i)
    and shape `burstiness`, as vLLM draws it; as in every open loop here the first request is sent at 0.
    """
    rates = [ramp_rate(strategy, start_rps, end_rps, i / max(count - 1, 1)) for i in range(count)]
    gaps = [float(rng.gamma(burstiness, 1.0 / (rate * burstiness))) for rate in rates[1:]]
    return [0.0, *np.cumsum(gaps).tolist()][:count]
