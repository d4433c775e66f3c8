"""Drives requests at a target: a closed loop of N workers, or an open loop on a precomputed arrival schedule."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import time
from collections.abc import Callable, Iterable, Iterator

from infertrace.load.client.target import Target
from infertrace.load.client.timing import measure
from infertrace.load.clock import Clock
from infertrace.load.records import RequestResult, RequestSpec

# Every finished request's records (its ITL list) live until the run ends, so CPython's default thresholds
# (700, 10, 10) make each full collection re-scan a heap that grows with the run: a quarter of the CPU of a
# 5-second run on one core went to collections. Young objects are still collected, just in larger batches.
MEASURED_GC_THRESHOLD = (10_000, 50, 1_000)


@contextlib.contextmanager
def measured_gc():
    """Rarer garbage collections while requests are measured; the previous thresholds after."""
    old = gc.get_threshold()
    gc.set_threshold(*MEASURED_GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def cancel_requested() -> bool:
    """Whether the running task has been asked to cancel, even if code below it caught the CancelledError (a
    client library may turn one into a disconnect): a loop that checks it before each request sends none after a
    Ctrl-C. Python 3.10's tasks do not count requests to cancel, so there it is always False."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 0)())


def cpu_seconds() -> tuple[float, float]:
    """CPU time of this thread (the event loop that runs the load generator) and of the whole process."""
    return time.thread_time(), time.process_time()


class Runner:
    """Sends requests and keeps every outcome, including the ones cut short when the run is cancelled."""

    def __init__(self, target: Target, clock: Clock,
                 on_result: Callable[[RequestResult], None] | None = None,
                 cpu_clock: Callable[[], tuple[float, float]] | None = None) -> None:
        self.target = target
        self.clock = clock
        self.on_result = on_result
        self.cpu_clock = cpu_clock or (lambda: cpu_seconds())  # looked up at call time: tests replace it
        self.results: list[RequestResult] = []
        self._inflight: set[asyncio.Task] = set()
        self._cpu_first: tuple[float, float] | None = None  # at the first send
        self._cpu_last: tuple[float, float] | None = None  # at the latest completion

    @property
    def cpu_window(self) -> tuple[float, float] | None:
        """(thread, process) CPU seconds from the first send to the last completion: the measured duration's
        own window, so setup before it (prompts, schedules) and teardown after it are not charged to it."""
        if self._cpu_first is None or self._cpu_last is None:
            return None
        return self._cpu_last[0] - self._cpu_first[0], self._cpu_last[1] - self._cpu_first[1]

    async def send(self, spec: RequestSpec, scheduled: float, slot_wait: float = 0.0) -> RequestResult:
        """Measure one request (kept with every other outcome) and return its result."""
        result = RequestResult(spec.index, scheduled=scheduled, t0=scheduled, end=scheduled, slot_wait=slot_wait,
                               session=spec.session, turn=spec.turn)
        await self._measure(result, spec)
        return result

    async def _one(self, spec: RequestSpec, scheduled: float, slot_wait: float = 0.0) -> None:
        await self.send(spec, scheduled, slot_wait)

    async def _measure(self, result: RequestResult, spec: RequestSpec) -> None:
        if self._cpu_first is None:
            self._cpu_first = self.cpu_clock()
        try:
            await measure(result, self.target, spec, self.clock)
        except asyncio.CancelledError:
            result.error, result.end = "interrupted", self.clock.now()
            raise
        except Exception as e:  # noqa: BLE001 - a fault in a target must cost one request, not the run
            result.error, result.end = f"client error: {type(e).__name__}: {e}", self.clock.now()
        finally:
            self._cpu_last = self.cpu_clock()
            self.results.append(result)
            if self.on_result is not None:
                self.on_result(result)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task

    async def _cancel_inflight(self) -> None:
        for task in self._inflight:
            task.cancel()
        await asyncio.gather(*self._inflight, return_exceptions=True)

    async def _settle(self) -> None:
        """Wait for everything in flight; if we are cancelled meanwhile, cancel it all and wait for that."""
        try:
            while self._inflight:
                await asyncio.gather(*self._inflight)
        except asyncio.CancelledError:
            await self._cancel_inflight()
            raise

    async def closed_loop(self, specs: Iterable[RequestSpec], concurrency: int,
                          deadline: float | None = None) -> None:
        """`concurrency` workers, each sending its next request as soon as its previous one ends.

        A request's scheduled time is the moment its worker became free; with a deadline, no request starts
        after it (the ones in flight finish).
        """
        queue: Iterator[RequestSpec] = iter(specs)

        async def worker() -> None:
            ready = self.clock.now()
            while deadline is None or ready < deadline:
                if cancel_requested():
                    raise asyncio.CancelledError
                spec = next(queue, None)
                if spec is None:
                    return
                await self._one(spec, ready)
                ready = self.clock.now()

        for _ in range(concurrency):
            self._spawn(worker())
        await self._settle()

    async def open_loop(self, specs: Iterable[RequestSpec], offsets: list[float],
                        concurrency: int | None = None) -> None:
        """Send request i at start + offsets[i]; with `concurrency`, a request due while all slots are busy
        waits for one (that wait is recorded as its slot_wait and is part of its schedule lag)."""
        slots = asyncio.Semaphore(concurrency) if concurrency else None
        blocked: collections.deque[tuple[float, float]] = collections.deque()  # spans the loop waited for a slot
        blocked_s = 0.0  # their total
        start = self.clock.now()
        try:
            for spec, offset in zip(specs, offsets):
                due = start + offset
                await self.clock.sleep_until(due)
                if slots is not None:
                    if slots.locked():
                        before = self.clock.now()
                        await slots.acquire()
                        blocked.append((before, self.clock.now()))
                        blocked_s += blocked[-1][1] - before
                    else:
                        await slots.acquire()
                # A request due while the loop was held up by an earlier request's slot wait waited for a slot
                # too, even if one was free when the loop reached it: its slot wait is every blocked span since
                # it was due. Due times only grow, so spans that ended before it are done with; of the rest (one
                # after another), only the first can have begun before it.
                while blocked and blocked[0][1] <= due:
                    begin, end = blocked.popleft()
                    blocked_s -= end - begin
                wait = blocked_s - max(0.0, due - blocked[0][0]) if blocked else 0.0
                task = self._spawn(self._one(spec, due, wait))
                if slots is not None:
                    task.add_done_callback(lambda _: slots.release())
        except asyncio.CancelledError:
            await self._cancel_inflight()
            raise
        await self._settle()

    async def closed_sessions(self, sessions: Iterable, users: int, play: Callable,
                              deadline: float | None = None) -> None:
        """`users` simulated users, each playing its next session as soon as its previous one ends; with a
        deadline, no session starts after it."""
        queue = iter(sessions)

        async def user() -> None:
            while deadline is None or self.clock.now() < deadline:
                if cancel_requested():
                    raise asyncio.CancelledError
                session = next(queue, None)
                if session is None:
                    return
                await play(session, self.clock.now())

        for _ in range(users):
            self._spawn(user())
        await self._settle()

    async def open_sessions(self, sessions: Iterable, offsets: list[float], play: Callable) -> None:
        """Session i starts at start + offsets[i]; its turns then follow one another."""
        start = self.clock.now()
        try:
            for session, offset in zip(sessions, offsets):
                due = start + offset
                await self.clock.sleep_until(due)
                self._spawn(play(session, due))
        except asyncio.CancelledError:
            await self._cancel_inflight()
            raise
        await self._settle()
