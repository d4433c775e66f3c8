"""`infertrace profile` against recording stand-ins of vLLM and SGLang: exact paths and bodies, and faults."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from infertrace.cli import main

DETECTION = [("GET", "/server_info"), ("GET", "/get_server_info"), ("GET", "/version")]


def invoke(*args):
    return CliRunner().invoke(main, ["profile", *args])


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith(("error", "infertrace profile: error:"))]


def replying(response_factory):
    """An async aiohttp handler returning what `response_factory()` builds."""

    async def handler(request):
        return response_factory()

    return handler


def calls(stand_in):
    return [(r.method, r.path, r.body) for r in stand_in.received]


# vLLM ----------------------------------------------------------------------------------------------------

def test_vllm_detected_then_named_start(vllm_server):
    result = invoke("--url", vllm_server.url, "--start")
    assert result.exit_code == 0, result.output
    assert [(m, p) for m, p, _ in calls(vllm_server)] == DETECTION + [("POST", "/start_profile")]
    body = vllm_server.received[-1].json()
    assert list(body) == ["profile_prefix"] and body["profile_prefix"].startswith("infertrace-")
    assert "vllm profiler started" in result.stderr
    assert "_dp*_pp*_tp*_dcp*_ep*_rank*.*.pt.trace.json*" in result.stderr  # the file pattern it will write


def test_vllm_stop_with_flavour_given_sends_only_the_stop(vllm_server):
    result = invoke("--url", vllm_server.url, "--server", "vllm", "--stop")
    assert result.exit_code == 0, result.output
    assert calls(vllm_server) == [("POST", "/stop_profile", b"")]
    assert "torch_profiler_dir" in result.stderr  # where vLLM put the traces
    assert result.stdout == ""


def test_vllm_seconds_window(vllm_server):
    result = invoke("--url", vllm_server.url, "--server", "vllm", "--seconds", "0.2", "--name", "w1")
    assert result.exit_code == 0, result.output
    assert calls(vllm_server) == [("GET", "/version", b""), ("POST", "/start_profile", b'{"profile_prefix": "w1"}'),
                                  ("POST", "/stop_profile", b"")]
    assert not vllm_server.profiling


def test_vllm_404_explains_missing_profiler_config(vllm_server_without_profiler):
    result = invoke("--url", vllm_server_without_profiler.url, "--start")
    assert result.exit_code == 1
    lines = error_lines(result)
    assert len(lines) == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "404" in lines[0] and "without a profiler configuration" in lines[0]
    assert "--profiler-config" in lines[0] and "VLLM_TORCH_PROFILER_DIR" in lines[0]


def test_vllm_options_map_to_its_start_body(vllm_server):
    result = invoke("--url", vllm_server.url, "--server", "vllm", "--start", "--num-steps", "5",
                    "--delay-steps", "2", "--name", "run.a", "--record-shapes", "--no-with-stack")
    assert result.exit_code == 0, result.output
    assert vllm_server.received[-1].json() == {"profile_prefix": "run.a", "delay_iterations": 2,
                                               "max_iterations": 5,
                                               "profiler_kwargs": {"record_shapes": True, "with_stack": False}}
    assert vllm_server.session == vllm_server.received[-1].json()  # the stand-in took every field
    assert "stops by itself after 5 steps" in result.stderr


def test_vllm_activities_are_refused_with_the_reason(vllm_server):
    result = invoke("--url", vllm_server.url, "--server", "vllm", "--start", "--activities", "CPU")
    assert result.exit_code == 2
    assert "--profiler-config" in result.output
    assert [r.path for r in vllm_server.received if r.method == "POST"] == []


def test_vllm_second_start_names_the_cause(vllm_server):
    assert invoke("--url", vllm_server.url, "--start").exit_code == 0
    result = invoke("--url", vllm_server.url, "--start")
    assert result.exit_code == 1
    assert error_lines(result) == [
        "error: vllm server refused POST /start_profile (HTTP 409): A profiling session is already active. Call "
        "/stop_profile before starting another session.; a capture is already running on the server; stop it "
        "first (infertrace profile --stop)"]


def test_vllm_stop_lists_this_captures_files_and_leaves_a_manifest(vllm_server):
    trace_dir = vllm_server.trace_dir
    trace_dir.mkdir()
    (trace_dir / "older_dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz").write_bytes(b"x")  # another capture
    start = invoke("--url", vllm_server.url, "--start", "--name", "cap1", "--output-dir", str(trace_dir))
    assert start.exit_code == 0, start.output
    assert f"{trace_dir}/{{cap1_dp*_pp*_tp*_dcp*_ep*_rank*.*.pt.trace.json*" in start.stderr
    stop = invoke("--url", vllm_server.url, "--stop")
    assert stop.exit_code == 0, stop.output
    listed = stop.stdout.splitlines()
    assert len(listed) == 2 and all(Path(f).name.startswith("cap1_") for f in listed)
    assert any(".async_llm." in f for f in listed) and any("_rank0." in f for f in listed)
    manifest = json.loads((trace_dir / "cap1.infertrace.json").read_text())
    assert manifest["name"] == "cap1" and manifest["flavour"] == "vllm" and sorted(manifest["files"]) == sorted(listed)
    assert manifest["sent"] == {"profile_prefix": "cap1"}


def test_vllm_before_032_gets_a_bare_start_and_a_note(vllm_old_server):
    """vLLM 0.31.0's /start_profile (vllm/entrypoints/serve/profile/api_router.py) reads no body."""
    result = invoke("--url", vllm_old_server.url, "--start", "--num-steps", "4")
    assert result.exit_code == 0, result.output
    assert vllm_old_server.received[-1].body == b""
    assert "vLLM 0.31.0's /start_profile ignores profile_prefix, max_iterations" in result.stderr
    assert "--name, --num-steps not applied" in result.stderr
    assert "stops by itself" not in result.stderr  # it will not


