"""Run the server until SIGTERM/SIGINT, then drain: stop listening, let in-flight requests finish within the grace
time, abort the rest, close connections. A second signal aborts at once.

`run_split` is `infertrace serve`: the engine in a process of its own, this process as the first HTTP front end,
and with --api-server-count N, N-1 more front-end processes on the same port (SO_REUSEPORT), each with its own
socket to the engine. Start-up, readiness and death of those processes are handled here and nowhere else: each
child answers a handshake (the engine's first message, a front end's "listening"), each is watched through its
process sentinel or socket, and each ends when this process does.
`run_in_process` keeps the engine on a thread of this process (--engine-in-process), for A/B measurement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from aiohttp import web

from infertrace.exits import BAD_INPUT, FAILURE
from infertrace.server.engine_link.client import (
    EngineStartError,
    ProcessEngine,
    ThreadEngine,
)
from infertrace.server.engine_link.process import (
    EngineSpec,
    describe_exit,
    max_silence_from_env,
    start_engine_process,
)
from infertrace.server.frontend.app import STATE, build_app
from infertrace.server.settings import ServerSettings

log = logging.getLogger("infertrace.server")
FRONTEND_START_TIMEOUT_S = 120.0
ENGINE_EXIT_TIMEOUT_S = 30.0


class EngineFailure(RuntimeError):
    """The engine process could not start, or died while serving, or a front end died: the server exits non-zero,
    `exit_code` (BAD_INPUT where what the engine was given is why it could not start)."""

    def __init__(self, message: str, exit_code: int = FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


async def serve_until_signal(app: web.Application, host: str, port: int,
                             on_listening: Callable[[str], None] | None = None,
                             on_draining: Callable[[int], None] | None = None,
                             reuse_port: bool = False,
                             on_signal: Callable[[int], None] | None = None,
                             stop: asyncio.Event | None = None) -> int:
    """Serve `app` on host:port (0 picks a free port) until a signal, the engine's death or `stop` is set (then it
    drains as on a signal); returns how many requests were aborted. `on_signal(n)` hears of the n-th signal (1:
    drain, told once `on_draining` has the requests in flight on every front end; 2: abort at once)."""
    state = app[STATE]
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, access_log=None,
                           shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    if on_listening is not None:
        bound_host, bound_port = runner.addresses[0][:2]
        on_listening(f"http://{bound_host}:{bound_port}")

    loop = asyncio.get_running_loop()
    stop, abort_now = stop or asyncio.Event(), asyncio.Event()
    state.engine.on_death(stop.set)

    signals: list[int] = []

    def signalled() -> None:
        second = stop.is_set()
        (abort_now if second else stop).set()
        signals.append(2 if second else 1)
        if second and on_signal is not None:
            on_signal(2)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled)
    try:
        if state.engine.error is None:
            await stop.wait()
        await site.stop()  # no new connections; kept-alive ones get 503 while draining
        if on_draining is not None:  # counted before the others hear of the signal and begin their own drains
            on_draining(await state.in_flight_everywhere())
        if signals and on_signal is not None:
            on_signal(1)
        grace = 0.0 if state.engine.error is not None else state.settings.drain_timeout_s
        aborted = await state.drain(grace, abort_now)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
    return aborted


def check_port_free(host: str, port: int) -> None:
    """Bind host:port as the server will (SO_REUSEADDR, as asyncio's listeners set it) and let it go; OSError when
    another socket listens there. Port 0 is always free. SO_REUSEPORT is left off, so that a port held by another
    server's SO_REUSEPORT listeners counts as taken, not shared."""
    if port == 0:
        return
    for family, kind, proto, _, address in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)


# ----- --engine-in-process -----
async def run_in_process(engine, settings: ServerSettings, engine_config: dict,
                         on_listening: Callable[[str], None] | None = None,
                         on_draining: Callable[[int], None] | None = None) -> int:
    """Start the engine thread over `engine`, serve until a signal, drain, stop the engine."""
    from infertrace.server.frontend.tokenizer import FrontendTokenizer

    handle = ThreadEngine(engine, settings.profile_dir, engine_config)
    await handle.connect()
    try:
        app = build_app(handle, FrontendTokenizer(settings.model_dir), settings,
                        {"index": 0, "count": 1, "engine_in_process": True})
        return await serve_until_signal(app, settings.host, settings.port, on_listening, on_draining)
    finally:
        await handle.close()


