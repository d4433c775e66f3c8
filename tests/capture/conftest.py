"""Recording stand-ins for the profiler endpoints of vLLM and SGLang, served from a background thread."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

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


def _bearer_ok(request, key: str | None) -> bool:
    if key is None:
        return True
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and token == key


def _write_trace(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": []}, f)


@dataclass
class StandIn:
    """What a peer server answers, and everything it received."""

    flavour: str
    received: list[Received] = field(default_factory=list)
    profiling: bool = False
    url: str = ""

    def profile_calls(self) -> list[Received]:
        return [r for r in self.received if r.path.endswith("_profile")]

    @web.middleware
    async def _record(self, request, handler):
        body = await request.read()
        self.received.append(Received(request.method, request.path, body, request.content_type))
        return await handler(request)


@dataclass
class VllmStandIn(StandIn):
    """vLLM's profiler routes as vLLM 0.33.0 serves them:
    - vllm/entrypoints/serve/profile/api_router.py: the routes exist only with --profiler-config (404 otherwise);
      POST /start_profile takes an optional StartProfileRequest body (extra="ignore", strict=True: profile_prefix
      str, delay_iterations int, max_iterations int, profiler_kwargs dict) and answers an empty 200;
      POST /stop_profile always answers an empty 200, also with nothing running.
    - vllm/entrypoints/serve/exception_handling/handlers/validation.py: a body that fails validation is a 400
      ErrorResponse; vllm/exceptions.py ProfilerAlreadyActiveError: a second start is a 409 ErrorResponse.
    - vllm/config/profiler.py validate_profile_prefix / validate_profile_iteration_bounds: 400 on a bad prefix or
      a negative bound.
    - vllm/v1/worker/gpu_worker.py + torch's tensorboard_trace_handler: each rank writes
      {prefix_}dp0_pp0_tp0_dcp0_ep0_rank{r}.{ns}.pt.trace.json.gz (the number is time.time_ns()); with `cpu`, as
      vLLM 0.32.0's CPU worker does (vllm/distributed/utils.py get_worker_rank_suffix's fallback),
      {prefix_}rank{r}.{ns}.pt.trace.json.gz; vllm/v1/engine/async_llm.py: the API server writes
      {prefix_}{host}_{pid}.async_llm.{ns}.pt.trace.json.gz (CPU only) into the same torch_profiler_dir.
    - vllm/entrypoints/serve/instrumentator/basic.py: GET /version; /start_profile is not behind --api-key
      (middleware/authenticate.py guards /v1 only).
    `version` gives older routes as those releases' api_router.py has them: 0.32.0's StartProfileRequest lacks
    profiler_kwargs (so ignores it, extra="ignore"); 0.31.0's /start_profile reads no body at all."""

    profiler_configured: bool = True
    version: str = "0.33.0"
    trace_dir: Path | None = None
    tp_size: int = 1
    cpu: bool = False
    session: dict | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/version", self._version)
        app.router.add_get("/v1/models", self._models)
        if self.profiler_configured:
            app.router.add_post("/start_profile", self._start)
            app.router.add_post("/stop_profile", self._stop)
        return app

    async def _version(self, request):
        return web.json_response({"version": self.version})

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "Qwen/Qwen3-0.6B", "object": "model",
                                                               "owned_by": "vllm"}]})

    @staticmethod
    def _error(status: int, phrase: str, message: str, param: str | None = None):
        return web.json_response({"error": {"message": message, "type": phrase, "param": param, "code": status}},
                                 status=status)

    async def _start(self, request):
        overrides = {}
        raw = await request.read()
        release = tuple(int(x) for x in self.version.split(".")[:2])
        if raw and release >= (0, 32):
            try:
                body = json.loads(raw)
            except ValueError:
                return self._error(400, "Bad Request", "1 validation error: JSON decode error", "body")
            if body is not None:
                if not isinstance(body, dict):
                    return self._error(400, "Bad Request", "1 validation error: not an object", "body")
                types = {"profile_prefix": str, "delay_iterations": int, "max_iterations": int}
                if release >= (0, 33):
                    types["profiler_kwargs"] = dict
                for key, kind in types.items():
                    value = body.get(key)
                    if value is None:
                        continue
                    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                        return self._error(400, "Bad Request",
                                           f"1 validation error: {{'type': '{kind.__name__}_type'}}", f"body.{key}")
                    overrides[key] = value
        if self.profiling:
            return self._error(409, "Conflict", "A profiling session is already active. Call /stop_profile "
                                                "before starting another session.")
        prefix = overrides.get("profile_prefix")
        if prefix is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", prefix):
            return self._error(400, "Bad Request", "profile_prefix must be 1-128 ASCII characters, start with a "
                                                   "letter or number, and contain only letters, numbers, '.', "
                                                   "'_', or '-'")
        for key in ("delay_iterations", "max_iterations"):
            if overrides.get(key, 0) < 0:
                return self._error(400, "Bad Request", f"{key} must be greater than or equal to 0")
        self.profiling = True
        self.session = overrides
        return web.Response(status=200)

    async def _stop(self, request):
        if self.profiling and self.trace_dir is not None:
            prefix = (self.session or {}).get("profile_prefix")
            lead = f"{prefix}_" if prefix else ""
            ns = time.time_ns()
            for rank in range(self.tp_size):
                suffix = f"rank{rank}" if self.cpu else f"dp0_pp0_tp{rank}_dcp0_ep0_rank{rank}"
                _write_trace(self.trace_dir / f"{lead}{suffix}.{ns}.pt.trace.json.gz")
            _write_trace(self.trace_dir / f"{lead}{socket.gethostname()}_4242.async_llm.{ns}.pt.trace.json.gz")
        self.profiling = False
        return web.Response(status=200)


