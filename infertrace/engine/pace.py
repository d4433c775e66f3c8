"""When to plan the next step: as late as the device allows, so that requests arriving meanwhile join it.

With async scheduling, step N+1 is planned and queued while step N runs on the device. Planned the moment N's
predecessor completes, N+1 is fixed for all of N's run: a request arriving during it misses N+1 and waits for N+1
as well as for its own step N+2, one whole step more than it needs. Planned just before N ends, N+1 takes every
request that arrived while N ran, and the device still finds N+1 queued when N ends.

`StepPace` learns the two figures that timing needs: each kind and size of step's device time (a step's completion
on the host less the later of its launch and the completion before it: when it was queued behind its predecessor,
the gap between the two completions), and the host's lead (the time from a step() call to its next step queued).
Its estimate of a step's time is the least of the recent ones of that kind and size, and its lead the greatest
recent lead plus a margin, so that a wrong guess costs a request a step (as before), not the device an idle gap.
"""

from __future__ import annotations

import collections

# Recent device times kept per kind and size of step: the least of them is the estimate. A few, so that the estimate
# follows the context lengths (decode attention's time grows with them), and the least, so that a step the host saw
# complete late (which shortens the next one's measured time) makes the deadline earlier, never later.
DURATION_SAMPLES = 8
# Recent host leads kept: the greatest of them is the lead. Enough to hold the planning of steps that admit a new
# request (a prefill's inputs are longer to build) among many that only decode.
LEAD_SAMPLES = 64
# Added to the lead: the engine loop's own turn between waking and planning (reading what arrived, the selector's
# return), which the lead, timed inside step(), does not see.
LEAD_MARGIN_S = 100e-6
# Token counts are rounded up to a multiple of this: steps of nearly one size (a 512-token prefill beside 10 or 11
# decoding requests) share their estimate; a size never seen gets no wait.
SIZE_QUANTUM = 16


class StepPace:
    def __init__(self) -> None:
        self._durations: dict[tuple, collections.deque[float]] = {}
        self._leads: collections.deque[float] = collections.deque(maxlen=LEAD_SAMPLES)
        self._last_done: float | None = None  # when the host saw the latest step complete

    @staticmethod
    def key(kind: object, num_tokens: int) -> tuple:
        return kind, -(-num_tokens // SIZE_QUANTUM) * SIZE_QUANTUM

    def started(self, launched_at: float) -> float:
        """When a step queued at `launched_at` starts on the device: at once, or when the step before it ends."""
        return launched_at if self._last_done is None else max(launched_at, self._last_done)

    def completed(self, key: tuple, launched_at: float, done_at: float) -> None:
        """A step queued at `launched_at` was seen complete at `done_at`."""
        duration = done_at - self.started(launched_at)
        self._last_done = done_at
        times = self._durations.get(key)
        if times is None:
            times = self._durations[key] = collections.deque(maxlen=DURATION_SAMPLES)
        times.append(duration)

    def lead(self, seconds: float) -> None:
        """The host took `seconds` from a step() call to its next step queued."""
        self._leads.append(seconds)

    def plan_at(self, key: tuple, launched_at: float) -> float | None:
        """When the step after one of `key` queued at `launched_at` should be planned, on the clock of the times
        given; None before the pace has seen such a step and a lead."""
        times = self._durations.get(key)
        if not times or not self._leads:
            return None
        return self.started(launched_at) + min(times) - max(self._leads) - LEAD_MARGIN_S
