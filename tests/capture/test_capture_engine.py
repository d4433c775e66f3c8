"""Capture of the bundled engine: in-process over its steps, and through `infertrace serve` end to end."""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import json
import re
import socket
import threading
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from infertrace.capture.torch_capture import CaptureSession
from infertrace.cli import main

try:
    from infertrace.engine import Engine, EngineConfig, SamplingParams
except ImportError:  # the engine is optional to these tests
    Engine = None
try:
    from infertrace.server.frontend.app import build_app
    from infertrace.server.settings import ServerSettings
except ImportError:
    build_app = None

needs_engine = pytest.mark.skipif(Engine is None, reason="infertrace.engine is not importable")
needs_server = pytest.mark.skipif(Engine is None or build_app is None, reason="infertrace.server is not importable")

ENGINE_CONFIG = {"kv_cache_tokens": 2048, "max_model_len": 512, "max_num_batched_tokens": 256}


def trace_names(path: Path) -> list[str]:
    with gzip.open(path, "rt") as f:
        return [e.get("name", "") for e in json.load(f)["traceEvents"]]


@needs_engine
def test_capture_window_over_engine_steps(tiny_model_dir, tmp_path):
    engine = Engine(tiny_model_dir, EngineConfig(**ENGINE_CONFIG))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"req-{i}", [10 + i] * 20, params)
    engine.step()  # the prefill runs before the window
    session = CaptureSession(tmp_path, activities=("CPU", "GPU"), num_steps=3, label="engine")
    session.start()
    seen = 0
    while engine.has_unfinished():
        outputs = engine.step()
        seen += 1
        session.add_request_ids(out.request_id for out in outputs)
        if session.on_step(engine.last_step):
            break
    trace, manifest_path = session.stop()
    assert seen == 3

    names = [re.sub(r" #\d+\]$", "]", n) for n in trace_names(trace)]  # without the step numbers
    assert names.count("step[DECODE bs=3]") == 3
    for inner in ("schedule", "prepare_inputs", "forward", "sample"):
        assert inner in names
    manifest = json.loads(manifest_path.read_text())
    assert [(s["kind"], s["bs"], s["toks"]) for s in manifest["steps"]] == [("decode", 3, 3)] * 3
    assert [s["index"] for s in manifest["steps"]] == [1, 2, 3]
    assert sorted(manifest["request_ids"]) == ["req-0", "req-1", "req-2"]


class ServerThread:
    """`infertrace serve`'s application on the tiny model, in a background event loop."""

    def __init__(self, model_dir: Path, profile_dir: Path):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.runner = None
        self.aeng = None
        self._call(self._start(model_dir, profile_dir))

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    async def _start(self, model_dir, profile_dir):
        from aiohttp import web

        from infertrace.server.engine_link.client import ProcessEngine
        from infertrace.server.engine_link.process import EngineSpec, start_engine_process
        from infertrace.server.frontend.tokenizer import FrontendTokenizer

        config = EngineConfig(**ENGINE_CONFIG)
        # as `infertrace serve` runs it: the engine in a process of its own
        self.proc, [sock] = start_engine_process(EngineSpec(str(model_dir), dataclasses.asdict(config),
                                                            str(profile_dir)))
        self.aeng = ProcessEngine(sock)
        await self.aeng.connect()
        settings = ServerSettings(model_dir=str(model_dir), served_model_name="tiny", profile_dir=profile_dir)
        self.runner = web.AppRunner(build_app(self.aeng, FrontendTokenizer(model_dir), settings))
        await self.runner.setup()
        await web.SockSite(self.runner, self.sock).start()

    async def _stop(self):
        from infertrace.server.engine_link.runner import _reap

        await self.runner.cleanup()
        await self.aeng.close()
        await _reap(self.proc)

    def close(self):
        self._call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    def complete(self, max_tokens=4) -> dict:
        body = json.dumps({"model": "tiny", "prompt": [11] * 12, "max_tokens": max_tokens, "ignore_eos": True})
        request = urllib.request.Request(self.url + "/v1/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    profile_dir = tmp_path_factory.mktemp("profiles")
    server = ServerThread(tiny_model_dir, profile_dir)
    yield server, profile_dir
    server.close()


def invoke(*args):
    return CliRunner().invoke(main, ["profile", *args])


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith(("error", "infertrace profile: error:"))]


