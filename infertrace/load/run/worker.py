"""The load worker: one function over a slice of the schedule, sending it against the configured target from a
start barrier and emitting its records in batches; and how the schedule is cut into slices. Local processes
(local_launcher) and Ray actors (ray_launcher) are two thin ways of starting it; fleet.py is the parent side.

An open loop's arrivals (and a trace's) go to workers in turn with their times unchanged, a closed loop's
concurrency is split, sessions go whole. Every worker times its own requests on its own clock, as seconds since
its start barrier, so clocks of different hosts are never compared.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from infertrace.load.client.targets import make_target
from infertrace.load.clock import MonotonicClock
from infertrace.load.config import BenchConfig
from infertrace.load.records import RequestResult, RequestSpec
from infertrace.load.run.runner import Runner, measured_gc
from infertrace.load.workloads.conversation import Session, SessionDriver

BATCH_S = 0.1  # a worker sends what finished at most this often: one message per batch, not per request


@dataclass(slots=True)
class Slice:
    """One worker's part of the schedule."""

    specs: list[RequestSpec] = field(default_factory=list)
    offsets: list[float] | None = None  # open loop: each spec's send time after the start
    concurrency: int | None = None  # closed loop: this worker's users; open loop: its share of the cap
    cycle: bool = False  # closed loop with --duration: send the specs over and over
    deadline_s: float | None = None  # no send starts later than this after the start
    sessions: list[Session] | None = None
    think_time_s: float = 0.0


class Batch(msgspec.Struct):
    results: list[RequestResult]
    done: bool = False
    cpu_s: float = 0.0  # the worker process's CPU seconds over its window (with done)
    start_skew_s: float = 0.0  # how late after the barrier this worker started
    ready: bool = False  # a local worker's handshake: set up, connected, and waiting for the start


def shares(total: int, n: int) -> list[int]:
    """`total` split into `n` near-equal parts, the larger first."""
    return [total // n + (1 if k < total % n else 0) for k in range(n)]


def open_slices(specs: list[RequestSpec], offsets: list[float], n: int, cap: int | None) -> list[Slice]:
    caps = shares(cap, n) if cap else [None] * n
    return [Slice(specs[k::n], offsets[k::n], caps[k] or None) for k in range(n)]


def closed_slices(specs: list[RequestSpec], concurrency: int, n: int, cycle: bool,
                  deadline_s: float | None) -> list[Slice]:
    users = shares(concurrency, n)
    return [Slice(specs[k::n], None, users[k], cycle, deadline_s) for k in range(n) if users[k] > 0]


def session_slices(sessions: list[Session], n: int, offsets: list[float] | None, users: int | None,
                   think_time_s: float, deadline_s: float | None) -> list[Slice]:
    out = []
    per_worker = shares(users, n) if users else [None] * n
    for k in range(n):
        if users and per_worker[k] == 0:
            continue
        out.append(Slice([], offsets[k::n] if offsets is not None else None, per_worker[k], False, deadline_s,
                         sessions[k::n], think_time_s))
    return out


def unreported(part: Slice, reported: list[RequestResult]) -> list[tuple[int, float | None, int | None, int | None]]:
    """What a worker that was lost owed of `part` and never reported, as (index, offset, session, turn): each spec
    of a finite slice, and the next turn of each session it left unfinished (which ends that session, as a failed
    turn does). A slice sent over and over, or up to a deadline, owes no count that can be known."""
    if part.sessions is not None:
        last: dict[int, int] = {}
        ended = set()
        for r in reported:
            if r.session is None:
                continue
            last[r.session] = max(last.get(r.session, -1), r.turn or 0)
            if r.error is not None:
                ended.add(r.session)
        index = max((r.index for r in reported), default=-1)
        out = []
        for k, session in enumerate(part.sessions):
            turn = last.get(session.index, -1) + 1
            if session.index in ended or turn >= len(session.turns):
                continue
            index += 1
            offset = part.offsets[k] if part.offsets is not None and turn == 0 else None
            out.append((index, offset, session.index, turn))
        return out
    if part.cycle or part.deadline_s is not None:
        return []
    seen = {r.index for r in reported}
    return [(spec.index, part.offsets[k] if part.offsets is not None else None, None, None)
            for k, spec in enumerate(part.specs) if spec.index not in seen]


async def run_slice(cfg_json: dict, part: Slice, start_at: float | None, emit: Callable[[Batch], None],
                    stop: asyncio.Event, wait_start: Callable[[], Awaitable[float]] | None = None) -> None:
    """Send `part` against the configured target from `start_at` (wall clock; or the time `wait_start` returns
    once the target is open) and emit every record, its times in seconds since this worker's own start."""
    cfg = BenchConfig.from_json(cfg_json)
    target = make_target(cfg, lambda _: None)
    await target.open()
    pending: list[RequestResult] = []
    clock = MonotonicClock()
    try:
        if wait_start is not None:
            start_at = await wait_start()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        skew = max(0.0, time.time() - start_at)
        origin = clock.now()
        cpu0 = time.process_time()
        runner = Runner(target, clock, lambda r: pending.append(_relative(r, origin)))
        with measured_gc():
            work = asyncio.ensure_future(_play(part, runner, clock, origin))
            while not work.done():
                stopped = asyncio.ensure_future(stop.wait())
                await asyncio.wait([work, stopped], timeout=BATCH_S, return_when=asyncio.FIRST_COMPLETED)
                if stop.is_set() and not work.done():
                    work.cancel()
                if not stopped.done():
                    stopped.cancel()
                if pending:
                    emit(Batch(pending[:]))
                    pending.clear()
            try:
                await work
            except asyncio.CancelledError:
                pass
        emit(Batch(pending[:], True, time.process_time() - cpu0, skew))
    finally:
        await target.close()


async def _play(part: Slice, runner, clock, origin: float) -> None:
    deadline = origin + part.deadline_s if part.deadline_s is not None else None
    if part.sessions is not None:
        driver = SessionDriver(runner.send, clock, part.think_time_s)
        if part.offsets is not None:
            await runner.open_sessions(part.sessions, part.offsets, driver.play)
        else:
            await runner.closed_sessions(part.sessions, part.concurrency, driver.play, deadline)
    elif part.offsets is not None:
        await runner.open_loop(part.specs, part.offsets, part.concurrency)
    else:
        specs = _cycled(part.specs) if part.cycle else part.specs
        await runner.closed_loop(specs, part.concurrency, deadline)


def _cycled(specs: list[RequestSpec]):
    i = 0
    while True:
        for spec in specs:
            yield dataclasses.replace(spec, index=spec.index + i * 1_000_000)
        i += 1


def _relative(r: RequestResult, origin: float) -> RequestResult:
    r.scheduled -= origin
    r.t0 -= origin
    r.end -= origin
    return r


def resolve_workers(value: str | int) -> int:
    """`--workers N` or `auto` (the cores less one, at least one)."""
    if value in ("auto", None):
        return max(1, (os.cpu_count() or 2) - 1)
    n = int(value)
    if n < 1:
        raise ValueError(f"--workers must be at least 1 or auto, got {value}")
    return n

