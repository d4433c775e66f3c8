"""asyncio façade over the engine: one background thread owns the engine and runs its step loop.

Every engine call happens in that thread, between two steps; requests, aborts and arbitrary calls reach it through
a thread-safe command queue, and token deltas come back to the event loop through per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from infertrace.engine.config import EngineConfig
from infertrace.engine.engine import Engine
from infertrace.engine.outputs import EngineDeadError, OutputStream, RequestOutput, StepStats, put_all
from infertrace.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError"]
log = logging.getLogger("infertrace.engine")


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, OutputStream] = {}  # touched only by the engine thread
        self._callbacks: list[Callable[[StepStats], None]] = []
        self._stats_lock = threading.Lock()
        self._stats: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._snapshot()

    @classmethod
    def from_model(cls, model_dir: str | Path, config: EngineConfig | None = None) -> AsyncEngine:
        return cls(Engine(model_dir, config))

    # ----- lifecycle -----
    async def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="infertrace-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, abort_running: bool = True) -> None:
        """Stop the engine thread: abort what runs, or let it finish first."""
        if self._thread is None:
            return
        if self._thread.is_alive():
            if self._error is None:
                self._stopping = True
                self._put(("stop", abort_running, None))
            # else the loop failed and is ending on its own: only wait for it
            await asyncio.to_thread(self._thread.join)
        self._thread = None

    # ----- requests -----
    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until one is finished; closing the generator early aborts the request."""
        await self.start()
        stream = OutputStream()
        try:
            await self._request(("add", request_id, prompt, params or SamplingParams(), stream))
        except asyncio.CancelledError:
            self._put(("abort", request_id, None))  # it may have been added already
            raise
        try:
            async for item in stream.drain():
                yield item
        finally:
            if not stream.finished and self._thread is not None:
                self._put(("abort", request_id, None))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its KV blocks are free when this returns and its stream ends with finish_reason 'abort'."""
        await self._request(("abort", request_id))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` in the engine thread between two steps and return its result."""
        return await self._request(("call", fn))

    def add_step_callback(self, callback: Callable[[StepStats], None]) -> None:
        """`callback(stats)` runs in the engine thread after every step; keep it short."""
        self._callbacks.append(callback)

    def stats(self) -> dict[str, Any]:
        """A snapshot taken after the latest step: running, waiting, KV blocks used/total, counters."""
        with self._stats_lock:
            return {**self._stats, "counters": dict(self._stats["counters"])}

    # ----- plumbing (event-loop side) -----
    async def _request(self, command: tuple) -> Any:
        await self.start()
        future = self._loop.create_future()
        self._put((*command, future))
        return await future

    def _put(self, command: tuple) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._error!r}") from self._error
        if self._stopping and command[0] == "add":
            raise EngineDeadError("the engine is shutting down")
        self._commands.put(command)
        self._wake.set()

    # ----- engine thread -----
    def _run(self) -> None:
        engine = self.engine
        stop: tuple | None = None
        while True:
            try:
                self._wake.clear()  # set again by any command put from here on, which the drain may not see
                stop = self._drain(stop)
                if stop is not None and not engine.has_unfinished():
                    self._resolve(stop[2], None)
                    return
                if not engine.has_unfinished():
                    self._wake.wait()
                    continue
                # with a step in flight, new requests are taken until the next must be planned (pace.py)
                delay = engine.plan_delay()
                if delay > 0 and self._wake.wait(delay):
                    continue
                steps = engine.counters["steps"]
                outputs = engine.step()
                # stats and callbacks first: whoever sees an output also sees the step that produced it
                self._snapshot()
                if engine.counters["steps"] != steps:
                    for callback in self._callbacks:
                        callback(engine.last_step)
                self._deliver(*outputs)
            except BaseException as exc:  # the loop must never die silently: every waiter hears of it
                log.exception("the engine loop failed")  # once, here: its waiters each get a one-line error
                self._error = exc
                for stream in self._streams.values():
                    self._post(stream.put, EngineDeadError(f"the engine loop stopped: {exc!r}"))
                self._streams.clear()
                self._fail_pending(exc)
                return

    def _drain(self, stop: tuple | None) -> tuple | None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return stop
            kind, *args, future = command
            if kind == "stop":
                stop = command
                if args[0]:
                    finals = [self.engine.abort(request_id) for request_id in self.engine.unfinished_request_ids()]
                    self._snapshot()
                    self._deliver(*(final for final in finals if final is not None))
                continue
            failed = False
            try:
                if kind == "add":
                    request_id, prompt, params, stream = args
                    self.engine.add_request(request_id, prompt, params)
                    self._streams[request_id] = stream
                    result = None
                elif kind == "abort":
                    result = self._abort(args[0])
                else:
                    result = args[0]()
            except Exception as exc:
                result, failed = exc, True
            self._snapshot()
            self._resolve(future, result, failed)

    def _abort(self, request_id: str) -> None:
        final = self.engine.abort(request_id)
        self._snapshot()
        if final is not None:
            self._deliver(final)

    def _deliver(self, *outputs: RequestOutput) -> None:
        """Hand outputs to their streams in one call into the event loop: one cross-thread wake-up a step instead of
        one a request, which at hundreds of running requests is most of what the event loop is woken for."""
        handoff = []
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                handoff.append((stream, out))
        if handoff:
            self._post(put_all, handoff)

    def _resolve(self, future: asyncio.Future | None, value: Any, failed: bool = False) -> None:
        if future is None:
            return

        def settle() -> None:
            if not future.done():
                future.set_exception(value) if failed else future.set_result(value)

        self._post(settle)

    def _fail_pending(self, exc: BaseException) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._resolve(command[-1], EngineDeadError(f"the engine loop stopped: {exc!r}"), failed=True)

    def _post(self, fn: Callable, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop is closed: nobody is waiting any more

    def _snapshot(self) -> None:
        e = self.engine
        snap = {
            "running": e.num_running,
            "waiting": e.num_waiting,
            "kv_blocks_used": e.kv_blocks_used,
            "kv_blocks_total": e.kv_blocks_total,
            "counters": dict(e.counters),
            "last_step": dataclasses.asdict(e.last_step) if e.last_step is not None else None,
        }
        with self._stats_lock:
            self._stats = snap

