"""A stand-in OpenAI-compatible server on loopback, in a background thread, whose faults the tests choose."""

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from aiohttp import web


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class ThreadedServer:
    """A stand-in HTTP server on its own event loop in a thread, on a free port: `with Server() as s:` gives
    `s.url`; a subclass says what it serves in `make_app`."""

    def __init__(self) -> None:
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def make_app(self) -> web.Application:
        raise NotImplementedError

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.make_app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    def start(self):
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class StandInServer(ThreadedServer):
    """Streams max_tokens chunks of one token each with continuous usage; `mode(i)` picks request i's fate:
    "ok", "500" (an HTTP error), "close" (the connection drops halfway) or "nan-usage" (NaN token counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = lambda i: "ok"
        self.token_delay = 0.0
        self.first_token_delay = 0.0  # a fixed prefill time before the first token
        self.slots: asyncio.Semaphore | None = None  # set_slots(n): at most n requests generate at once, the rest
        # queue inside the server (a server whose capacity is n streams)
        self.no_usage = False  # stream without any usage, as servers that ignore stream_options do
        self.burst = False  # write a whole stream in one call, so the client reads its events in one go
        self.count = 0
        self.streams: list[tuple[float, float]] = []  # (arrival, end) of each generation request
        self.arrivals: list[float] = []  # perf_counter time each generation request reached the handler
        self.profile_calls: list[tuple[str, float, object]] = []
        self.usage_completion_tokens = 0
        self.calls: list[tuple[str, str | None, str | None]] = []  # (path, Authorization, X-Team) of every call
        self.serve_metrics = False  # GET /metrics in vLLM 0.33's names (vllm/v1/metrics/loggers.py), else 404
        self.active = 0
        self.peers: set = set()  # client (host, port) of every generation request: one per connection used
        self.request_ids: list[tuple[str, float]] = []  # (X-Request-Id, arrival) of every generation request
        # GET /v1/request_log: None answers 404 (no log); else an async function of (server, since, limit,
        # request) that returns the web.Response the test chooses
        self.request_log = None
        self.log_reads: list[str] = []  # the query string of every GET /v1/request_log

    async def generate(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        self.arrivals.append(arrived)
        self.request_ids.append((request.headers.get("X-Request-Id"), arrived))
        body = await request.json()
        i, self.count = self.count, self.count + 1
        self.peers.add(request.transport.get_extra_info("peername"))
        mode = self.mode(i)
        if mode == "500":
            return web.json_response({"error": {"message": "overloaded"}}, status=500)
        chat = "messages" in body
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.active += 1
        try:
            if self.slots is None:
                return await self._stream(request, resp, body, chat, mode, arrived)
            async with self.slots:
                return await self._stream(request, resp, body, chat, mode, arrived)
        finally:
            self.active -= 1

    def set_slots(self, n: int) -> None:
        """At most `n` streams generate at once (made on the server's own loop)."""
        async def make():
            self.slots = asyncio.Semaphore(n)
        asyncio.run_coroutine_threadsafe(make(), self._loop).result(10)

    async def _stream(self, request, resp, body, chat, mode, arrived):
        n = body["max_tokens"]
        held: list[bytes] = []

        async def send(data: bytes) -> None:
            if self.burst:
                held.append(data)
            else:
                await resp.write(data)

        if self.first_token_delay:
            await asyncio.sleep(self.first_token_delay)
        for k in range(n):
            if mode == "close" and k == n // 2:
                request.transport.close()
                return resp
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            finish = "length" if k == n - 1 else None
            choice = {"index": 0, "delta": {"content": f" t{k}"}} if chat else {"index": 0, "text": f" t{k}"}
            count = float("nan") if mode == "nan-usage" else k + 1
            usage = None if self.no_usage else {"prompt_tokens": 5, "completion_tokens": count}
            await send(_sse({"choices": [{**choice, "finish_reason": finish}], "usage": usage}))
        if not self.no_usage:
            await send(_sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}}))
        await send(b"data: [DONE]\n\n")
        if held:
            await resp.write(b"".join(held))
        self.usage_completion_tokens += n
        self.streams.append((arrived, time.perf_counter()))
        return resp

    async def metrics(self, request):
        if not self.serve_metrics:
            raise web.HTTPNotFound()
        labels = 'engine="0",model_name="stand-in"'
        text = (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} {self.active}\n"
                f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{labels}}} 0\n"
                f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{labels}}} {self.active / 100}\n"
                f"# TYPE vllm:generation_tokens_total counter\n"  # as prometheus_client writes a counter
                f"vllm:generation_tokens_total{{{labels}}} {self.usage_completion_tokens}\n")
        return web.Response(text=text, content_type="text/plain")

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    async def server_info(self, request):
        return web.json_response({"engine": "stand-in", "gpu": None})

    async def start_profile(self, request):
        body = await request.json() if request.can_read_body else None
        self.profile_calls.append(("start", time.perf_counter(), body))
        return web.json_response({"status": "started"})

    async def stop_profile(self, request):
        self.profile_calls.append(("stop", time.perf_counter(), None))
        return web.json_response({"status": "stopped", "files": ["/p/a.pt.trace.json.gz", "/p/manifest.json"],
                                  "trace_files": ["/p/a.pt.trace.json.gz"]})

    async def read_request_log(self, request):
        self.log_reads.append(request.query_string)
        if self.request_log is None:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        return await self.request_log(self, int(request.query.get("since", 0)), int(request.query.get("limit", 10**9)),
                                      request)

    @web.middleware
    async def _record(self, request, handler):
        self.calls.append((request.path, request.headers.get("Authorization"), request.headers.get("X-Team")))
        return await handler(request)

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/start_profile", self.start_profile)
        app.router.add_post("/stop_profile", self.stop_profile)
        app.router.add_get("/v1/request_log", self.read_request_log)
        return app


@pytest.fixture
def standin():
    server = StandInServer().start()
    yield server
    server.stop()


@pytest.fixture
def prompts_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}", "max_tokens": 4 + i % 3}) + "\n" for i in range(6)))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served_tiny(tiny_model_dir, tmp_path):
    """`infertrace serve` on the tiny model (random weights) in a subprocess, with KV room for a whole trace replay
    (no eviction)."""
    with serve_subprocess(tiny_model_dir, tmp_path) as url:
        yield url


@contextlib.contextmanager
def serve_subprocess(model_dir, tmp_path, *args: str, env: dict | None = None):
    """`infertrace serve --model model_dir ARGS` in a subprocess (with `env` added to ours), its URL once /health
    answers; stopped on exit."""
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "infertrace", "serve", "--model", str(model_dir), "--port",
                             str(port), "--kv-cache-tokens", "131072", *args], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
