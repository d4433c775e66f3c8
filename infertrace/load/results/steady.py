"""Steady state: the window of a run in which the requests in flight hold their target level, and the output
throughput inside it, with the pipeline's fill, a ramp's low start and the final drain left out."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infertrace.load.records import RequestResult


@dataclass(slots=True)
class SteadyState:
    start: float  # clock seconds: the first moment the requests in flight reach `in_flight`
    end: float  # the last moment they are still at least `in_flight`
    in_flight: int  # the target level
    output_tokens: float  # tokens whose output events fall inside [start, end]

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def output_throughput(self) -> float | None:
        return self.output_tokens / self.duration if self.duration > 0 else None


def in_flight_steps(results: list[RequestResult]) -> list[tuple[float, int]]:
    """(time, requests in flight just after it) at every send and every end, in time order (ends first at a tie)."""
    events = sorted([(r.t0, 1) for r in results] + [(r.end, -1) for r in results])
    out, count = [], 0
    for t, delta in events:
        count += delta
        out.append((t, count))
    return out


def median_in_flight(results: list[RequestResult]) -> int:
    """The time-weighted median of the requests in flight between the first and the last send."""
    first, last = min(r.t0 for r in results), max(r.t0 for r in results)
    steps = in_flight_steps(results)
    held: dict[int, float] = {}
    for (t, count), (t_next, _) in zip(steps, steps[1:]):
        lo, hi = max(t, first), min(t_next, last)
        if hi > lo:
            held[count] = held.get(count, 0.0) + hi - lo
    if not held:  # every request sent at one instant: the level right after the last send
        return max(count for t, count in steps if t <= last)
    total, acc = sum(held.values()), 0.0
    for level in sorted(held):
        acc += held[level]
        if acc >= total / 2:
            return level
    raise AssertionError("unreachable: the accumulated time reaches the total")


def token_times(r: RequestResult) -> tuple[np.ndarray, np.ndarray]:
    """(clock time, tokens) of each output event of a successful request: the first at t0 + TTFT, then one per
    ITL gap. Tokens per event are the chunk counts when all are known, else the output tokens spread evenly."""
    if not r.success or r.ttft is None:
        return np.empty(0), np.empty(0)
    times = r.t0 + r.ttft + np.concatenate(([0.0], np.cumsum(r.itl)))
    if len(r.chunk_tokens) == len(times) and None not in r.chunk_tokens:
        tokens = np.asarray(r.chunk_tokens, dtype=np.float64)
    else:
        tokens = np.full(len(times), (r.output_tokens or len(times)) / len(times))
    return times, tokens


def steady_state(results: list[RequestResult], target: int | None) -> SteadyState | None:
    """The steady window of a run (docs/bench.md, "Steady state").

    `target` is the closed loop's concurrency (capped at the number of requests); None for an open loop,
    whose target is the time-weighted median of the requests in flight while requests are being sent. The
    window runs from the first moment the requests in flight reach the target to the last moment they are
    still at or above it. None when there are no requests, or when the requests in flight never reach the
    target (workers whose first requests did not overlap).
    """
    if not results:
        return None
    level = min(target, len(results)) if target is not None else median_in_flight(results)
    level = max(level, 1)
    steps = in_flight_steps(results)
    start = next((t for t, count in steps if count >= level), None)
    if start is None:  # never reached (workers whose first requests did not overlap): no steady window
        return None
    end = start
    for (t, count), (t_next, count_next) in zip(steps, steps[1:]):
        if count >= level and count_next < level:
            end = t_next
    tokens = 0.0
    for r in results:
        times, counts = token_times(r)
        tokens += float(counts[(times >= start) & (times <= end)].sum())
    return SteadyState(start, end, level, tokens)
