"""SLO capacity search (`--find-max`): the highest concurrency or request rate whose runs meet every run-level
bound, found by doubling then bisecting, each load decided by a bootstrap interval rather than one noisy figure."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from infertrace.load.config import BenchConfig, percentile_slo
from infertrace.load.records import RequestResult

RATE_RESOLUTION = 0.05  # request-rate search ends when the bracket is within 5% of its passing end
CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
# Saturation: TTFT rising with send time at least this fast (0.2 s per s: arrivals 20% above what the target
# serves), as a straight line (correlation), over enough requests and seconds to tell a queue from the fill.
SATURATION_SLOPE = 0.2
SATURATION_R = 0.9
SATURATION_MIN_REQUESTS = 32
SATURATION_MIN_SPAN_S = 1.0


@dataclass(slots=True)
class Bound:
    key: str  # as given: p99_ttft_ms
    q: int  # percentile: 50, 90, 95, 99
    metric: str  # ttft, tpot, itl, e2el
    limit_ms: float


def bounds_of(slo: dict[str, float]) -> list[Bound]:
    out = []
    for key, limit in slo.items():
        parsed = percentile_slo(key)
        if parsed is not None:
            out.append(Bound(key, parsed[0], parsed[1], limit))
    return out


def samples_ms(results: list[RequestResult], metric: str) -> np.ndarray:
    """The metric's samples in ms over successful requests; each failed request adds one infinite sample (a miss,
    as failed requests are for goodput). TPOT has no sample for a one-token response."""
    values: list[float] = []
    for r in results:
        if not r.success:
            values.append(math.inf)
        elif metric == "itl":
            values.extend(r.itl)
        elif (v := r.tpot if metric == "tpot" else getattr(r, metric)) is not None:
            values.append(v)
    return np.asarray(values, dtype=np.float64) * 1000.0


@dataclass(slots=True)
class Estimate:
    value_ms: float | None  # the percentile of the pooled samples (numpy's linear interpolation, as Stats)
    low_ms: float | None  # the bootstrap interval around it
    high_ms: float | None
    samples: int


def percentile_interval(samples: np.ndarray, q: int, confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                        seed: int = SEED) -> Estimate:
    """The q-th percentile with a seeded bootstrap percentile interval.

    A resample's k-th smallest value (k = ceil(q n / 100), the nearest rank) is the sample at rank ceil(n U) where
    U is the k-th smallest of n uniforms, which is Beta(k, n - k + 1): drawing U directly gives the same
    distribution as resampling the requests, in O(resamples) work however many samples there are.
    """
    n = len(samples)
    if n == 0:
        return Estimate(None, None, None, 0)
    ordered = np.sort(samples)
    with np.errstate(invalid="ignore"):  # inf - inf inside the interpolation: the percentile is a miss
        value = float(np.nan_to_num(np.percentile(ordered, q), nan=math.inf))
    k = min(max(math.ceil(q * n / 100), 1), n)
    u = np.random.default_rng(seed).beta(k, n - k + 1, resamples)
    replicates = np.sort(ordered[np.clip(np.ceil(u * n).astype(int) - 1, 0, n - 1)])
    tail = (1 - confidence) / 2
    low = float(replicates[math.floor(tail * resamples)])
    high = float(replicates[max(math.ceil((1 - tail) * resamples) - 1, 0)])
    return Estimate(value, min(low, value), max(high, value), n)


@dataclass(slots=True)
class Trial:
    """One load: its runs (one, or up to the repeat limit near the boundary) and the verdict they gave."""

    load: float
    records: list = field(default_factory=list)  # PointRecord per run
    estimates: dict[str, Estimate] = field(default_factory=dict)  # by bound key, over the runs' pooled requests
    passed: bool = False
    decided_by: str = ""  # "interval", "estimate" (still uncertain after every repeat), "saturated", "interrupted"


@dataclass(slots=True)
class Capacity:
    param: str  # "concurrency" or "request_rate"
    slo: dict[str, float]
    trials: list[Trial]  # in the order tried
    max_load: float | None  # the highest passing load (None: not even the start passed)
    first_failing_load: float | None  # the lowest failing load above it (None: the limit passed)
    stopped: str  # why the search ended: "resolution", "limit", "start failed", "points", "interrupted"

    @property
    def records(self) -> list:
        return [r for t in self.trials for r in t.records]

    @property
    def best(self) -> Trial | None:
        return next((t for t in self.trials if t.passed and t.load == self.max_load), None)


def judge(trial: Trial, bounds: list[Bound], repeats: int) -> bool:
    """Fill the trial's estimates and verdict from its runs so far; False when another run is needed.

    Pass when every bound's interval lies within it, fail when any interval lies wholly above it; an interval
    that straddles its bound asks for another run (pooled with the earlier ones), and after `repeats` runs the
    pooled estimate decides.
    """
    last = trial.records[-1]
    if last.interrupted:
        trial.passed, trial.decided_by = False, "interrupted"
        return True
    if last.stopped_early:
        trial.passed, trial.decided_by = False, "saturated"
        return True
    pooled = [r for rec in trial.records for r in rec.results]
    trial.estimates = {b.key: percentile_interval(samples_ms(pooled, b.metric), b.q, seed=SEED + len(trial.records))
                       for b in bounds}
    within = [e.high_ms is not None and e.high_ms <= b.limit_ms for b, e in zip(bounds, trial.estimates.values())]
    above = [e.low_ms is None or e.low_ms > b.limit_ms for b, e in zip(bounds, trial.estimates.values())]
    if all(within) or any(above):
        trial.passed, trial.decided_by = all(within), "interval"
        return True
    if len(trial.records) < repeats:
        return False
    trial.passed = all(e.value_ms is not None and e.value_ms <= b.limit_ms
                       for b, e in zip(bounds, trial.estimates.values()))
    trial.decided_by = "estimate"
    return True


PointRunner = Callable[[float], Awaitable[object]]  # a load -> one measured run (a PointRecord)


async def search(param: str, slo: dict[str, float], start: float, limit: float, max_points: int, repeats: int,
                 run: PointRunner, on_trial: Callable[[Trial], None] = lambda t: None) -> Capacity:
    """Double from `start` until a load fails (or `limit` passes), then bisect between the highest passing and
    the lowest failing load down to the resolution: 1 for concurrency, 5% for a request rate."""
    bounds = bounds_of(slo)
    whole = param == "concurrency"
    trials: list[Trial] = []
    lo = hi = None
    load = int(start) if whole else start
    stopped = "points"
    while len(trials) < max_points:
        trial = Trial(load)
        trials.append(trial)
        while True:
            trial.records.append(await run(load))
            if judge(trial, bounds, repeats):
                break
        on_trial(trial)
        if trial.decided_by == "interrupted":
            stopped = "interrupted"
            break
        if trial.passed:
            lo = load
        else:
            hi = load
        if lo is None:
            stopped = "start failed"
            break
        if hi is None:
            if load >= limit:
                stopped = "limit"
                break
            load = min(load * 2, int(limit) if whole else limit)
            continue
        if (hi - lo <= 1) if whole else (hi - lo <= RATE_RESOLUTION * lo):
            stopped = "resolution"
            break
        load = (lo + hi) // 2 if whole else (lo + hi) / 2
    return Capacity(param, dict(slo), trials, lo, hi, stopped)


class SaturationDetector:
    """Calls `on_saturated` once when TTFT grows linearly with send time across a point: the queue keeps
    growing, so the target cannot keep up and the rest of the point would only lengthen it."""

    def __init__(self, on_saturated: Callable[[], None]) -> None:
        self.on_saturated = on_saturated
        self.sent: list[float] = []
        self.ttft: list[float] = []
        self.fired = False

    def add(self, r: RequestResult) -> None:
        if self.fired or not r.success or r.ttft is None:
            return
        self.sent.append(r.t0)
        self.ttft.append(r.ttft)
        if len(self.sent) >= SATURATION_MIN_REQUESTS and len(self.sent) % 8 == 0 and saturated(self.sent, self.ttft):
            self.fired = True
            self.on_saturated()


def saturated(sent: list[float], ttft: list[float]) -> bool:
    """TTFT against send time is a rising line: slope of at least SATURATION_SLOPE, correlation of at least
    SATURATION_R, over at least SATURATION_MIN_REQUESTS requests sent over SATURATION_MIN_SPAN_S or more."""
    x, y = np.asarray(sent), np.asarray(ttft)
    if len(x) < SATURATION_MIN_REQUESTS or x.max() - x.min() < SATURATION_MIN_SPAN_S or y.std() == 0:
        return False
    slope = np.polyfit(x, y, 1)[0]
    return bool(slope >= SATURATION_SLOPE and np.corrcoef(x, y)[0, 1] >= SATURATION_R)


def load_config(cfg: BenchConfig, load: float) -> BenchConfig:
    """The run at one load: the searched option set, the search's own options off."""
    return BenchConfig(**(dataclasses.asdict(cfg) | {cfg.find_max: load, "find_max": None,
                                                    "slo": cfg.request_slo}))