# ----- the engine in its own process -----
async def run_split(settings: ServerSettings, spec: EngineSpec, api_servers: int = 1,
                    on_ready: Callable[[dict], None] | None = None,
                    on_listening: Callable[[str], None] | None = None,
                    on_draining: Callable[[int], None] | None = None) -> int:
    """Serve with the engine in its own process and `api_servers` front ends; returns how many requests were
    aborted. EngineFailure when the engine could not start or died."""
    from infertrace.server.frontend.tokenizer import FrontendTokenizer

    proc, socks = start_engine_process(spec, api_servers)
    engine = ProcessEngine(socks[0], describe_exit=lambda: describe_exit(proc))
    ready = False
    children: list[multiprocessing.Process] = []
    reports: list = []  # each other front end's pipe: "listening", then how many requests its drain aborted
    signalled: list[int] = []  # signals forwarded to the other front ends
    stop = asyncio.Event()
    lost: list[str] = []  # a front end that exited while serving: the server drains and exits non-zero
    watch: list[asyncio.Task] = []
    try:
        try:
            tokenizer = await asyncio.to_thread(FrontendTokenizer, settings.model_dir)  # while the engine loads
        except Exception as e:  # a broken tokenizer.json: one line, not a traceback
            raise EngineFailure(f"cannot load the tokenizer of {settings.model_dir}: {e}") from None
        try:
            await engine.connect()
        except EngineStartError as e:
            raise EngineFailure(str(e), BAD_INPUT if e.bad_input else FAILURE) from None
        ready = True
        if on_ready is not None:
            on_ready(engine.info)
        app = build_app(engine, tokenizer, settings, {"index": 0, "count": api_servers, "engine_in_process": False})

        def listening(url: str) -> None:
            port = int(url.rsplit(":", 1)[1])
            children.extend(_start_frontends(replace(settings, port=port), socks[1:], api_servers, reports))
            for sock in socks[1:]:
                sock.close()  # the children hold them now
            if children:
                watch.append(asyncio.create_task(_watch_frontends(children, frontend_exited)))
            if on_listening is not None:
                on_listening(url)

        def frontend_exited(why: str, code: int | None) -> None:
            if not signalled and not stop.is_set():  # not an exit our own shutdown asked for
                log.error("%s; draining and stopping the server", why)
                lost.append(why)
                stop.set()
            elif code != 0:  # killed or failed while draining: its clients' connections ended with it
                log.error("%s while the server stopped; the engine aborted the requests it had", why)

        def forward(n: int) -> None:
            signalled.append(n)
            for child in children:
                with contextlib.suppress(OSError):
                    os.kill(child.pid, signal.SIGTERM)

        aborted = await serve_until_signal(app, settings.host, settings.port, listening, on_draining,
                                           reuse_port=api_servers > 1, on_signal=forward, stop=stop)
        await _stop_children(children, settings.drain_timeout_s, signal_them=not signalled)
        aborted += _aborted_by(reports)
        if engine.error is not None:
            raise EngineFailure(str(engine.error))
        if lost:
            raise EngineFailure(lost[0])
        return aborted
    finally:
        stop.set()  # from here on the front ends' exits are ours
        await _stop_children(children, settings.drain_timeout_s, signal_them=not signalled)
        for task in watch:  # the children are gone: each watch has ended
            await task
        await engine.close()  # the engine aborts what is left and exits once every front end is gone
        if not ready and proc.exitcode is None:
            proc.kill()  # stopped (Ctrl-C) or failed while the model loaded: nothing of it is worth waiting for
        await _reap(proc)


async def _watch_frontends(children: list[multiprocessing.Process],
                           exited: Callable[[str, int | None], None]) -> None:
    """Tell `exited` how each of the other front ends ended, in words and its exit code, as each ends (the
    shutdown's own exits included: the caller tells them apart)."""
    left = list(children)
    while left:
        ended = await asyncio.to_thread(multiprocessing.connection.wait, [c.sentinel for c in left])
        for child in [c for c in left if c.sentinel in ended]:
            left.remove(child)
            await asyncio.to_thread(child.join, 1.0)
            code = child.exitcode
            how = f"exited with code {code}"
            if code is not None and code < 0:
                known = -code in signal.valid_signals()
                how = f"was killed by {signal.Signals(-code).name}" if known else f"was killed by signal {-code}"
            exited(f"front end {child.name} (pid {child.pid}) {how}", code)


