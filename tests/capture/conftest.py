"""Recording stand-ins for the profiler endpoints of vLLM and SGLang, served from a background thread."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
from aiohttp import web


@contextmanager
def serve_in_thread(app: web.Application):
    """Serve `app` on 127.0.0.1 at a random port from its own event loop; yield the base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    runner = web.AppRunner(app)

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=30)

    call(runner.setup())
    call(web.SockSite(runner, sock).start())
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        call(runner.cleanup())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@dataclass
class Received:
    method: str
    path: str
    body: bytes
    content_type: str

    def json(self):
        return json.loads(self.body)


@dataclass
class StandIn:
    """What a peer server answers, and everything it received."""

    flavour: str
    profiler_configured: bool = True  # vLLM mounts the profiler routes only with a profiler config
    received: list[Received] = field(default_factory=list)
    profiling: bool = False
    url: str = ""

    def profile_calls(self) -> list[Received]:
        return [r for r in self.received if r.path.endswith("_profile")]

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        if self.flavour == "vllm":
            app.router.add_get("/version", self._vllm_version)
            if self.profiler_configured:
                app.router.add_post("/start_profile", self._vllm_start)
                app.router.add_post("/stop_profile", self._vllm_stop)
        else:
            app.router.add_get("/get_server_info", self._sglang_info)
            for method in ("GET", "POST"):
                app.router.add_route(method, "/start_profile", self._sglang_start)
                app.router.add_route(method, "/stop_profile", self._sglang_stop)
        return app

    @web.middleware
    async def _record(self, request, handler):
        body = await request.read()
        self.received.append(Received(request.method, request.path, body, request.content_type))
        return await handler(request)

    async def _vllm_version(self, request):
        return web.json_response({"version": "0.11.0"})

    async def _sglang_info(self, request):
        return web.json_response({"model_path": "Qwen/Qwen3-0.6B", "tp_size": 1, "version": "0.5.4"})

    async def _vllm_start(self, request):
        self.profiling = True
        return web.Response(status=200)

    async def _vllm_stop(self, request):
        self.profiling = False
        return web.Response(status=200)

    async def _sglang_start(self, request):
        body = await request.json() if await request.read() else {}
        if str(body.get("output_dir", "")).startswith("/proc/"):
            # SGLang fails creating the directory in its scheduler and the route answers 500
            return web.Response(status=500, text="Internal Server Error")
        self.profiling = True
        return web.Response(text="Start profiling.\n")

    async def _sglang_stop(self, request):
        if not self.profiling:
            return web.Response(status=500, text="Internal Server Error")
        self.profiling = False
        return web.Response(text="Stop profiling. This will take some time.\n")


@pytest.fixture
def vllm_server():
    stand_in = StandIn("vllm")
    with serve_in_thread(stand_in.app()) as url:
        stand_in.url = url
        yield stand_in


@pytest.fixture
def vllm_server_without_profiler():
    stand_in = StandIn("vllm", profiler_configured=False)
    with serve_in_thread(stand_in.app()) as url:
        stand_in.url = url
        yield stand_in


@pytest.fixture
def sglang_server():
    stand_in = StandIn("sglang")
    with serve_in_thread(stand_in.app()) as url:
        stand_in.url = url
        yield stand_in


@pytest.fixture
def dead_url():
    """A URL on which nothing listens."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def serve_app():
    """`with serve_app(app) as url:` serves an aiohttp app from a background thread."""
    return serve_in_thread
