"""The parent side of a run spread over load workers: Runner-shaped calls partitioned into slices, run by local
processes or Ray actors, whose records are merged back onto the parent's clock, so the metrics come from the code
that exists."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable

from infertrace.load.records import RequestResult, RequestSpec
from infertrace.load.run import local_launcher, ray_launcher
from infertrace.load.run.worker import (
    Batch,
    Slice,
    closed_slices,
    open_slices,
    session_slices,
    unreported,
)
from infertrace.load.workloads.conversation import SessionDriver

WORKER_FILES = ("schemas_path", "image_dir", "tokenizer")  # config fields naming files a worker reads itself


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
        self.lost: list[str] = []  # one line for each worker that ended without its final batch
        self._reported: dict[int, list[RequestResult]] = {}  # each worker's records, to know what a lost one owed
        self._origin: float | None = None
        self._nodes: int | None = None

    @property
    def workers(self) -> int:
        """Every worker of the run: --workers, on each node of the Ray cluster with --ray."""
        if self.ray_address is None:
            return self.cfg.workers
        if self._nodes is None:
            self._nodes = len(ray_launcher.node_ids(self.ray_address))
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
            await local_launcher.run_local(self, parts)
            return
        await ray_launcher.run_on_ray(self, parts)

    def worker_json(self) -> dict:
        """The config every worker opens its own target from: with the headers (which `to_json` leaves out of
        result files), and the files a worker reads itself by absolute path, since a Ray actor's working directory
        is not this process's (on another node the file must be at that path too)."""
        data = self.cfg.to_json() | {"headers": dict(self.cfg.headers)}
        for key in WORKER_FILES:
            if data.get(key):
                data[key] = os.path.abspath(data[key])
        return data

    def barrier(self, lead_s: float) -> float:
        """Set the start `lead_s` from now; its wall-clock time for the workers."""
        self._origin = self.clock.now() + lead_s  # the barrier on the parent's clock
        return time.time() + lead_s

    def take(self, batch: Batch, worker: int | None = None) -> None:
        for r in batch.results:
            r.scheduled += self._origin
            r.t0 += self._origin
            r.end += self._origin
            self.results.append(r)
            self.on_result(r)
        if worker is not None:
            self._reported.setdefault(worker, []).extend(batch.results)
        if batch.done:
            self.cpu_s += batch.cpu_s
            self.cpu_busiest_s = max(self.cpu_busiest_s, batch.cpu_s)
            self.start_skew_s.append(batch.start_skew_s)

    def lose(self, worker: int, of: int, part: Slice, how: str, pid: int | None = None) -> None:
        """Worker `worker` (of `of`) ended without its final batch (`how`: its exit code or signal): every request
        of its slice it never reported becomes a failure that names it, so the run's counts add up."""
        now = self.clock.now()
        error = f"load worker {worker + 1} lost: {how}"
        missing = unreported(part, self._reported.get(worker, []))
        for index, offset, session, turn in missing:
            scheduled = now if offset is None or self._origin is None else min(now, self._origin + offset)
            r = RequestResult(index, scheduled, now, now, error=error, session=session, turn=turn)
            self.results.append(r)
            self.on_result(r)
        unknown = part.sessions is None and (part.cycle or part.deadline_s is not None)
        owed = "the requests it had in flight are not known" if unknown else \
            f"{len(missing)} request(s) of its slice never reported count as failed"
        self.lost.append(f"load worker {worker + 1} of {of}{f' (pid {pid})' if pid else ''} {how}: {owed}")

    def figures(self) -> dict:
        return {"workers": self.workers, "ray_address": self.ray_address, "ray_nodes": self._nodes,
                "worker_start_skew_max_ms": 1000 * max(self.start_skew_s, default=0.0),
                "worker_clock_offsets_ms": [1000 * o for o in self.clock_offsets_s] or None,
                "lost_workers": self.lost or None}


def _record_sessions(play, results: list[RequestResult]) -> None:
    """The parent's session driver never played: give it the outcomes the workers' drivers had."""
    driver = getattr(play, "__self__", None)
    if isinstance(driver, SessionDriver):
        driver.record(results)
