"""Clocks for the load generator: the real monotonic one, and a scripted one that tests move by hand."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep_until(self, t: float) -> None: ...


class MonotonicClock:
    """perf_counter seconds; sleeping relies on the event loop's timer (about a millisecond of granularity)."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep_until(self, t: float) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)


class ScriptedClock:
    """Time moves only when told to: `set`/`advance`, or a `sleep_until` that jumps forward to its deadline."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def set(self, t: float) -> None:
        assert t >= self.t, f"scripted time goes backwards: {t} < {self.t}"
        self.t = t

    def advance(self, dt: float) -> None:
        self.set(self.t + dt)

    async def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)
        await asyncio.sleep(0)
