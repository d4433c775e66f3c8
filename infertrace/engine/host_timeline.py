"""Host timestamps of tensor-parallel steps, for `benchmarks/tp_bench.py --timeline`: when rank 0 sent a step's
inputs and had queued its kernels, when another rank received them and had queued its own, and when rank 0 saw a
step's tokens land. With async scheduling rank 0 sends step N+2 only after step N's tokens land, so that turnaround
and the other ranks' launch are the host path every step waits on.

Off (None) unless a benchmark turns it on in a process (`start`); a mark then costs one list append. The clock is
`time.perf_counter_ns`, CLOCK_MONOTONIC on Linux, which every process of one host shares.
"""

from __future__ import annotations

import time

EVENTS: list[tuple[str, int]] | None = None


def mark(what: str) -> None:
    if EVENTS is not None:
        EVENTS.append((what, time.perf_counter_ns()))


def start() -> None:
    global EVENTS
    EVENTS = []


def stop() -> list[tuple[str, int]]:
    """The marks since `start`, in order; recording ends."""
    global EVENTS
    events, EVENTS = EVENTS or [], None
    return events
