"""`infertrace profile` against recording stand-ins of vLLM and SGLang: exact paths and bodies, and faults."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from infertrace.cli import main

DETECTION = [("GET", "/server_info"), ("GET", "/get_server_info"), ("GET", "/version")]


def invoke(*args):
    return CliRunner().invoke(main, ["profile", *args])


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("Error")]


def replying(response_factory):
    """An async aiohttp handler returning what `response_factory()` builds."""

    async def handler(request):
        return response_factory()

    return handler


def calls(stand_in):
    return [(r.method, r.path, r.body) for r in stand_in.received]


# vLLM ----------------------------------------------------------------------------------------------------

def test_vllm_detected_then_bare_start(vllm_server):
    result = invoke("--url", vllm_server.url, "--start")
    assert result.exit_code == 0, result.output
    assert [(m, p) for m, p, _ in calls(vllm_server)] == DETECTION + [("POST", "/start_profile")]
    assert calls(vllm_server)[-1][2] == b""  # vLLM takes no body
    assert "vllm profiler started" in result.stderr


def test_vllm_stop_with_flavour_given_sends_only_the_stop(vllm_server):
    result = invoke("--url", vllm_server.url, "--server", "vllm", "--stop")
    assert result.exit_code == 0, result.output
    assert calls(vllm_server) == [("POST", "/stop_profile", b"")]
    assert "torch_profiler_dir" in result.stderr  # where vLLM put the traces
    assert result.stdout == ""


def test_vllm_seconds_window(vllm_server):
    result = invoke("--url", vllm_server.url, "--server", "vllm", "--seconds", "0.2")
    assert result.exit_code == 0, result.output
    assert calls(vllm_server) == [("POST", "/start_profile", b""), ("POST", "/stop_profile", b"")]
    assert not vllm_server.profiling


def test_vllm_404_explains_missing_profiler_config(vllm_server_without_profiler):
    result = invoke("--url", vllm_server_without_profiler.url, "--start")
    assert result.exit_code == 1
    lines = error_lines(result)
    assert len(lines) == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "404" in lines[0] and "without a profiler configuration" in lines[0]
    assert "--profiler-config" in lines[0] and "VLLM_TORCH_PROFILER_DIR" in lines[0]


def test_vllm_refuses_options_it_cannot_take(vllm_server):
    result = invoke("--url", vllm_server.url, "--server", "vllm", "--start", "--num-steps", "5")
    assert result.exit_code == 2
    assert "vLLM takes no capture options over HTTP (num_steps)" in result.output
    assert calls(vllm_server) == []


# SGLang --------------------------------------------------------------------------------------------------

def test_sglang_detected_and_full_body(sglang_server):
    result = invoke("--url", sglang_server.url, "--start", "--output-dir", "/tmp/sgl", "--num-steps", "8",
                    "--activities", "cpu,GPU", "--with-stack", "--record-shapes")
    assert result.exit_code == 0, result.output
    assert [(m, p) for m, p, _ in calls(sglang_server)] == [("GET", "/server_info"), ("GET", "/get_server_info"),
                                                           ("POST", "/start_profile")]
    start = sglang_server.received[-1]
    assert start.content_type == "application/json"
    assert start.json() == {"output_dir": "/tmp/sgl", "num_steps": 8, "activities": ["CPU", "GPU"],
                            "with_stack": True, "record_shapes": True}
    assert "stops by itself after 8 steps" in result.stderr


def test_sglang_body_carries_only_what_was_given(sglang_server):
    result = invoke("--url", sglang_server.url, "--server", "sglang", "--start", "--no-with-stack")
    assert result.exit_code == 0, result.output
    assert len(sglang_server.received) == 1
    assert sglang_server.received[0].json() == {"with_stack": False}


def test_sglang_cuda_profiler_activity(sglang_server):
    result = invoke("--url", sglang_server.url, "--server", "sglang", "--start", "--activities", "CUDA_PROFILER")
    assert result.exit_code == 0, result.output
    assert sglang_server.received[0].json() == {"activities": ["CUDA_PROFILER"]}


def test_sglang_seconds_window(sglang_server):
    result = invoke("--url", sglang_server.url, "--server", "sglang", "--seconds", "0.1", "--activities", "GPU")
    assert result.exit_code == 0, result.output
    assert [(r.method, r.path) for r in sglang_server.received] == [("POST", "/start_profile"),
                                                                    ("POST", "/stop_profile")]
    assert sglang_server.received[0].json() == {"activities": ["GPU"]}
    assert sglang_server.received[1].body == b""
    assert "SGLANG_TORCH_PROFILER_DIR" in result.stderr


def test_sglang_stop_without_start_is_one_line(sglang_server):
    result = invoke("--url", sglang_server.url, "--stop")
    assert result.exit_code == 1
    assert error_lines(result) == [
        "Error: sglang server refused POST /stop_profile (HTTP 500): Internal Server Error"]


def test_sglang_unwritable_output_dir_is_one_line(sglang_server):
    result = invoke("--url", sglang_server.url, "--start", "--output-dir", "/proc/traces")
    assert result.exit_code == 1
    assert len(error_lines(result)) == 1 and "HTTP 500" in result.stderr


# detection, usage and faults ----------------------------------------------------------------------------

def test_server_down_is_one_line(dead_url):
    for args in (["--start"], ["--stop"], ["--seconds", "1"], ["--server", "sglang", "--start"]):
        result = invoke("--url", dead_url, *args)
        assert result.exit_code == 1, args
        assert error_lines(result) == [f"Error: cannot reach the server at {dead_url}: Connection refused"]


def test_unknown_server_asks_for_flavour(serve_app):
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/health", replying(lambda: web.Response()))
    with serve_app(app) as url:
        result = invoke("--url", url, "--start")
    assert result.exit_code == 1
    assert len(error_lines(result)) == 1 and "pass --server vllm|sglang|infertrace" in result.stderr


@pytest.mark.parametrize("info, flavour", [
    ({"engine": "infertrace", "engine_config": {}}, "infertrace"),
    ({"name": "infertrace"}, "infertrace"),
    ({"vllm_config": "..."}, "vllm"),
    ({"model_path": "m", "tp_size": 1, "version": "0.5"}, "sglang"),
])
def test_detection_from_server_info(serve_app, info, flavour):
    from aiohttp import web

    received = []

    async def start(request):
        received.append(await request.read())
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/server_info", replying(lambda: web.json_response(info)))
    app.router.add_post("/start_profile", start)
    with serve_app(app) as url:
        result = invoke("--url", url, "--start")
    assert result.exit_code == 0, result.output
    assert f"{flavour} profiler started" in result.stderr
    assert received == [b""] if flavour == "vllm" else [b"{}"]


def test_infertrace_stop_lists_traces_on_stdout(serve_app):
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/server_info", replying(lambda: web.json_response({"engine": "infertrace"})))
    app.router.add_post("/stop_profile", replying(lambda: web.json_response(
        {"message": "stopped", "traces": ["/p/a.pt.trace.json.gz", "/p/a.manifest.json"]})))
    with serve_app(app) as url:
        result = invoke("--url", url, "--stop")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["/p/a.pt.trace.json.gz", "/p/a.manifest.json"]


def test_openai_style_error_message_is_shown(serve_app):
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/stop_profile", replying(lambda: web.json_response(
        {"error": {"message": "no capture in progress", "type": "invalid_request_error"}}, status=409)))
    with serve_app(app) as url:
        result = invoke("--url", url, "--server", "infertrace", "--stop")
    assert result.exit_code == 1
    assert error_lines(result) == [
        "Error: infertrace server refused POST /stop_profile (HTTP 409): no capture in progress"]


@pytest.mark.parametrize("args, message", [
    ([], "choose exactly one of"),
    (["--start", "--stop"], "choose exactly one of"),
    (["--start"], "--start needs --url"),
    (["--url", "http://x", "--seconds", "1", "--num-steps", "2"], "either --seconds or --num-steps"),
    (["--url", "http://x", "--start", "--activities", "CPU,TPU"], "unknown activity 'TPU'"),
    (["--url", "http://x", "--start", "bench"], "only taken with --nsys"),
    (["--url", "http://x", "--stop", "--num-steps", "2"], "--num-steps applies when a capture starts"),
    (["--url", "http://x", "--start", "--dry-run"], "--dry-run only goes with --nsys"),
    (["--url", "http://x", "--start", "--activities", " , "], "--activities is empty"),
])
def test_usage_errors(args, message):
    result = invoke(*args)
    assert result.exit_code == 2
    assert message in result.output


def test_bad_url_is_one_line():
    result = invoke("--url", "not a url", "--server", "sglang", "--start")
    assert result.exit_code == 1
    assert len(error_lines(result)) == 1


def test_client_library_returns_traces(serve_app):
    import asyncio

    from aiohttp import web

    from infertrace.capture.client import Flavour, ProfileOptions, ProfilerClient

    bodies = []

    async def start(request):
        bodies.append(json.loads(await request.read()))
        return web.json_response({"message": "profiling started"})

    app = web.Application()
    app.router.add_get("/server_info", replying(lambda: web.json_response({"engine": "infertrace"})))
    app.router.add_post("/start_profile", start)
    app.router.add_post("/stop_profile", replying(
        lambda: web.json_response({"trace_files": ["t.pt.trace.json.gz"]})))

    async def scenario(url):
        async with ProfilerClient(url) as client:
            assert await client.flavour() is Flavour.INFERTRACE
            message = await client.start(ProfileOptions(num_steps=3, activities=("CPU",)))
            return message, await client.stop()

    with serve_app(app) as url:
        message, stopped = asyncio.run(scenario(url))
    assert message == "profiling started"
    assert stopped.traces == ["t.pt.trace.json.gz"]
    assert bodies == [{"num_steps": 3, "activities": ["CPU"]}]