@dataclass
class SglangStandIn(StandIn):
    """SGLang's profiler routes as SGLang 0.5.23 serves them:
    - sglang/srt/entrypoints/http_server.py: /start_profile and /stop_profile take GET or POST, the start an
      optional ProfileReq body; success is a plain-text 200 ("Start profiling.\n", "Stop profiling. This will take
      some time.\n"); a failed ProfileReqOutput becomes a RuntimeError, i.e. a bare 500 "Internal Server Error".
    - sglang/srt/managers/scheduler_components/profiler_manager.py: "already in progress" and "not in progress"
      are such failures; num_steps stops the capture by itself; output_dir defaults to
      SGLANG_TORCH_PROFILER_DIR or /tmp and is created only at stop (an unwritable one raises in the scheduler and
      the server goes down, as does activities ["RPD"] on a CUDA build); files are
      [prefix-]{id}-TP-t[-EXTEND|-DECODE].trace.json.gz, plus merged-{id}.trace.json.gz with merge_profiles.
    - sglang/srt/utils/auth.py: with --api-key / --admin-api-key the profiler routes (ADMIN_OPTIONAL) and
      /server_info want `Authorization: Bearer`, answering 401 {"error": "Unauthorized"} otherwise.
    `step_s` is the time one engine step takes, for the self-stop after num_steps."""

    api_key: str | None = None
    step_s: float = 0.01
    down: bool = False
    session: dict | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record, self._auth])
        app.router.add_get("/server_info", self._info)
        app.router.add_get("/get_server_info", self._info)
        for method in ("GET", "POST"):
            app.router.add_route(method, "/start_profile", self._start)
            app.router.add_route(method, "/stop_profile", self._stop)
        return app

    @web.middleware
    async def _auth(self, request, handler):
        if self.down:  # the process is gone: the connection drops without an answer
            request.transport.close()
            return web.Response(status=502)
        if not _bearer_ok(request, self.api_key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _info(self, request):
        return web.json_response({"model_path": "Qwen/Qwen3-0.6B", "tp_size": 1, "device": "cuda",
                                  "version": "0.5.23", "frontend": "python"})

    @staticmethod
    def _failed():
        return web.Response(status=500, text="Internal Server Error")

    async def _start(self, request):
        raw = await request.read()
        body = json.loads(raw) if raw else {}
        if self.profiling:
            return self._failed()
        if "RPD" in (body.get("activities") or []):
            self.down = True  # rpdTracerControl is not importable on a CUDA build: the scheduler dies
            return self._failed()
        body.setdefault("profile_id", str(time.time()))
        self.session = body
        self.profiling = True
        if body.get("num_steps"):
            asyncio.get_running_loop().call_later(self.step_s * (body["num_steps"] + 1), self._finish)
        return web.Response(text="Start profiling.\n")

    async def _stop(self, request):
        if not self.profiling:
            return self._failed()
        if not self._finish():
            return self._failed()
        return web.Response(text="Stop profiling. This will take some time.\n")

    def _finish(self) -> bool:
        """The scheduler's _stop_profile: make the directory, write each stage's trace."""
        if not self.profiling:
            return True
        body = self.session
        out = Path(body.get("output_dir") or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp"))
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError:
            self.down = True
            return False
        lead = f"{body['profile_prefix']}-" if body.get("profile_prefix") else ""
        stages = ["-EXTEND", "-DECODE"] if body.get("profile_by_stage") else [""]
        for stage in stages:
            _write_trace(out / f"{lead}{body['profile_id']}-TP-0{stage}.trace.json.gz")
        if body.get("merge_profiles"):
            _write_trace(out / f"merged-{body['profile_id']}.trace.json.gz")
        self.profiling = False
        return True


def _served(stand_in):
    with serve_in_thread(stand_in.app()) as url:
        stand_in.url = url
        yield stand_in


@pytest.fixture
def vllm_server(tmp_path):
    yield from _served(VllmStandIn("vllm", trace_dir=tmp_path / "vllm-traces"))


@pytest.fixture
def vllm_old_server():
    yield from _served(VllmStandIn("vllm", version="0.31.0"))


@pytest.fixture
def vllm_031_cpu_server(tmp_path):
    yield from _served(VllmStandIn("vllm", version="0.31.0", cpu=True, trace_dir=tmp_path / "vllm-traces"))


@pytest.fixture
def vllm_032_server(tmp_path):
    yield from _served(VllmStandIn("vllm", version="0.32.0", cpu=True, trace_dir=tmp_path / "vllm-traces"))


@pytest.fixture
def vllm_server_without_profiler():
    yield from _served(VllmStandIn("vllm", profiler_configured=False))


@pytest.fixture
def sglang_server():
    yield from _served(SglangStandIn("sglang"))


@pytest.fixture
def sglang_server_with_key():
    yield from _served(SglangStandIn("sglang", api_key="sk-test"))


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Capture records between --start and --stop live in the cache: one per test."""
    monkeypatch.setenv("INFERTRACE_CACHE", str(tmp_path / "cache"))


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