def _aborted_by(reports: list) -> int:
    """How many requests the other front ends' drains aborted, as each told on its pipe before it exited."""
    total = 0
    for conn in reports:
        with contextlib.suppress(EOFError, OSError):
            while conn.poll():
                message = conn.recv()
                if isinstance(message, tuple) and message[0] == "aborted":
                    total += message[1]
    return total


def _start_frontends(settings: ServerSettings, socks: list[socket.socket], count: int, reports: list) -> list:
    """Front ends 1..count-1, each with its socket to the engine; returns once each listens (or fails). Each one's
    pipe goes on `reports`."""
    if not socks:
        return []
    ctx = multiprocessing.get_context("spawn")
    started = []
    for index, sock in enumerate(socks, start=1):
        ours, theirs = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=frontend_main, args=(settings, sock, index, count, theirs),
                           name=f"infertrace-frontend{index}", daemon=True)
        proc.start()
        theirs.close()
        started.append((proc, ours))
    for proc, conn in started:
        ready = multiprocessing.connection.wait([conn, proc.sentinel], FRONTEND_START_TIMEOUT_S)
        message = conn.recv() if conn in ready and conn.poll() else None
        if message != "listening":
            for p, _ in started:
                p.kill()
            reason = message or ("it exited" if proc.sentinel in ready else "it did not answer")
            raise EngineFailure(f"front end {proc.name} did not start: {reason}")
    reports.extend(conn for _, conn in started)
    return [proc for proc, _ in started]


def frontend_main(settings: ServerSettings, sock: socket.socket, index: int, count: int, conn) -> None:
    """A front-end process after the first: serve on the shared port until SIGTERM (sent by the first front end),
    then drain. SIGINT is left to the first front end, which forwards it."""
    import sys

    from infertrace.engine.worker import exit_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    sys.exit(asyncio.run(_frontend(settings, sock, index, count, conn)))


async def _frontend(settings: ServerSettings, sock: socket.socket, index: int, count: int, conn) -> int:
    from infertrace.server.frontend.tokenizer import FrontendTokenizer

    engine = ProcessEngine(sock)
    try:
        tokenizer = FrontendTokenizer(settings.model_dir)
        await engine.connect()
        app = build_app(engine, tokenizer, settings, {"index": index, "count": count, "engine_in_process": False})
        aborted = await serve_until_signal(app, settings.host, settings.port, lambda url: conn.send("listening"),
                                           reuse_port=True)
        with contextlib.suppress(OSError):
            conn.send(("aborted", aborted))
    except Exception as e:
        with contextlib.suppress(OSError):
            conn.send(f"{type(e).__name__}: {e}")
        return 1
    finally:
        await engine.close()
    return 1 if engine.error is not None else 0


async def _stop_children(children: list, grace_s: float, signal_them: bool) -> None:
    """Wait for the other front ends to drain (SIGTERM, unless they had it already), then kill what is left."""
    sentinels = [c.sentinel for c in children if c.exitcode is None]
    if not sentinels:  # wait() on nothing would sleep out its whole timeout
        return
    for c in children:
        if signal_them and c.exitcode is None:
            with contextlib.suppress(OSError):
                os.kill(c.pid, signal.SIGTERM)
    await asyncio.to_thread(multiprocessing.connection.wait, sentinels, grace_s + 10.0)
    for c in children:
        if c.exitcode is None:
            c.kill()
        await asyncio.to_thread(c.join, 5.0)


async def _reap(proc: multiprocessing.Process) -> None:
    """Wait for the engine process to finish its shutdown; kill it past ENGINE_EXIT_TIMEOUT_S."""
    await asyncio.to_thread(proc.join, ENGINE_EXIT_TIMEOUT_S)
    if proc.exitcode is None:
        log.error("the engine process did not exit within %gs; killing it", ENGINE_EXIT_TIMEOUT_S)
        proc.kill()
        await asyncio.to_thread(proc.join, 5.0)


def engine_spec(settings: ServerSettings, config: Any) -> EngineSpec:
    import dataclasses

    try:
        max_silence_s = max_silence_from_env()
    except ValueError as e:
        raise EngineFailure(str(e)) from None
    return EngineSpec(model_dir=settings.model_dir, config=dataclasses.asdict(config),
                      profile_dir=str(settings.profile_dir) if settings.profile_dir else None,
                      max_silence_s=max_silence_s)
