"""Load from several processes or hosts: one worker function over a slice of the schedule, and two thin ways of
starting it (local processes, Ray actors).

The schedule is computed once, in the parent, and partitioned: an open loop's arrivals (and a trace's) go to
workers in turn with their times unchanged, a closed loop's concurrency is split, sessions go whole. Every worker
starts at one barrier (local workers: set once every one of them is ready, so a slow start-up costs no
measured time), times its own requests on its own clock (as seconds since that barrier, so clocks of
different hosts are never compared), and streams its records back in batches; the parent merges them into the
records a single-process run keeps, and the metrics come from the code that exists.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from infertrace.load.clock import MonotonicClock
from infertrace.load.conversation import Session, SessionDriver
from infertrace.load.records import RequestResult, RequestSpec

BATCH_S = 0.1  # a worker sends what finished at most this often: one message per batch, not per request
BARRIER_LEAD_S = 1.0  # Ray: the start is set this far ahead, so that every worker is waiting when it comes
START_LEAD_S = 0.05  # local workers: the start, once all are ready, is this far ahead (a pipe write to each)


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


# ----- partitioning -----
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


# ----- the worker -----
async def run_slice(cfg_json: dict, part: Slice, start_at: float | None, emit: Callable[[Batch], None],
                    stop: asyncio.Event, wait_start: Callable[[], Awaitable[float]] | None = None) -> None:
    """Send `part` against the configured target from `start_at` (wall clock; or the time `wait_start` returns
    once the target is open) and emit every record, its times in seconds since this worker's own start."""
    from infertrace.load.benchmark import make_target
    from infertrace.load.config import BenchConfig
    from infertrace.load.runner import Runner, measured_gc

    cfg = BenchConfig(**_config_fields(cfg_json))
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


def _config_fields(cfg_json: dict) -> dict:
    from infertrace.load.config import BenchConfig

    names = {f.name for f in dataclasses.fields(BenchConfig)}
    out = {k: v for k, v in cfg_json.items() if k in names}
    for key in ("request_rate",):
        if out.get(key) == "inf":
            out[key] = math.inf
    out["sweep_values"] = tuple(out.get("sweep_values") or ())
    out.update(workers=1, sweep_param=None, sweep_values=(), profile=False, profile_steps=None,
               profile_seconds=None, result_json=None, requests_jsonl=None, plot=None, report=None,
               find_max=None, scrape_interval_s=0.0)
    return out


def _process_main(conn, cfg_json: dict, part: Slice) -> None:
    """A local worker process: say it is ready, run the slice from the start the parent sends, stream batches
    down `conn`, stop when the parent says so."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which tells every worker

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        start = loop.create_future()

        def message() -> None:
            msg = conn.recv_bytes()
            if msg.startswith(b"start ") and not start.done():
                start.set_result(float(msg[6:]))
                return
            stop.set()  # "stop", even before the start: the worker then ends as soon as it begins
            if not start.done():
                start.set_result(time.time())

        def emit(batch: Batch) -> None:
            conn.send_bytes(msgspec.msgpack.encode(batch))

        async def wait_start() -> float:
            emit(Batch([], ready=True))
            return await start

        loop.add_reader(conn.fileno(), message)
        await run_slice(cfg_json, part, None, emit, stop, wait_start)

    asyncio.run(main())


# ----- the parent side -----
class Fleet:
    """Runner-shaped: the same open_loop / closed_loop / open_sessions / closed_sessions calls as Runner, each
    partitioned over `workers` worker processes (or Ray actors with `ray_address`); results land in `results`
    on the parent's clock, aligned at the start barrier."""

    def __init__(self, cfg, clock, on_result: Callable[[RequestResult], None] | None = None,
                 ray_address: str | None = None) -> None:
        self.cfg = cfg
        self.clock = clock
        self.on_result = on_result or (lambda r: None)
        self.ray_address = ray_address
        self.results: list[RequestResult] = []
        self.cpu_s = 0.0  # every worker's CPU seconds, summed
        self.cpu_busiest_s = 0.0  # the busiest worker's: the one a per-core limit applies to
        self.start_skew_s: list[float] = []
        self.clock_offsets_s: list[float] = []  # Ray: each actor's clock against the driver's
        self._origin: float | None = None
        self._nodes: int | None = None

    @property
    def workers(self) -> int:
        """Every worker of the run: --workers, on each node of the Ray cluster with --ray."""
        if self.ray_address is None:
            return self.cfg.workers
        if self._nodes is None:
            from infertrace.load.ray_launcher import node_ids

            self._nodes = len(node_ids(self.ray_address))
        return self.cfg.workers * self._nodes

    @property
    def cpu_window(self) -> tuple[float, float] | None:
        """(the busiest worker's CPU seconds, every worker's summed), each over its own window: a worker is one
        process, so the first is what bench's per-core headroom check reads, the second what the run cost."""
        return (self.cpu_busiest_s, self.cpu_s) if self.results else None

    async def send(self, spec: RequestSpec, scheduled: float, slot_wait: float = 0.0) -> RequestResult:
        """Runner's single-request path, which a session driver is built over; a fleet's sessions are played by
        drivers in its workers, so the parent's driver never sends."""
        raise RuntimeError("the sessions of a multi-worker run are played by its workers")

    async def open_loop(self, specs, offsets: list[float], concurrency: int | None = None) -> None:
        specs = list(itertools.islice(specs, len(offsets)))  # an open loop's specs may be an endless cycle
        await self._run(open_slices(specs, list(offsets), self.workers, concurrency))

    async def closed_loop(self, specs, concurrency: int, deadline: float | None = None) -> None:
        cycle = not isinstance(specs, list)
        base = getattr(specs, "base", None) if cycle else specs
        deadline_s = deadline - self.clock.now() if deadline is not None else None
        await self._run(closed_slices(list(base), concurrency, self.workers, cycle, deadline_s))

    async def open_sessions(self, sessions, offsets: list[float], play) -> None:
        await self._run(session_slices(list(sessions), self.workers, list(offsets), None,
                                       self.cfg.think_time_s, None))
        _record_sessions(play, self.results)

    async def closed_sessions(self, sessions, users: int, play, deadline: float | None = None) -> None:
        deadline_s = deadline - self.clock.now() if deadline is not None else None
        await self._run(session_slices(list(sessions), self.workers, None, users, self.cfg.think_time_s,
                                       deadline_s))
        _record_sessions(play, self.results)

    async def _run(self, parts: list[Slice]) -> None:
        if self.ray_address is None:
            await _local_workers(self, parts)
            return
        await _ray_workers(self, parts, self.barrier(BARRIER_LEAD_S))

    def barrier(self, lead_s: float) -> float:
        """Set the start `lead_s` from now; its wall-clock time for the workers."""
        self._origin = self.clock.now() + lead_s  # the barrier on the parent's clock
        return time.time() + lead_s

    def take(self, batch: Batch) -> None:
        for r in batch.results:
            r.scheduled += self._origin
            r.t0 += self._origin
            r.end += self._origin
            self.results.append(r)
            self.on_result(r)
        if batch.done:
            self.cpu_s += batch.cpu_s
            self.cpu_busiest_s = max(self.cpu_busiest_s, batch.cpu_s)
            self.start_skew_s.append(batch.start_skew_s)

    def figures(self) -> dict:
        return {"workers": self.workers, "ray_address": self.ray_address, "ray_nodes": self._nodes,
                "worker_start_skew_max_ms": 1000 * max(self.start_skew_s, default=0.0),
                "worker_clock_offsets_ms": [1000 * o for o in self.clock_offsets_s] or None}


