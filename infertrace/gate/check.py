"""The gate itself: each bound checked on the median of repeated runs, with a bootstrap interval deciding whether a
breach is a regression or within noise."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from enum import Enum

from infertrace.gate.bounds import Bound
from infertrace.gate.results import ResultError, Run
from infertrace.gate.stats import bootstrap_interval, change_interval

# the bootstrap is pure Python: a million resamples of one bound take a few seconds and tens of MB, and an unbounded
# count would hold the gate (and its memory) for as long as it was told
MIN_RESAMPLES, MAX_RESAMPLES = 100, 1_000_000


@dataclass(frozen=True)
class GateConfig:
    confidence: float = 0.95
    resamples: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.5 <= self.confidence < 1:
            raise ValueError(f"confidence must be in [0.5, 1), got {self.confidence}")
        if not MIN_RESAMPLES <= self.resamples <= MAX_RESAMPLES:
            raise ValueError(f"resamples must be from {MIN_RESAMPLES:,} to {MAX_RESAMPLES:,}, got {self.resamples:,}")


class Verdict(Enum):
    OK = "ok"  # the median is within the bound
    NOISE = "within noise"  # the median breaches the bound, but the interval still reaches back inside it
    REGRESSION = "regression"  # the whole interval lies beyond the bound


@dataclass(frozen=True)
class Check:
    bound: Bound
    baseline: float | None  # median of the baseline runs (None for --min/--max)
    current: float  # median of the runs under test
    change: float | None  # the checked quantity for a baseline bound: relative (a fraction) or absolute change
    interval: tuple[float, float]  # interval of the checked quantity: the change, or the value for --min/--max
    verdict: Verdict


@dataclass(frozen=True)
class GateReport:
    checks: list[Check]
    current_runs: int
    baseline_runs: int
    config: GateConfig

    @property
    def regressed(self) -> bool:
        return any(check.verdict is Verdict.REGRESSION for check in self.checks)


def evaluate(current: list[Run], baseline: list[Run], bounds: list[Bound], config: GateConfig) -> GateReport:
    """Check every bound; raises ResultError where a metric is missing or a relative bound has a zero baseline."""
    checks = [_check(bound, current, baseline, config) for bound in bounds]
    return GateReport(checks, len(current), len(baseline), config)


def _check(bound: Bound, current: list[Run], baseline: list[Run], config: GateConfig) -> Check:
    now = [run.metric(bound.metric) for run in current]
    before = [run.metric(bound.metric) for run in baseline] if bound.needs_baseline else None
    if bound.relative and min(before) <= 0:
        raise ResultError(
            f"a relative bound on {bound.metric} needs a positive baseline, and a baseline run has "
            f"{min(before):g}: give an absolute limit instead"
        )

    def checked(now_median: float, before_median: float | None) -> float:
        if before_median is None:
            return now_median
        if bound.relative:
            return now_median / before_median - 1
        return now_median - before_median

    median_now = statistics.median(now)
    median_before = None if before is None else statistics.median(before)
    point = checked(median_now, median_before)
    if before is None or (bound.relative and min(now) <= 0):  # no log scale for a run at 0 (every request failed)
        interval = bootstrap_interval(
            checked, now, before, confidence=config.confidence, resamples=config.resamples, seed=config.seed
        )
    else:  # see stats.py: the pooled scatter, so that more runs of one slowdown only narrow the interval
        interval = change_interval(now, before, relative=bound.relative, confidence=config.confidence,
                                   resamples=config.resamples, seed=config.seed)
    interval = (min(interval[0], point), max(interval[1], point))  # rounding must not leave the point outside
    change = None if before is None else point
    return Check(bound, median_before, median_now, change, interval, _verdict(bound, point, interval))


def _verdict(bound: Bound, point: float, interval: tuple[float, float]) -> Verdict:
    low, high = interval
    # a change of exactly the limit (95 against 100 with max-drop 5%) must pass despite rounding
    slack = 1e-9 * max(1.0, abs(bound.threshold))
    if bound.is_floor:
        inside, cleared = point >= bound.threshold - slack, high < bound.threshold - slack
    else:
        inside, cleared = point <= bound.threshold + slack, low > bound.threshold + slack
    if inside:
        return Verdict.OK
    return Verdict.REGRESSION if cleared else Verdict.NOISE