async def run_capacity(cfg: BenchConfig, target, clock, interrupter, hooks) -> Capacity:
    """The search against a real target: every run is a normal run_point (one timing loop, the same metrics);
    an open-loop run whose queue keeps growing is stopped early as saturated."""
    from infertrace.load.benchmark import run_point

    runs = 0

    async def run(load: float):
        nonlocal runs
        point_cfg = load_config(cfg, load)
        detector = SaturationDetector(interrupter.stop_phase) if point_cfg.open_loop else None

        def on_result(r: RequestResult) -> None:
            hooks.on_result(r)
            if detector is not None:
                detector.add(r)

        hooks.on_info(f"find-max run {runs + 1}: {cfg.find_max.replace('_', '-')}={load:g}")
        record = await run_point(point_cfg, target, clock, interrupter, dataclasses.replace(hooks, on_result=on_result),
                                 runs)
        runs += 1
        return record

    def on_trial(t: Trial) -> None:
        hooks.on_info(f"{cfg.find_max.replace('_', '-')}={t.load:g}: {'pass' if t.passed else 'fail'} "
                      f"({t.decided_by}, {len(t.records)} run(s))")

    return await search(cfg.find_max, cfg.run_slo, cfg.find_max_start, cfg.find_max_limit, cfg.find_max_points,
                        cfg.find_max_repeats, run, on_trial)
