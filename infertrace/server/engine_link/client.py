"""The front end's handle on the engine: `ProcessEngine` talks to the engine process over its socket;
`ThreadEngine` (--engine-in-process) runs the engine on a thread of the server's own process, for A/B measurement.

Both answer the same calls, which is all the request handlers use: `generate`, `abort`, `stats`, `command` (an
engine-side command: ping, metrics, start_profile, stop_profile), `count` (server counters), `info` (the engine's
description), `error` (why it is dead, or None) and `on_death`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from infertrace.engine.outputs import EngineDeadError, OutputStream, put_all
from infertrace.server.engine_link.messages import (
    FrameError,
    FrameReader,
    FromEngine,
    ToEngine,
    decode_from_engine,
    frame,
)
from infertrace.server.frontend.protocol import ApiError

log = logging.getLogger("infertrace.server")
# Seconds between heartbeats to the engine, sent from the event loop: a front end silent for MAX_SILENCE_S
# (process.py, 15 s) is taken for stopped or hung and dropped, so the period leaves a wide margin.
HEARTBEAT_S = 1.0


class RequestRefused(ValueError):
    """The engine refused a request; `field` names the sampling field at fault, when it named one."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class EngineStartError(RuntimeError):
    """The engine process ended before it was ready (the message says why); `bad_input` when what it was given
    (a setting, the model's files) is why."""

    def __init__(self, message: str, bad_input: bool = False) -> None:
        super().__init__(message)
        self.bad_input = bad_input