def test_vllm_032_takes_name_and_steps_and_is_told_it_ignores_profiler_kwargs(vllm_032_server):
    """vLLM 0.32.0's StartProfileRequest reads profile_prefix, delay_iterations and max_iterations and silently
    ignores profiler_kwargs (0.33's); its CPU worker names the trace {prefix}_rank0.{ns}, which --stop lists."""
    trace_dir = vllm_032_server.trace_dir
    trace_dir.mkdir()
    start = invoke("--url", vllm_032_server.url, "--start", "--name", "cap", "--num-steps", "4", "--delay-steps",
                   "1", "--record-shapes", "--no-with-stack", "--output-dir", str(trace_dir))
    assert start.exit_code == 0, start.output
    sent = {"profile_prefix": "cap", "delay_iterations": 1, "max_iterations": 4}
    assert vllm_032_server.received[-1].json() == sent and vllm_032_server.session == sent
    assert "vLLM 0.32.0's /start_profile ignores profiler_kwargs: --record-shapes, --no-with-stack not applied" \
        in start.stderr
    assert "stops by itself after 4 steps" in start.stderr
    stop = invoke("--url", vllm_032_server.url, "--stop")
    assert stop.exit_code == 0, stop.output
    listed = [Path(f).name for f in stop.stdout.splitlines()]
    assert len(listed) == 2 and {name.startswith("cap_rank0.") for name in listed} == {True, False}, listed
    assert [name for name in listed if ".async_llm." in name and name.startswith("cap_")], listed


def test_unnamed_vllm_captures_each_keep_their_manifest_and_rank_trace(vllm_031_cpu_server):
    """A vLLM that takes no name (0.31.0) writes `rank0.{ns}...` on CPU: each --stop lists it, and the second
    capture's manifest does not replace the first's."""
    trace_dir = vllm_031_cpu_server.trace_dir
    trace_dir.mkdir()
    listed = []
    for _ in range(2):
        start = invoke("--url", vllm_031_cpu_server.url, "--start", "--output-dir", str(trace_dir))
        assert start.exit_code == 0, start.output
        stop = invoke("--url", vllm_031_cpu_server.url, "--stop")
        assert stop.exit_code == 0, stop.output
        listed.append({Path(f).name for f in stop.stdout.splitlines()})
    assert all(any(name.startswith("rank0.") for name in files) for files in listed), listed
    manifests = [json.loads(p.read_text()) for p in trace_dir.glob("*.infertrace.json")]
    assert len(manifests) == 2 and all(m["name"] is None for m in manifests)
    assert sorted({Path(f).name for f in m["files"]} for m in manifests) == sorted(listed, key=len)


def test_vllm_422_on_the_body_falls_back_to_a_bare_start(serve_app):
    from aiohttp import web

    bodies = []

    async def start(request):
        raw = await request.read()
        bodies.append(raw)
        if raw:
            return web.json_response({"detail": [{"msg": "Extra inputs are not permitted"}]}, status=422)
        return web.Response()

    app = web.Application()
    app.router.add_get("/version", replying(lambda: web.json_response({"version": "0.34.0rc1"})))
    app.router.add_post("/start_profile", start)
    with serve_app(app) as url:
        result = invoke("--url", url, "--server", "vllm", "--start", "--num-steps", "3")
    assert result.exit_code == 0, result.output
    assert bodies[1] == b"" and json.loads(bodies[0])["max_iterations"] == 3
    assert "HTTP 422" in result.stderr and "not applied" in result.stderr


# SGLang --------------------------------------------------------------------------------------------------

