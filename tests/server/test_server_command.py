"""`infertrace serve` as a command: generated engine options, usage errors, and a real process drained by SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
import signal
import sys

import aiohttp
import pytest
from click.testing import CliRunner

from infertrace.engine.config import ENGINE_FLAGS, EngineConfig
from infertrace.server.command import serve


def _params(args: list[str]) -> dict:
    return serve.make_context("serve", args).params


def test_every_engine_config_field_is_an_option_without_a_restated_default(tmp_path):
    options = {p.name: p for p in serve.params}
    for f in dataclasses.fields(EngineConfig):
        option = options[f"engine__{f.name}"]
        assert option.default is None, f.name  # the default lives in EngineConfig only
    assert ENGINE_FLAGS.values(_params(["--model", str(tmp_path)])) == {}
    help_text = CliRunner().invoke(serve, ["--help"], terminal_width=200).output
    assert f"[default: {EngineConfig().block_size}]" in help_text


def test_engine_options_reach_the_engine_config(tmp_path):
    params = _params(["--model", str(tmp_path), "--max-num-seqs", "3", "--no-enable-prefix-caching",
                      "--attention", "looped", "--enforce-eager", "--cuda-graph-batch-sizes", "4,1,2",
                      "--kv-cache-tokens", "1024"])
    config = EngineConfig.from_overrides(ENGINE_FLAGS.values(params))
    assert config.max_num_seqs == 3 and config.prefix_caching is False and config.attention == "looped"
    assert config.cuda_graphs is False and config.prefill_cuda_graphs is False
    assert config.cuda_graph_batch_sizes == (1, 2, 4)
    assert config.kv_cache_tokens == 1024
    assert config.block_size == EngineConfig().block_size

    params = _params(["--model", str(tmp_path), "--engine-opt", "attention=looped", "--engine-opt",
                      "max-num-seqs=5", "--engine-opt", "block_size=32", "--block-size", "8"])
    config = EngineConfig.from_overrides(ENGINE_FLAGS.values(params))
    assert (config.attention, config.max_num_seqs, config.block_size) == ("looped", 5, 8)  # the flag wins


def test_binds_loopback_by_default(tmp_path):
    assert _params(["--model", str(tmp_path)])["host"] == "127.0.0.1"
    assert _params(["--model", str(tmp_path), "--host", "0.0.0.0"])["host"] == "0.0.0.0"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--attention", "bogus"], "attention must be one of"),
        (["--cuda-graph-batch-sizes", "a,b"], "cuda_graph_batch_sizes"),
        (["--max-queue", "-1"], "--max-queue must be in 0..1,000,000, got -1"),
        (["--max-queue", str(10**30)], "--max-queue must be in 0..1,000,000"),
        (["--port", str(2**64)], "--port must be in 0..65535"),
        (["--drain-timeout", "nan"], "--drain-timeout must be a number of seconds in 0..86400, got nan"),
        (["--drain-timeout", "1e400"], "--drain-timeout must be a number of seconds in 0..86400, got inf"),
        (["--drain-timeout", "-1"], "--drain-timeout must be a number of seconds in 0..86400, got -1"),
        (["--engine-opt", "nonsense"], "KEY=VALUE"),
        (["--engine-opt", "warp_speed=9"], "unknown engine config field"),
    ],
)
def test_bad_engine_or_server_values_are_one_line_usage_errors(tmp_path, args, message):
    result = CliRunner().invoke(serve, ["--model", str(tmp_path), *args])
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("profile_dir", ["/proc/nope", "/dev/null/x"])
def test_an_unusable_profile_dir_is_one_line_at_startup(tmp_path, profile_dir):
    result = CliRunner().invoke(serve, ["--model", str(tmp_path), "--profile-dir", profile_dir])
    assert result.exit_code == 2
    assert "--profile-dir" in result.output and profile_dir in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_missing_model_is_a_usage_error():
    result = CliRunner().invoke(serve, [])
    assert result.exit_code == 2 and "--model" in result.output


def _serve_argv() -> list[str]:
    exe = shutil.which("infertrace")
    return [exe, "serve"] if exe else [sys.executable, "-c", "from infertrace.cli import main; main()", "serve"]


async def _events(resp, started: asyncio.Event | None = None) -> list:
    out = []
    async for raw in resp.content:
        if raw.startswith(b"data: "):
            if started is not None:
                started.set()
            data = raw[6:].strip().decode()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_sigterm_drains_in_flight_requests_then_aborts_and_exits_0(tiny_model_dir):
    """Decided by events, not by how fast this machine is: the drain budget is an hour, the short request is
    awaited to its end, and the second SIGTERM (abort at once) ends the long one. The timeouts below only keep a
    broken server from hanging the test."""
    proc = await asyncio.create_subprocess_exec(
        *_serve_argv(), "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--port", "0",
        "--kv-cache-tokens", "16384", "--drain-timeout", "3600",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    log: list[str] = []

    async def line_with(pattern: str) -> re.Match:
        while True:
            line = (await asyncio.wait_for(proc.stderr.readline(), timeout=300)).decode()
            assert line, f"the server exited before saying {pattern!r}:\n" + "".join(log)
            log.append(line)
            if m := re.search(pattern, line):
                return m

    try:
        url = (await line_with(r"on (http://[\d.]+:\d+)"))[1]
        assert url.startswith("http://127.0.0.1:")  # loopback unless --host says otherwise

        async with aiohttp.ClientSession() as session:
            async def stream(max_tokens: int, started: asyncio.Event) -> list:
                body = {"prompt": "drain me", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    return await _events(resp, started)

            started = asyncio.Event(), asyncio.Event()
            short = asyncio.ensure_future(stream(30, started[0]))
            long = asyncio.ensure_future(stream(4000, started[1]))
            await asyncio.wait_for(asyncio.gather(started[0].wait(), started[1].wait()), timeout=300)  # both run
            proc.send_signal(signal.SIGTERM)
            await line_with(r"draining 2 in-flight request\(s\)")  # said once the listener is closed
            with pytest.raises(aiohttp.ClientConnectionError):  # no longer listening
                async with aiohttp.ClientSession() as fresh:
                    await fresh.get(f"{url}/health")

            short_events = await asyncio.wait_for(short, timeout=300)  # drained: it ends as it would have
            assert not long.done()  # 4,000 tokens: thousands of steps behind the short one
            proc.send_signal(signal.SIGTERM)  # a second signal aborts at once
            long_events = await asyncio.wait_for(long, timeout=300)
        assert short_events[-1] == "[DONE]" and short_events[-2]["choices"][0]["finish_reason"] == "length"
        assert len(short_events) == 31  # every token arrived
        assert long_events[-1] == "[DONE]" and long_events[-2]["choices"][0]["finish_reason"] == "abort"
        code = await asyncio.wait_for(proc.wait(), timeout=300)
        log.append((await proc.stderr.read()).decode())
        assert code == 0, "".join(log)
        assert "stopped (1 request(s) aborted)" in "".join(log)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_a_folder_that_is_no_model_is_one_line_before_anything_starts(tmp_path):
    result = CliRunner().invoke(serve, ["--model", str(tmp_path)])  # it printed a 46-line traceback
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "is not a model directory" in result.output and "config.json" in result.output


def test_a_folder_without_weights_is_one_line_before_anything_starts(tiny_model_dir, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    result = CliRunner().invoke(serve, ["--model", str(tmp_path)])  # it printed its error twice and exited 1
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [f"error: --model {tmp_path} is not a model directory: it has no "
                                                  "*.safetensors weights (a Hugging Face model directory holds "
                                                  "config.json, the safetensors weights and tokenizer.json)"]


def test_a_mistyped_preset_is_answered_with_the_presets_and_the_closest(tmp_path, monkeypatch):
    from infertrace.modelgen.presets import PRESETS

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(serve, ["--model", "qwen3-tiny"])
    assert result.exit_code == 2
    message = " ".join(result.output.split())
    assert "'qwen3-tiny' is neither a model directory nor a preset name (did you mean 'tiny'? presets: " in message
    assert all(name in message for name in PRESETS)


def test_an_engine_that_cannot_start_on_a_setting_is_one_line_and_exit_2(tiny_model_dir):
    import subprocess

    proc = subprocess.run([*_serve_argv(), "--model", str(tiny_model_dir), "--port", "0", "--max-num-seqs",
                           str(10**20)], capture_output=True, text=True, timeout=180)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert lines[0].startswith("loading ")  # then one line, not torch's C++ frames and not twice
    assert len(lines) == 2 and lines[1].startswith("error: cannot load the model: "), proc.stderr


def test_ctrl_c_while_the_model_loads_exits_130_at_once_with_one_line(tiny_model_dir):
    import os
    import subprocess
    import time

    proc = subprocess.Popen([*_serve_argv(), "--model", str(tiny_model_dir), "--port", "0"], stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # a process group, as a terminal's Ctrl-C reaches
    try:
        assert proc.stderr.readline().startswith("loading ")
        engines = []
        deadline = time.monotonic() + 30
        while not engines and time.monotonic() < deadline:  # the engine process, spawned and loading
            engines = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == proc.pid
                       and b"multiprocessing" in _cmdline(int(p))]
            time.sleep(0.02)
        assert engines
        os.killpg(proc.pid, signal.SIGINT)
        started = time.monotonic()
        code = proc.wait(timeout=60)
        took = time.monotonic() - started
        rest = proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    assert code == 130, rest
    assert rest.strip().splitlines() == ["error: interrupted while the model loaded"]  # no "Aborted!"
    assert took < 15  # the engine process is killed, not waited for (up to 30 s) until its load ends
    assert not any(os.path.exists(f"/proc/{pid}") and _parent(pid) == proc.pid for pid in engines)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_a_busy_port_is_reported_before_the_model_loads(tiny_model_dir, monkeypatch):
    import socket

    from infertrace.server import command

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(command, "_serve", load)
    monkeypatch.setattr(command, "_serve_in_process", load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for extra in ([], ["--api-server-count", "2"], ["--engine-in-process"]):
            result = CliRunner().invoke(serve, ["--model", str(tiny_model_dir), "--port", str(port), *extra])
            assert result.exit_code == 1, result.output
            assert result.output.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