class ProcessEngine:
    """The engine process, seen from one front end (one socket). Outputs of a step arrive in one message and are
    handed to their requests' queues in one pass."""

    def __init__(self, sock, describe_exit: Callable[[], str] | None = None) -> None:
        self._sock = sock
        self._describe_exit = describe_exit  # how the process ended, when this front end started it
        self._transport: asyncio.Transport | None = None
        self._streams: dict[str, OutputStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._ready: asyncio.Future | None = None
        self._stats: dict[str, Any] = {"running": 0, "waiting": 0}
        self._death_callbacks: list[Callable[[], None]] = []
        self.on_trace_stop: Callable[[str], None] | None = None  # another front end stopped our traced capture
        self.info: dict[str, Any] = {}
        self.error: EngineDeadError | None = None
        self._bad_input = False  # the engine could not start because of what it was given
        self._closing = False
        self._heartbeat: asyncio.TimerHandle | None = None
        self._request_log = True  # whether the engine keeps a request log (from its info): else no stamps go
        self._stamps: list[list] = []  # [request id, times] of requests ended this turn of the event loop
        self._counts: dict[str, int] = {}  # counter updates of this turn of the event loop, not yet sent

    async def connect(self) -> None:
        """Wait for the engine's handshake; EngineStartError if it ended instead."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._transport, _ = await loop.create_unix_connection(lambda: _Link(self), sock=self._sock)
        self._transport.write(frame(ToEngine("hello", args={"pid": os.getpid()})))  # whom to kill if it is dropped
        self._beat()
        try:
            self.info = await self._ready
        except EngineDeadError as e:
            raise EngineStartError(str(e), self._bad_input) from None
        self._request_log = bool((self.info.get("engine_config") or {}).get("request_log_size", True))

    def _beat(self) -> None:
        """Tell the engine this front end is alive, now and every HEARTBEAT_S until it closes or the link dies."""
        if self._closing or self.error is not None or self._transport is None or self._transport.is_closing():
            self._heartbeat = None
            return
        self._transport.write(_BEAT)
        self._heartbeat = asyncio.get_running_loop().call_later(HEARTBEAT_S, self._beat)

    def on_death(self, callback: Callable[[], None]) -> None:
        """`callback()` once, on the event loop, if the engine process dies or its loop fails."""
        self._death_callbacks.append(callback)

    async def close(self) -> None:
        """Tell the engine this front end is done (it aborts whatever of ours still runs)."""
        self._closing = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._transport is not None:
            self._send_held()
            self._transport.close()

    # ----- requests -----
    async def generate(self, request_id: str, prompt: list[int], params: Any) -> AsyncIterator[Any]:
        """Yield the request's outputs until one is finished; closing the generator early aborts the request."""
        stream = OutputStream()
        self._streams[request_id] = stream
        try:
            self._send(ToEngine("add", request_id=request_id, prompt=prompt, params=params))
            async for item in stream.drain():
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished and self.error is None:
                self._send(ToEngine("abort", request_id=request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its KV blocks are free when this returns."""
        await self._call(ToEngine("abort", request_id=request_id))

    def attach_sink(self, request_id: str, sink: Callable[[Any], bool] | None) -> None:
        """While set, each output of the request goes first to `sink(output)`, called as the step's message is
        read; an output it does not take (False) waits for `generate` as usual."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.sink = sink

    def stats(self) -> dict[str, Any]:
        """The running and waiting counts after the latest step this front end heard of."""
        return self._stats

    async def command(self, name: str, args: dict[str, Any] | None = None) -> Any:
        """An engine-side command (EngineServices.command); its ApiError is raised here."""
        return await self._call(ToEngine("call", name=name, args=args or {}))

    def count(self, deltas: dict[str, int]) -> None:
        """Add to the server counters behind /metrics (kept in the engine process, shared by all front ends). Like
        the request log's times, updates never take a write of their own (see `_hold`)."""
        if self.error is not None:
            return
        self._hold()
        counts = self._counts
        for name, delta in deltas.items():
            counts[name] = counts.get(name, 0) + delta

    def stamp(self, request_id: str, times: dict[str, float]) -> None:
        """The front end's times of a request, for the engine's request log (dropped when the engine keeps none)."""
        if self.error is not None or not self._request_log:
            return
        self._hold()
        self._stamps.append([request_id, times])

    def _hold(self) -> None:
        """Counter updates and request times wait: they go in front of the next message this front end sends (a
        request's counted admission rides its "add"), or in one write at the end of this turn of the event loop,
        with everything else held in it (a request's end: its counts and its times)."""
        if not self._stamps and not self._counts:
            asyncio.get_running_loop().call_soon(self._send_held)

    def _send_held(self) -> None:
        if (self._stamps or self._counts) and self.error is None and self._transport is not None \
                and not self._transport.is_closing():
            self._transport.write(self._take_held())

    def _take_held(self) -> bytes:
        data = b""
        if self._counts:
            counts, self._counts = self._counts, {}
            data += frame(ToEngine("count", args=counts))
        if self._stamps:
            stamps, self._stamps = self._stamps, []
            data += frame(ToEngine("stamp", args={"requests": stamps}))
        return data

    # ----- plumbing -----
    async def _call(self, message: ToEngine) -> Any:
        future = asyncio.get_running_loop().create_future()
        message.call_id = next(self._call_ids)
        self._calls[message.call_id] = future
        try:
            self._send(message)
            return await future
        finally:
            self._calls.pop(message.call_id, None)

    def _send(self, message: ToEngine) -> None:
        if self.error is not None:
            raise self._dead()
        data = frame(message)
        if self._stamps or self._counts:  # in the same write, and before it: a read sent now sees them
            data = self._take_held() + data
        self._transport.write(data)

    def _dead(self) -> EngineDeadError:
        """The engine's death for one more waiter: an exception of its own, since one instance raised in many tasks
        gathers every raise's frames into its traceback."""
        return EngineDeadError(str(self.error))

    def _receive(self, msg: FromEngine) -> None:
        kind = msg.kind
        if kind == "step":
            self._stats = msg.stats or self._stats
            streams = self._streams
            put_all((stream, delta) for delta in msg.outputs if (stream := streams.get(delta.request_id)) is not None)
        elif kind == "reply":
            future = self._calls.get(msg.call_id)
            if future is not None and not future.done():
                if msg.error is not None:
                    e = msg.error
                    future.set_exception(ApiError(e.get("status", 500), e.get("message", ""), code=e.get("code"),
                                                  param=e.get("param")))
                else:
                    future.set_result(msg.value)
        elif kind == "refused":
            stream = self._streams.get(msg.request_id)
            if stream is not None:
                stream.finished = True  # never taken, so there is nothing to abort when its generator closes
                error = msg.error or {}
                stream.put(RequestRefused(error.get("message", "the engine refused the request"), error.get("field")))
        elif kind == "trace_stop":
            if self.on_trace_stop is not None:
                self.on_trace_stop((msg.value or {}).get("output_dir"))
        elif kind == "ready":
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg.value)
        elif kind == "dead":
            why = (msg.error or {}).get("message", "no reason given")
            self._bad_input = bool((msg.error or {}).get("bad_input"))
            self._die(why if self._starting() else f"the engine loop failed: {why}")
        elif kind == "dropped":  # this front end fell too far behind: the engine goes on without it
            self._die(f"the engine dropped this front end: {(msg.error or {}).get('message', 'no reason given')}")

    def _starting(self) -> bool:
        return self._ready is not None and not self._ready.done()

    def _die(self, reason: str, process_gone: bool = False) -> None:
        if self.error is not None:
            return
        if process_gone and self._describe_exit is not None:
            reason = f"{reason} ({self._describe_exit()})"
        self.error = EngineDeadError(reason)
        if not self._starting():  # a start that fails is reported once, by whoever started it (EngineStartError)
            log.error("%s", reason)
        for stream in self._streams.values():
            stream.put(self._dead())
        for future in self._calls.values():
            if not future.done():
                future.set_exception(self._dead())
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(self._dead())
        for callback in self._death_callbacks:
            callback()
        if self._transport is not None:
            self._transport.close()


_BEAT = frame(ToEngine("beat"))


class _Link(asyncio.Protocol):
    def __init__(self, engine: ProcessEngine) -> None:
        self.engine = engine
        self.reader = FrameReader()

    def data_received(self, data: bytes) -> None:
        try:
            messages = [decode_from_engine(body) for body in self.reader.feed(data)]
        except (FrameError, ValueError) as e:
            self.engine._die(f"the engine sent a malformed message: {e}")
            return
        for msg in messages:
            self.engine._receive(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.engine._closing:
            self.engine._die("the engine process is gone", process_gone=True)


class ThreadEngine:
    """--engine-in-process: the engine loop on a thread of this process (the server as it was before the split)."""

    def __init__(self, engine: Any, profile_dir: Path | None, engine_config: dict[str, Any]) -> None:
        from infertrace.engine.async_engine import AsyncEngine
        from infertrace.server.engine_link.services import EngineServices

        self.engine = engine
        self.aeng = AsyncEngine(engine)
        self.services = EngineServices(engine, profile_dir, engine_config)
        self.aeng.add_step_callback(self.services.on_step)
        self.info = self.services.info()

    @property
    def error(self) -> BaseException | None:
        return self.aeng._error

    async def connect(self) -> None:
        await self.aeng.start()

    def on_death(self, callback: Callable[[], None]) -> None:
        pass  # the thread's failure fails every request and /health; the process stays up, as it always did

    async def close(self) -> None:
        await self.aeng.shutdown(abort_running=True)
        await asyncio.to_thread(self.engine.shutdown)  # tensor-parallel ranks are processes of their own

    def generate(self, request_id: str, prompt: list[int], params: Any) -> AsyncIterator[Any]:
        return self.aeng.generate(request_id, prompt, params)

    async def abort(self, request_id: str) -> None:
        await self.aeng.abort(request_id)

    def stats(self) -> dict[str, Any]:
        return self.aeng.stats()

    async def command(self, name: str, args: dict[str, Any] | None = None) -> Any:
        return await self.aeng.call(lambda: self.services.command(name, args or {}))

    def count(self, deltas: dict[str, int]) -> None:
        self.services.metrics.count(deltas)

    def stamp(self, request_id: str, times: dict[str, float]) -> None:
        if self.engine.request_log is not None:
            self.engine.request_log.stamp(request_id, times)