def test_sglang_detected_and_full_body(sglang_server, tmp_path):
    out = tmp_path / "sgl"
    result = invoke("--url", sglang_server.url, "--start", "--output-dir", str(out), "--num-steps", "8",
                    "--activities", "cpu,GPU", "--with-stack", "--record-shapes", "--name", "s1")
    assert result.exit_code == 0, result.output
    assert [(m, p) for m, p, _ in calls(sglang_server)] == [("GET", "/server_info"), ("POST", "/start_profile")]
    start = sglang_server.received[-1]
    assert start.content_type == "application/json"
    assert start.json() == {"output_dir": str(out), "num_steps": 8, "with_stack": True, "record_shapes": True,
                            "activities": ["CPU", "GPU"], "profile_id": "s1"}
    assert "stops by itself after 8 steps" in result.stderr
    assert f"{out}/{{s1-TP-*.trace.json.gz" in result.stderr


def test_sglang_body_carries_only_what_was_given(sglang_server):
    result = invoke("--url", sglang_server.url, "--server", "sglang", "--start", "--no-with-stack", "--name", "n")
    assert result.exit_code == 0, result.output
    assert len(sglang_server.received) == 1
    assert sglang_server.received[0].json() == {"with_stack": False, "profile_id": "n"}


def test_sglang_cuda_profiler_activity(sglang_server):
    result = invoke("--url", sglang_server.url, "--server", "sglang", "--start", "--activities", "CUDA_PROFILER",
                    "--name", "n")
    assert result.exit_code == 0, result.output
    assert sglang_server.received[0].json() == {"activities": ["CUDA_PROFILER"], "profile_id": "n"}


def test_sglang_seconds_window_lists_files(sglang_server, tmp_path):
    out = tmp_path / "o"
    result = invoke("--url", sglang_server.url, "--server", "sglang", "--seconds", "0.1", "--activities", "GPU",
                    "--name", "w", "--output-dir", str(out))
    assert result.exit_code == 0, result.output
    assert [(r.method, r.path) for r in sglang_server.received] == [("POST", "/start_profile"),
                                                                    ("POST", "/stop_profile")]
    assert sglang_server.received[1].body == b""
    assert result.stdout.splitlines() == [str(out / "w-TP-0.trace.json.gz")]
    assert (out / "w.infertrace.json").exists()


def test_sglang_stop_without_start_names_the_cause(sglang_server):
    result = invoke("--url", sglang_server.url, "--stop")
    assert result.exit_code == 1
    assert error_lines(result) == [
        "error: sglang server refused POST /stop_profile (HTTP 500): Internal Server Error; nothing is being "
        "captured: it was never started, or it already stopped by itself after --num-steps"]


def test_sglang_second_start_names_the_cause(sglang_server):
    assert invoke("--url", sglang_server.url, "--start").exit_code == 0
    result = invoke("--url", sglang_server.url, "--start")
    assert result.exit_code == 1
    assert "a capture is already running on the server" in error_lines(result)[0]


def test_sglang_self_stop_then_stop_is_the_normal_end(sglang_server, tmp_path):
    out = tmp_path / "self"
    start = invoke("--url", sglang_server.url, "--start", "--num-steps", "2", "--name", "ss", "--output-dir", str(out))
    assert start.exit_code == 0, start.output
    deadline = time.monotonic() + 5
    while sglang_server.profiling and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not sglang_server.profiling  # it stopped by itself
    stop = invoke("--url", sglang_server.url, "--stop")
    assert stop.exit_code == 0, stop.output
    assert "already stopped by itself after --num-steps" in stop.stderr
    assert stop.stdout.splitlines() == [str(out / "ss-TP-0.trace.json.gz")]


def test_sglang_unwritable_output_dir_is_refused_before_sending(sglang_server):
    result = invoke("--url", sglang_server.url, "--start", "--output-dir", "/proc/traces")
    assert result.exit_code == 1
    assert len(error_lines(result)) == 1 and "cannot be created or written" in result.stderr
    assert sglang_server.profile_calls() == [] and not sglang_server.down


def test_sglang_rpd_is_refused_before_it_takes_the_server_down(sglang_server):
    result = invoke("--url", sglang_server.url, "--start", "--activities", "RPD")
    assert result.exit_code == 1
    assert "RPD is a ROCm profiler" in error_lines(result)[0]
    assert sglang_server.profile_calls() == [] and not sglang_server.down