def _record_sessions(play, results: list[RequestResult]) -> None:
    """The parent's session driver never played: give it the outcomes the workers' drivers had."""
    driver = getattr(play, "__self__", None)
    if isinstance(driver, SessionDriver):
        driver.record(results)


async def _local_workers(fleet: Fleet, parts: list[Slice]) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    cfg_json = fleet.cfg.to_json()
    cfg_json["headers"] = dict(fleet.cfg.headers)
    procs, conns = [], []
    for part in parts:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_process_main, args=(child, cfg_json, part), daemon=True,
                           name="infertrace-load")
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    loop = asyncio.get_running_loop()
    open_conns = set(range(len(conns)))
    waiting = set(open_conns)  # not ready yet
    finished = asyncio.Event()
    decoder = msgspec.msgpack.Decoder(Batch)

    def start_when_ready(k: int) -> None:
        """The start barrier, once every worker still alive is ready (a worker that died waits for nothing)."""
        if k not in waiting:
            return
        waiting.discard(k)
        if not waiting:
            start_at = fleet.barrier(START_LEAD_S)
            for j in open_conns:
                try:
                    conns[j].send_bytes(b"start %r" % start_at)
                except OSError:
                    pass

    def readable(k: int) -> None:
        try:
            batch = decoder.decode(conns[k].recv_bytes())
        except (EOFError, OSError):
            batch = Batch([], True)
        if batch.ready:
            start_when_ready(k)
            return
        fleet.take(batch)
        if batch.done:
            loop.remove_reader(conns[k].fileno())
            open_conns.discard(k)
            start_when_ready(k)
            if not open_conns:
                finished.set()

    for k, conn in enumerate(conns):
        loop.add_reader(conn.fileno(), readable, k)
    try:
        await finished.wait()
    except asyncio.CancelledError:  # Ctrl-C: every worker stops, sends what it measured, and the parent keeps it
        for k in list(open_conns):
            try:
                conns[k].send_bytes(b"stop")
            except OSError:
                pass
        deadline = time.monotonic() + 30
        while open_conns and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        raise
    finally:
        for k in list(open_conns):
            loop.remove_reader(conns[k].fileno())
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        for conn in conns:
            conn.close()


async def _ray_workers(fleet: Fleet, parts: list[Slice], start_at: float) -> None:
    from infertrace.load.ray_launcher import run_on_ray

    await run_on_ray(fleet, parts, start_at)


def resolve_workers(value: str | int) -> int:
    """`--workers N` or `auto` (the cores less one, at least one)."""
    if value in ("auto", None):
        return max(1, (os.cpu_count() or 2) - 1)
    n = int(value)
    if n < 1:
        raise ValueError(f"--workers must be at least 1 or auto, got {value}")
    return n

