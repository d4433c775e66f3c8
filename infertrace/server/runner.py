"""Run the server until SIGTERM/SIGINT, then drain: stop listening, let in-flight requests finish within the grace
time, abort the rest, close connections. A second signal aborts at once."""

from __future__ import annotations

import asyncio
import signal
from typing import Callable

from aiohttp import web

from infertrace.server.app import STATE, build_app
from infertrace.server.settings import ServerSettings


async def serve_until_signal(app: web.Application, host: str, port: int,
                             on_listening: Callable[[str], None] | None = None,
                             on_draining: Callable[[int], None] | None = None) -> int:
    """Serve `app` on host:port (0 picks a free port) until a signal; returns how many requests were aborted."""
    state = app[STATE]
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, access_log=None,
                           shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    if on_listening is not None:
        bound_host, bound_port = runner.addresses[0][:2]
        on_listening(f"http://{bound_host}:{bound_port}")

    loop = asyncio.get_running_loop()
    stop, abort_now = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (abort_now if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await stop.wait()
        await site.stop()  # no new connections; kept-alive ones get 503 while draining
        if on_draining is not None:
            on_draining(len(state.in_flight))
        aborted = await state.drain(state.settings.drain_timeout_s, abort_now)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
    return aborted


async def run_server(engine, settings: ServerSettings, engine_config: dict,
                     on_listening: Callable[[str], None] | None = None,
                     on_draining: Callable[[int], None] | None = None) -> int:
    """Start the engine thread over `engine`, serve until a signal, drain, stop the engine."""
    from infertrace.engine import AsyncEngine

    aeng = AsyncEngine(engine)
    await aeng.start()
    try:
        app = build_app(aeng, engine, settings, engine_config)
        return await serve_until_signal(app, settings.host, settings.port, on_listening, on_draining)
    finally:
        await aeng.shutdown(abort_running=True)
        await asyncio.to_thread(engine.shutdown)  # tensor-parallel ranks are processes of their own