def test_sglang_relative_output_dir_made_absolute_for_a_local_server(sglang_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("--url", sglang_server.url, "--start", "--output-dir", "rel/traces")
    assert result.exit_code == 0, result.output
    assert sglang_server.received[-1].json()["output_dir"] == str(tmp_path / "rel" / "traces")


def test_relative_output_dir_refused_for_a_remote_server():
    import asyncio

    from infertrace.capture.client import ProfilerClient, ProfilerError
    from infertrace.capture.peers import ProfileOptions

    async def scenario():
        async with ProfilerClient("http://10.255.255.1:30000", "sglang") as client:  # never contacted
            await client._sglang_safe(ProfileOptions(output_dir="rel"))

    with pytest.raises(ProfilerError, match="relative and the server is not on this host"):
        asyncio.run(scenario())


def test_api_key_and_headers_reach_every_call(sglang_server_with_key):
    url = sglang_server_with_key.url
    refused = invoke("--url", url, "--start")
    assert refused.exit_code == 1
    assert "pass --api-key or set OPENAI_API_KEY" in error_lines(refused)[0]
    result = CliRunner(env={"OPENAI_API_KEY": "sk-test"}).invoke(
        main, ["profile", "--url", url, "--start", "--header", "X-Trace:yes"])
    assert result.exit_code == 0, result.output
    accepted = sglang_server_with_key.received[-2:]
    assert [r.path for r in accepted] == ["/server_info", "/start_profile"]
    stop = invoke("--url", url, "--stop", "--api-key", "sk-test")
    assert stop.exit_code == 0, stop.output


# detection, usage and faults ----------------------------------------------------------------------------

def test_server_down_is_one_line(dead_url):
    """An unreachable target is unusable input: exit 2, as in bench (README, "Exit codes")."""
    for args in (["--start"], ["--stop"], ["--seconds", "1"], ["--server", "sglang", "--start"]):
        result = invoke("--url", dead_url, *args)
        assert result.exit_code == 2, args
        assert error_lines(result) == [f"error: cannot reach the server at {dead_url}: Connection refused"]


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
    assert len(received) == 1
    assert list(json.loads(received[0])) == ["profile_prefix" if flavour == "vllm" else "profile_id"]


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
        "error: infertrace server refused POST /stop_profile (HTTP 409): no capture in progress"]


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


@pytest.mark.parametrize("flavour, named, not_named", [
    ("infertrace", "infertrace serve starts a capture at its next engine step", "SGLang"),
    ("sglang", "SGLang counts start_step from its own forward counter", "infertrace serve"),
])
def test_delay_steps_refusal_names_the_server_asked(dead_url, flavour, named, not_named):
    """Refused before any call (the URL answers nothing), naming the server it was meant for."""
    result = invoke("--url", dead_url, "--server", flavour, "--start", "--delay-steps", "3")
    assert result.exit_code == 2
    [line] = error_lines(result)
    assert named in line and not_named not in line and "drop --delay-steps" in line


def test_bad_url_is_one_line():
    result = invoke("--url", "not a url", "--server", "sglang", "--start")
    assert result.exit_code == 2  # bad input, refused before any call
    assert len(error_lines(result)) == 1 and "needs http:// or https://" in result.output


def test_client_library_returns_traces(serve_app):
    import asyncio

    from aiohttp import web

    from infertrace.capture.client import Flavour, ProfilerClient
    from infertrace.capture.peers import ProfileOptions

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
            started = await client.start(ProfileOptions(num_steps=3, activities=("CPU",)))
            return started.message, await client.stop()

    with serve_app(app) as url:
        message, stopped = asyncio.run(scenario(url))
    assert message == "profiling started"
    assert stopped.traces == ["t.pt.trace.json.gz"]
    assert bodies == [{"num_steps": 3, "activities": ["CPU"]}]


def test_a_stop_that_lists_its_traces_still_leaves_the_manifest_beside_them(serve_app, tmp_path, monkeypatch):
    """infertrace serve (and SGLang with its file list) name their traces in the stop's answer: the capture's
    `{name}.infertrace.json` is written beside them all the same when they are on this host, as the docs say."""
    from aiohttp import web

    monkeypatch.setenv("INFERTRACE_CACHE", str(tmp_path / "cache"))
    trace = tmp_path / "traces" / "run1.1.rank0.pt.trace.json.gz"
    trace.parent.mkdir()
    trace.write_bytes(b"x")
    app = web.Application()
    app.router.add_get("/server_info", replying(lambda: web.json_response({"engine": "infertrace"})))
    app.router.add_post("/start_profile", replying(lambda: web.json_response({"status": "started"})))
    app.router.add_post("/stop_profile", replying(lambda: web.json_response(
        {"status": "stopped", "files": [str(trace)], "trace_files": [str(trace)]})))
    with serve_app(app) as url:
        assert invoke("--base-url", url, "--start", "--name", "run1").exit_code == 0  # bench's spelling works too
        result = invoke("--url", url, "--stop")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [str(trace)]
    manifest = json.loads((trace.parent / "run1.infertrace.json").read_text())
    assert manifest["name"] == "run1" and manifest["files"] == [str(trace)]


def test_a_url_without_a_scheme_is_one_usage_line():
    result = invoke("--url", "localhost:8000", "--stop")
    assert result.exit_code == 2
    assert "needs http:// or https://; did you mean http://localhost:8000?" in result.output