@needs_server
def test_serve_start_request_stop(served):
    server, profile_dir = served
    started = invoke("--url", server.url, "--start", "--output-dir", "run1", "--activities", "CPU")
    assert started.exit_code == 0, started.output
    assert "infertrace profiler started" in started.stderr
    assert server.complete()["usage"]["completion_tokens"] == 4
    stopped = invoke("--url", server.url, "--stop")
    assert stopped.exit_code == 0, stopped.output
    files = [Path(p) for p in stopped.stdout.split()]
    traces = [p for p in files if p.name.endswith(".pt.trace.json.gz")]
    assert len(traces) == 1 and traces[0].parent == (profile_dir / "run1").resolve()
    names = [re.sub(r" #\d+\]$", "]", n) for n in trace_names(traces[0])]  # without the step numbers
    assert any(n.startswith("step[PREFILL bs=1") for n in names)
    assert "step[DECODE bs=1]" in names
    manifest = json.loads(next(p for p in files if p.name.endswith(".manifest.json")).read_text())
    assert manifest["trace"] == traces[0].name and len(manifest["steps"]) >= 4


@needs_server
def test_serve_frontend_trace_through_the_cli(served):
    server, profile_dir = served
    started = invoke("--url", server.url, "--start", "--frontend", "--output-dir", "run-fe", "--activities", "CPU")
    assert started.exit_code == 0, started.output
    server.complete()
    stopped = invoke("--url", server.url, "--stop")
    assert stopped.exit_code == 0, stopped.output
    files = [Path(p) for p in stopped.stdout.split()]
    [front] = [p for p in files if p.name.startswith("frontend0-")]
    assert front.parent == (profile_dir / "run-fe").resolve()
    assert json.loads(front.read_text())["traceEvents"]
    refused = invoke("--url", server.url, "--server", "vllm", "--start", "--frontend")
    assert refused.exit_code != 0 and "--frontend is infertrace serve's" in refused.output


@needs_server
def test_serve_num_steps_window_stops_by_itself(served):
    server, _ = served
    started = invoke("--url", server.url, "--server", "infertrace", "--start", "--num-steps", "2",
                     "--output-dir", "run2", "--activities", "CPU")
    assert started.exit_code == 0, started.output
    server.complete(max_tokens=6)
    stopped = invoke("--url", server.url, "--stop")
    assert stopped.exit_code == 0, stopped.output
    manifest_path = next(Path(p) for p in stopped.stdout.split() if p.endswith(".manifest.json"))
    assert len(json.loads(manifest_path.read_text())["steps"]) == 2


@needs_server
def test_serve_seconds_window(served):
    server, _ = served
    result = invoke("--url", server.url, "--seconds", "0.2", "--activities", "CPU", "--output-dir", "run3")
    assert result.exit_code == 0, result.output
    assert any(p.endswith(".pt.trace.json.gz") for p in result.stdout.split())


@needs_server
def test_serve_faults_are_one_line(served):
    server, profile_dir = served
    stop = invoke("--url", server.url, "--stop")
    assert stop.exit_code == 1 and len(error_lines(stop)) == 1
    assert "no capture is running" in stop.stderr
    escape = invoke("--url", server.url, "--start", "--output-dir", "/etc/infertrace")
    assert escape.exit_code == 1 and len(error_lines(escape)) == 1
    assert "outside the server's profile directory" in escape.stderr
    (profile_dir / "blocker").write_text("")
    blocked = invoke("--url", server.url, "--start", "--output-dir", "blocker/traces")
    assert blocked.exit_code == 1 and len(error_lines(blocked)) == 1
    assert "cannot write traces to" in blocked.stderr
    again = invoke("--url", server.url, "--stop")  # the refused start left nothing running
    assert again.exit_code == 1 and "no capture is running" in again.stderr
