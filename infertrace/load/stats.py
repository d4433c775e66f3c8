"""The six statistics of a sample of latencies, as `vllm bench serve` reports them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PERCENTILES = (90, 95, 99)


@dataclass(slots=True)
class Stats:
    """mean, median, std (population), p90, p95, p99 in milliseconds; None when there is no sample."""

    mean: float | None = None
    median: float | None = None
    std: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    count: int = 0

    @classmethod
    def of(cls, seconds: list[float]) -> Stats:
        if not seconds:
            return cls()
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        p90, p95, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(float(ms.mean()), float(np.median(ms)), float(ms.std()), p90, p95, p99, len(ms))

    def p(self, q: int) -> float | None:
        return {50: self.median, 90: self.p90, 95: self.p95, 99: self.p99}[q]
