"""The engine in a process of its own: the same answers as the engine on a thread, a torch-free front end, and
the process lifecycle (drain, engine death, front-end death, several front ends on one port)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from infertrace.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPTS = ["hello world", "the kernel launch queue", "def f(x):\n    return x[3]", "a b c d e f g"]


async def _tokens(client, request_id: str, prompt: str, params: SamplingParams = GREEDY) -> list[int]:
    ids = client.state.tokenizer.encode(prompt)
    return [t async for out in client.state.engine.generate(request_id, ids, params) for t in out.new_token_ids]


async def test_greedy_tokens_equal_the_engine_on_a_thread(serve_tiny):
    async with serve_tiny() as client:
        want = await asyncio.gather(*(_tokens(client, f"t{i}", p) for i, p in enumerate(PROMPTS)))
    async with serve_tiny(engine_process=True) as client:
        assert client.engine_proc.pid != os.getpid()
        got = await asyncio.gather(*(_tokens(client, f"p{i}", p) for i, p in enumerate(PROMPTS)))
        resp = await client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 12,
                                                          "ignore_eos": True, "stream": True})
        assert resp.status == 200
        events = [line for line in (await resp.text()).splitlines() if line.startswith("data: ")]
    assert got == want and all(len(t) == 12 for t in got)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


async def test_the_engine_process_freezes_its_start_up_heap(serve_tiny):
    """The engine process moves its start-up objects out of the collector's reach once it is ready (a full
    collection over them paused the step loop for 131-135 ms on CPU); an engine on a thread of the server leaves
    the server's heap alone."""
    async with serve_tiny(engine_process=True) as client:
        info = await (await client.get("/server_info")).json()
        assert info["gc_frozen_objects"] > 100_000  # torch and the engine: about 255,000 objects
    async with serve_tiny() as client:
        assert (await (await client.get("/server_info")).json())["gc_frozen_objects"] is None


async def test_the_engine_refuses_a_request_with_a_400(serve_tiny):
    async with serve_tiny(engine_process=True) as client:
        # the vocabulary's size is the engine's to know: the refusal comes from Engine.add_request
        resp = await client.post("/v1/completions", json={"prompt": [1, 2, 10**9], "max_tokens": 2})
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["message"] == "prompt token ids must be integers in [0, 151936)" and error["param"] == "prompt"
        bad = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": -1})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "temperature"
        assert (await client.get("/health")).status == 200


async def test_a_disconnect_aborts_the_request_and_frees_its_kv(serve_tiny, wait_metrics):
    async with serve_tiny(engine_process=True) as client:
        resp = await client.post("/v1/completions", json={"prompt": "hello " * 40, "max_tokens": 3000,
                                                          "ignore_eos": True, "stream": True})
        await resp.content.readline()
        busy = await wait_metrics(client, lambda m: m["infertrace:kv_blocks_used"] > 0)
        assert busy["infertrace:num_requests_running"] == 1
        resp.close()
        after = await wait_metrics(client, lambda m: m["infertrace:kv_blocks_used"] == 0
                                   and m["infertrace:client_disconnects_total"] == 1)
        assert after["infertrace:kv_blocks_used"] == 0
        assert after["infertrace:num_requests_running"] == 0
        assert after["infertrace:requests_aborted_total"] == 1
        assert after["infertrace:client_disconnects_total"] == 1
        assert after["infertrace:num_requests_in_flight"] == 0


async def test_metrics_and_server_info_report_the_engine_process(serve_tiny, metrics_of, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    async with serve_tiny(engine_process=True) as client:
        ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True})
        assert ok.status == 200
        info = await (await client.get("/server_info")).json()
        metrics = await metrics_of(client)
    assert info["engine_pid"] == client.engine_proc.pid
    assert info["frontend"] == {"pid": os.getpid(), "index": 0, "count": 1, "engine_in_process": False}
    assert info["engine_config"]["kv_cache_tokens"] == 16384 and info["versions"]["torch"]
    assert info["torch_threads"] == max(1, (os.cpu_count() or 1) - 1)  # the engine's CPU thread rule, as bench's
    assert metrics["infertrace:kv_blocks_total"] == 16384 // 16
    assert metrics["infertrace:generation_tokens_total"] == 5
    assert metrics['infertrace:request_success_total{finished_reason="length"}'] == 1
    assert metrics['infertrace:step_duration_seconds_count{kind="decode"}'] >= 4


async def test_the_profiler_captures_the_engine_process_and_the_front_end(serve_tiny, tmp_path):
    from infertrace.analyze.capture import load_capture

    async with serve_tiny(engine_process=True, profile_dir=tmp_path) as client:
        started = await client.post("/start_profile", json={"profile_id": "split", "activities": ["CPU"],
                                                            "frontend": True})
        assert started.status == 200, await started.text()
        assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})).status == 200
        stopped = await (await client.post("/stop_profile")).json()
    [trace] = stopped["trace_files"]
    front = Path(stopped["frontend_trace"])
    assert front.name == f"frontend0-{os.getpid()}.trace.json" and str(front) in stopped["files"]
    capture = load_capture(tmp_path / "capture-split")
    assert [r.path.name for r in capture.ranks] == [Path(trace).name]
    assert capture.ranks[0].events["name"].str.startswith("step[").any()
    assert [f.path for f in capture.frontend] == [front]
    names = capture.frontend[0].events["name"]
    assert names.str.contains("_generate").any() and names.str.contains("encode").any()


async def test_an_engine_process_that_dies_fails_in_flight_requests_and_health(serve_tiny):
    async with serve_tiny(engine_process=True) as client:
        resp = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3000,
                                                          "ignore_eos": True, "stream": True})
        await resp.content.readline()
        os.kill(client.engine_proc.pid, signal.SIGKILL)
        body = await asyncio.wait_for(resp.text(), 10)
        assert "the engine process is gone (the engine process was killed by SIGKILL)" in body
        assert body.rstrip().endswith("data: [DONE]")
        health = await client.get("/health")
        assert health.status == 503 and (await health.json())["error"]["code"] == "engine_dead"
        after = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert after.status >= 500


async def test_an_engine_death_is_one_log_line_and_a_503_with_its_reason(serve_tiny, caplog):
    """Four streams in flight when the engine process dies: the log says so once, with no traceback (one
    exception raised in every stream used to gather each raise's frames: 16, 29, 42, 57 lines), each stream ends
    with the reason in-band, and a request after it is a 503 that names the reason."""
    import logging

    async with serve_tiny(engine_process=True) as client:
        body = {"prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        streams = [await client.post("/v1/completions", json=body) for _ in range(4)]
        for resp in streams:
            await resp.content.readline()
        with caplog.at_level(logging.INFO, logger="infertrace"):
            os.kill(client.engine_proc.pid, signal.SIGKILL)
            texts = [await asyncio.wait_for(resp.text(), 10) for resp in streams]
            after = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            error = (await after.json())["error"]
    for text in texts:
        assert "the engine process is gone (the engine process was killed by SIGKILL)" in text
    assert after.status == 503 and error["code"] == "engine_dead"
    assert "the engine process is gone (the engine process was killed by SIGKILL)" in error["message"]
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in records] == ["the engine process is gone (the engine process was killed by "
                                                 "SIGKILL)"]
    assert all(r.exc_info is None for r in records)


def test_frame_reader_splits_frames_across_chunks():
    from infertrace.server.engine_link.messages import FrameReader, FromEngine, decode_from_engine, frame

    data = b"".join(frame(FromEngine("reply", call_id=i, value={"n": i})) for i in range(5))
    reader, got = FrameReader(), []
    for k in range(0, len(data), 3):
        got += [decode_from_engine(b) for b in reader.feed(data[k:k + 3])]
    assert [(m.kind, m.call_id, m.value) for m in got] == [("reply", i, {"n": i}) for i in range(5)]


def test_chat_templates_render_as_transformers_renders_them(tiny_model_dir):
    from transformers import AutoTokenizer

    from infertrace.server.frontend.tokenizer import FrontendTokenizer

    ours, theirs = FrontendTokenizer(tiny_model_dir), AutoTokenizer.from_pretrained(str(tiny_model_dir))
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ünïcode <b>"},
              {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]]
    for messages in chats:
        for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": True, "enable_thinking": False},
                       {"add_generation_prompt": False}):
            want = theirs.apply_chat_template(messages, tokenize=False, **kwargs)
            assert ours.apply_chat_template(messages, **kwargs) == want
            assert ours.encode(want, add_special_tokens=False) == theirs.encode(want, add_special_tokens=False)
    assert ours.encode("hello world") == theirs.encode("hello world")
    assert ours.get_vocab() == theirs.get_vocab()


def test_the_front_end_never_imports_torch(tiny_model_dir):
    code = ("import sys\n"
            "import infertrace.cli, infertrace.server.command, infertrace.server.engine_link.runner, infertrace.server.frontend.app\n"
            "from infertrace.server.frontend.tokenizer import FrontendTokenizer\n"
            f"t = FrontendTokenizer({str(tiny_model_dir)!r})\n"
            "t.encode(t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ----- `infertrace serve` as a process tree -----
class Served:
    def __init__(self, model_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "infertrace", "serve", "--model", str(model_dir),
                                      "--port", "0", "--kv-cache-tokens", "16384", *args],
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            if m := re.search(r"on (http://\S+) \(.*engine pid (\d+)", line):
                self.url, self.engine_pid = m[1], int(m[2])
                return
        self.proc.kill()
        raise AssertionError("the server did not start: " + "".join(self.lines))

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, "".join(self.lines) + err


def _gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie has exited; only its parent's wait is missing
        if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return True
        time.sleep(0.1)
    return False


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.slow
def test_sigterm_drains_then_both_processes_exit(tiny_model_dir):
    served = Served(tiny_model_dir)
    assert _maps_torch(served.engine_pid) and not _maps_torch(served.proc.pid)

    async def drive() -> list[str]:
        async with aiohttp.ClientSession() as session:
            async with session.post(served.url + "/v1/completions",
                                    json={"prompt": "hi", "max_tokens": 60, "ignore_eos": True, "stream": True}) as r:
                first = await r.content.readline()
                served.proc.send_signal(signal.SIGTERM)
                return [first.decode(), *[line.decode() async for line in r.content]]

    lines = asyncio.run(drive())
    code, log = served.finish()
    finals = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"  # the request finished during the drain
    assert code == 0, log
    assert "draining 1 in-flight request(s)" in log and "stopped (0 request(s) aborted)" in log
    assert _gone(served.engine_pid)


@pytest.mark.slow
def test_an_engine_that_dies_ends_the_server_with_a_non_zero_exit(tiny_model_dir):
    served = Served(tiny_model_dir)
    os.kill(served.engine_pid, signal.SIGKILL)
    code, log = served.finish(timeout=30)
    assert code == 1
    assert "error: the engine process is gone (the engine process was killed by SIGKILL)" in log


@pytest.mark.slow
def test_a_sigkilled_front_end_leaves_no_engine_behind(tiny_model_dir):
    served = Served(tiny_model_dir, "--api-server-count", "2")
    children = [int(p) for p in Path(f"/proc/{served.proc.pid}/task/{served.proc.pid}/children").read_text().split()]
    assert served.engine_pid in children and len(children) >= 2
    served.proc.kill()
    served.proc.wait(10)
    assert all(_gone(pid) for pid in children), [Path(f"/proc/{p}/cmdline").read_bytes() for p in children]


@pytest.mark.slow
def test_a_front_end_that_dies_ends_the_server_with_a_non_zero_exit(tiny_model_dir):
    """With two front ends, the second one SIGKILLed: the first drains, stops the engine and exits 1 naming it, at
    once: with nothing in flight the drain time is not waited out (it idled drain-timeout + 10 s)."""
    served = Served(tiny_model_dir, "--api-server-count", "2", "--drain-timeout", "3600")
    children = [int(p) for p in Path(f"/proc/{served.proc.pid}/task/{served.proc.pid}/children").read_text().split()]
    frontends = [pid for pid in children if pid != served.engine_pid and b"spawn" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(frontends) == 1, [Path(f"/proc/{p}/cmdline").read_bytes() for p in children]
    os.kill(frontends[0], signal.SIGKILL)
    code, log = served.finish(timeout=60)
    assert code == 1, log
    assert f"error: front end infertrace-frontend1 (pid {frontends[0]}) was killed by SIGKILL" in log
    assert _gone(served.engine_pid)


def _other_front_ends(served: Served) -> list[int]:
    children = [int(p) for p in Path(f"/proc/{served.proc.pid}/task/{served.proc.pid}/children").read_text().split()]
    return [pid for pid in children if pid != served.engine_pid and b"spawn" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.slow
def test_a_stopped_idle_front_end_is_dropped_on_its_silence_and_the_server_stops(tiny_model_dir):
    """A SIGSTOPped front end with nothing in flight has no outputs waiting, so no stall bound ever caught it, and
    its listener took about half the new connections, which hung. Its heartbeat stops: past the silence bound
    (3 s here, through $INFERTRACE_MAX_SILENCE_S) the engine drops it and, past its farewell time, kills it; the
    first front end then stops the server with status 1, naming it, and nothing is left running."""
    served = Served(tiny_model_dir, "--api-server-count", "2", env={"INFERTRACE_MAX_SILENCE_S": "3"})
    (frontend,) = _other_front_ends(served)
    os.kill(frontend, signal.SIGSTOP)
    try:
        code, log = served.finish(timeout=40)  # 3 s of silence, 5 s of farewell, then the stop
    finally:
        served.proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(frontend, signal.SIGKILL)
    assert code == 1, log
    assert (f"dropping front end pid {frontend}: this front end sent nothing, not even its heartbeat, for more "
            f"than 3 s (stopped or hung)") in log
    assert f"error: front end infertrace-frontend1 (pid {frontend}) was killed by SIGKILL" in log
    assert _gone(frontend) and _gone(served.engine_pid)


@pytest.mark.slow
def test_healthy_idle_front_ends_are_never_dropped_for_silence(tiny_model_dir):
    """Two idle front ends over four times the silence bound (3 s here): their heartbeats keep both, /health is
    answered throughout, and SIGTERM stops the server with status 0."""
    served = Served(tiny_model_dir, "--api-server-count", "2", env={"INFERTRACE_MAX_SILENCE_S": "3"})
    (frontend,) = _other_front_ends(served)

    async def poll(seconds: float) -> set[int]:
        pids = set()
        deadline = time.monotonic() + seconds
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                async with session.get(served.url + "/server_info", timeout=aiohttp.ClientTimeout(total=5),
                                       headers={"Connection": "close"}) as r:  # a new connection: either listener
                    assert r.status == 200
                    pids.add((await r.json())["frontend"]["pid"])
                await asyncio.sleep(0.25)
        return pids

    try:
        answered = asyncio.run(poll(12.0))
        assert served.proc.poll() is None and not _gone(frontend, timeout=0)
    finally:
        served.proc.send_signal(signal.SIGTERM)
        code, log = served.finish(timeout=60)
    assert answered == {served.proc.pid, frontend}  # both were asked, and both answered
    assert code == 0, log
    assert "dropping front end" not in log and "killed" not in log


@pytest.mark.slow
def test_two_front_ends_share_one_port(tiny_model_dir):
    served = Served(tiny_model_dir, "--api-server-count", "2")

    async def ask() -> set[int]:
        pids = set()
        for _ in range(40):  # a fresh connection each time: the kernel spreads them over both listeners
            async with aiohttp.ClientSession() as session:
                async with session.get(served.url + "/server_info") as r:
                    info = await r.json()
                pids.add(info["frontend"]["pid"])
                async with session.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}) as r:
                    assert r.status == 200
        return pids

    pids = asyncio.run(ask())
    served.proc.send_signal(signal.SIGTERM)
    code, log = served.finish()
    assert len(pids) == 2 and served.proc.pid in pids, pids
    assert code == 0, log
    assert "2 front ends" in log
    assert all(_gone(pid) for pid in pids | {served.engine_pid})


@pytest.mark.slow
def test_a_front_end_trace_stopped_on_the_other_front_end_is_stopped_and_written(tiny_model_dir, tmp_path):
    """Start with "frontend": true on one front end, stop on the other: the stop answered 200 with no front-end
    trace and the first one's profile hook stayed on (requests 2.6x slower). Now the engine tells the tracing
    front end to stop and write its trace, and the stop names it."""
    served = Served(tiny_model_dir, "--api-server-count", "2", "--profile-dir", str(tmp_path))

    async def session_on(pid_wanted=None, pid_not=None):
        while True:  # one kept-alive connection each: the kernel picks the front end when it is opened
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            async with session.get(served.url + "/server_info") as r:
                pid = (await r.json())["frontend"]["pid"]
            if pid != pid_not and pid_wanted in (None, pid):
                return session, pid
            await session.close()

    async def drive():
        first, first_pid = await session_on()
        second, second_pid = await session_on(pid_not=first_pid)
        try:
            async with first.post(served.url + "/start_profile",
                                  json={"profile_id": "across", "activities": ["CPU"], "frontend": True}) as r:
                assert r.status == 200, await r.text()
            async with first.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}) as r:
                assert r.status == 200
            async with second.post(served.url + "/stop_profile") as r:
                assert r.status == 200, await r.text()
                return first_pid, await r.json()
        finally:
            await first.close()
            await second.close()

    try:
        first_pid, stopped = asyncio.run(drive())
    finally:
        served.proc.send_signal(signal.SIGTERM)
        code, log = served.finish()
    assert code == 0, log
    front = Path(stopped["frontend_trace"])
    assert front.name.endswith(f"-{first_pid}.trace.json") and str(front) in stopped["files"]
    names = [e["name"] for e in json.loads(front.read_text())["traceEvents"]]
    assert any("_generate" in name for name in names)  # the request the tracing front end served


@pytest.mark.slow
def test_the_stop_line_counts_the_requests_every_front_end_aborted(tiny_model_dir):
    """Eight endless streams over two front ends and no drain time: every one is aborted, and the draining line
    and the last line count all eight, not only the first front end's."""
    served = Served(tiny_model_dir, "--api-server-count", "2", "--drain-timeout", "0")

    async def drive() -> list[str]:
        running = asyncio.Event()
        started: list[int] = []

        async def stream() -> str:
            async with aiohttp.ClientSession() as session:  # a fresh connection: either front end may take it
                async with session.post(served.url + "/v1/completions", json={
                        "prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
                    await r.content.readline()
                    started.append(1)
                    if len(started) == 8:
                        running.set()
                    return await r.text()

        streams = [asyncio.ensure_future(stream()) for _ in range(8)]
        await asyncio.wait_for(running.wait(), 120)
        served.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(asyncio.gather(*streams), 120)

    bodies = asyncio.run(drive())
    code, log = served.finish()
    assert code == 0, log
    assert all('"finish_reason":"abort"' in body.replace(" ", "") for body in bodies)
    assert "draining 8 in-flight request(s)" in log, log  # every front end's, not only the first one's
    assert "stopped (8 request(s) aborted)" in log, log


def _events(body: str) -> list:
    out = []
    for line in body.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            event.pop("id", None), event.pop("created", None)
            out.append(event)
        elif line.startswith("data: "):
            out.append(line)
    return out


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello world", "stream_options": {"include_usage": True,
                                                                    "continuous_usage_stats": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
async def test_outputs_written_from_the_dispatch_equal_those_written_by_the_handler(serve_tiny, monkeypatch,
                                                                                    path, body):
    from infertrace.server.frontend import app

    request = {**body, "max_tokens": 9, "ignore_eos": True, "stream": True}
    async with serve_tiny(engine_process=True) as client:
        direct = await (await client.post(path, json=request)).text()
        monkeypatch.setattr(app._DirectWrites, "HIGH_WATER", -1)  # every output left to the handler
        handler = await (await client.post(path, json=request)).text()
    assert _events(direct) == _events(handler)
    assert len([e for e in _events(direct) if isinstance(e, dict) and e.get("choices")]) >= 9


async def test_a_stream_to_an_http_1_0_client_is_not_chunked(serve_tiny):
    async with serve_tiny(engine_process=True) as client:
        reader, writer = await asyncio.open_connection(client.host, client.port)
        payload = json.dumps({"prompt": "hi", "max_tokens": 6, "ignore_eos": True, "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(payload), payload))
        raw = (await asyncio.wait_for(reader.read(), 10)).decode()
        writer.close()
    head, _, body = raw.partition("\r\n\r\n")
    assert "chunked" not in head.lower()
    events = _events(body)
    assert events[-1] == "data: [DONE]" and len(events) == 7
    assert events[-2]["choices"][0]["finish_reason"] == "length"


# ----- a front end that stops reading -----
class _ScriptedEngine:
    """Stands in for the Engine behind EngineLoop: every running request yields one output per step, with
    `text_bytes` of text so that a front end that does not read falls behind fast; requests named `stuck-*`
    never finish, the others after `tokens` steps."""

    def __init__(self, tokens: int = 200, text_bytes: int = 4096, step_s: float = 0.001) -> None:
        import threading

        self.tokens, self.text, self.step_s = tokens, "x" * text_bytes, step_s
        self.running: dict[str, int] = {}  # by engine id
        self.labels: dict[str, str] = {}  # engine id -> its client's id
        self.aborted: list[str] = []  # client ids
        self.counters = {"steps": 0}
        self.last_step = None
        self.lock = threading.Lock()

    num_waiting = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def plan_delay(self) -> float:
        return 0.0  # no step in flight: the next is planned at once

    def add_request(self, request_id, prompt, params, label=None) -> None:
        with self.lock:
            if request_id in self.running:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.running[request_id] = 0
            self.labels[request_id] = label or request_id

    def abort(self, request_id):
        with self.lock:
            if self.running.pop(request_id, None) is not None:
                self.aborted.append(self.labels[request_id])
        return None

    def running_ids(self) -> list[str]:
        with self.lock:
            return sorted(self.labels[i] for i in self.running)

    def step(self) -> list:
        from types import SimpleNamespace

        time.sleep(self.step_s)
        outputs = []
        with self.lock:
            self.counters["steps"] += 1
            for request_id in list(self.running):
                self.running[request_id] += 1
                done = not self.labels[request_id].startswith("stuck") and self.running[request_id] >= self.tokens
                if done:
                    del self.running[request_id]
                outputs.append(SimpleNamespace(request_id=request_id, new_token_ids=[7], new_text=self.text,
                                               finished=done, finish_reason="length" if done else None,
                                               num_prompt_tokens=1, num_output_tokens=self.running.get(request_id, 0),
                                               num_cached_tokens=0))
        return outputs


class _Services:
    def on_step(self, step) -> None:
        pass

    def command(self, name, args):
        return "pong"


def _engine_loop(engine, count: int, **limits):
    """An EngineLoop on a thread over `count` socket pairs; returns it, the thread and the front ends' ends."""
    import socket
    import threading

    from infertrace.server.engine_link.process import EngineLoop

    pairs = [socket.socketpair() for _ in range(count)]
    loop = EngineLoop(engine, _Services(), [theirs for _, theirs in pairs], **limits)
    thread = threading.Thread(target=loop.run, name="engine-loop", daemon=True)
    thread.start()
    return loop, thread, [ours for ours, _ in pairs]


def _add_until_aborted(engine, sock, request_id: str, within_s: float = 20.0) -> float:
    """Add `request_id` from front end `sock` and wait until the engine aborts it; the seconds that took."""
    from infertrace.server.engine_link.messages import ToEngine, frame

    started = time.monotonic()
    sock.sendall(frame(ToEngine("add", request_id=request_id, prompt=[1])))
    while request_id not in engine.aborted and time.monotonic() - started < within_s:
        time.sleep(0.01)
    return time.monotonic() - started


def _messages(sock, until, deadline_s: float) -> list:
    """Messages read from `sock` until `until(messages)` holds, the peer closes, or the deadline passes."""
    from infertrace.server.engine_link.messages import FrameReader, decode_from_engine

    reader, got, deadline = FrameReader(), [], time.monotonic() + deadline_s
    while not until(got):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            break
        if not data:
            break
        got += [decode_from_engine(body) for body in reader.feed(data)]
    return got


def _told_why(msgs: list) -> bool:
    return bool(msgs) and msgs[-1].kind == "dropped"


def _finished(request_id: str):
    return lambda msgs: any(d.finished and d.request_id == request_id for m in msgs for d in m.outputs)


def test_a_front_end_that_stops_reading_does_not_stall_the_engine_or_the_others():
    from infertrace.server.engine_link.messages import ToEngine, frame

    engine = _ScriptedEngine(tokens=300)
    loop, thread, (fast, stuck) = _engine_loop(engine, 2)
    try:
        for i in range(4):  # 4 KiB a step each, never read: past any socket buffer within a few steps
            stuck.sendall(frame(ToEngine("add", request_id=f"stuck-{i}", prompt=[1])))
        time.sleep(0.2)
        started = time.monotonic()
        fast.sendall(frame(ToEngine("add", request_id="fast-0", prompt=[1])))
        got = _messages(fast, _finished("fast-0"), deadline_s=20)
        elapsed = time.monotonic() - started
        deltas = [d for m in got for d in m.outputs]
        assert [d.finished for d in deltas] == [False] * 299 + [True], f"{len(deltas)} outputs in {elapsed:.1f}s"
        assert elapsed < 10  # 300 steps of 1 ms: the stalled front end adds no waiting of its own
        assert engine.running_ids() == [f"stuck-{i}" for i in range(4)]  # below the bound: kept running
        assert engine.aborted == []
    finally:
        fast.close(), stuck.close()
        thread.join(10)
    assert not thread.is_alive()  # every front end gone: the loop ends


def test_a_front_end_past_its_backlog_bound_is_dropped_and_its_requests_aborted():
    from infertrace.server.engine_link.messages import ToEngine, frame

    engine = _ScriptedEngine(tokens=100)
    loop, thread, (fast, stuck) = _engine_loop(engine, 2, max_backlog_bytes=1 << 20)
    try:
        _add_until_aborted(engine, stuck, "stuck-0")
        assert engine.aborted == ["stuck-0"] and engine.running == {}  # its KV is free
        fast.sendall(frame(ToEngine("add", request_id="fast-0", prompt=[1])))
        got = _messages(fast, _finished("fast-0"), deadline_s=20)
        assert len([d for m in got for d in m.outputs]) == 100
        # what the dropped front end reads once it reads again: whole frames, then why, then the end
        backlog = _messages(stuck, _told_why, deadline_s=5)
        assert backlog and all(m.kind == "step" for m in backlog[:-1])
        last = backlog[-1]
        assert last.kind == "dropped" and "fell more than 1 MiB of outputs behind" in last.error["message"]
        assert len(loop.peers) == 1
    finally:
        fast.close(), stuck.close()
        thread.join(10)
    assert not thread.is_alive()


def test_a_front_end_that_takes_nothing_past_the_stall_bound_is_dropped_though_under_its_backlog_bound():
    """One stream that never ends, never read: once the socket's buffer is full and nothing leaves for the stall
    bound (0.5 s here), the front end is dropped with its request aborted, long before 64 MiB piles up."""

    engine = _ScriptedEngine(tokens=10**9)
    loop, thread, (idle, stuck) = _engine_loop(engine, 2, max_stall_s=0.5)  # idle keeps the loop serving
    try:
        took = _add_until_aborted(engine, stuck, "stuck-0")
        assert engine.aborted == ["stuck-0"] and engine.running == {}
        assert took < 10
        backlog = _messages(stuck, _told_why, deadline_s=5)
        last = backlog[-1]
        assert last.kind == "dropped" and "took no output for more than 0.5 s" in last.error["message"]
        assert all(m.kind == "step" for m in backlog[:-1])
        assert len(loop.peers) == 1
    finally:
        idle.close(), stuck.close()
        thread.join(10)
    assert not thread.is_alive()


def test_a_lone_front_end_that_is_dropped_still_hears_why_before_the_loop_ends():
    """The only front end stops reading and is dropped past the stall bound: the loop, with no live front end left,
    waits for it to take the "dropped" message and go (up to FAREWELL_S) before it ends, instead of ending at once."""
    engine = _ScriptedEngine(tokens=10**9)
    loop, thread, (stuck,) = _engine_loop(engine, 1, max_stall_s=0.5)
    try:
        _add_until_aborted(engine, stuck, "alone-0")
        assert engine.aborted == ["alone-0"] and loop.peers == {}
        assert thread.is_alive()  # still waiting for the dropped front end to read why
        backlog = _messages(stuck, _told_why, deadline_s=5)
        assert backlog and backlog[-1].kind == "dropped"
        assert "took no output for more than 0.5 s" in backlog[-1].error["message"]
        assert thread.is_alive()  # told why, but not gone yet: a stopped front end never reads it
        stuck.close()  # what a front end does once it has read why
        thread.join(5)
        assert not thread.is_alive() and loop.leaving == {}
    finally:
        stuck.close()
        thread.join(10)

def test_a_dropped_front_end_that_does_not_go_is_killed_so_its_listener_takes_no_more_connections():
    """A SIGSTOPped front end keeps its SO_REUSEPORT listener and its share of new connections, which hang. Once
    dropped it has its farewell time to take why and go; past it the engine kills its process (named by its
    "hello"), while the other front end is served on."""
    from infertrace.server.engine_link.messages import ToEngine, frame

    stopped = subprocess.Popen(["sleep", "600"])
    os.kill(stopped.pid, signal.SIGSTOP)
    engine = _ScriptedEngine(tokens=10**9)
    loop, thread, (idle, stuck) = _engine_loop(engine, 2, max_stall_s=0.5, farewell_s=0.5)
    try:
        stuck.sendall(frame(ToEngine("hello", args={"pid": stopped.pid})))
        _add_until_aborted(engine, stuck, "stuck-0")
        assert engine.aborted == ["stuck-0"]
        assert stopped.wait(timeout=60) == -signal.SIGKILL  # killed, though stopped and never reading
        assert loop.leaving == {} and len(loop.peers) == 1 and thread.is_alive()
        idle.sendall(frame(ToEngine("add", request_id="idle-0", prompt=[1])))
        assert _messages(idle, lambda msgs: bool(msgs), deadline_s=30)  # the other one is still served
    finally:
        stopped.kill()
        stopped.wait()
        idle.close(), stuck.close()
        thread.join(10)
    assert not thread.is_alive()


def test_an_idle_front_end_that_falls_silent_is_dropped_and_killed_while_one_that_beats_is_kept():
    """No request anywhere, so no output waits and no stall bound applies: the loop still wakes to judge silence.
    The front end that said hello and then nothing (a SIGSTOPped process) is dropped past the silence bound and
    killed past its farewell; the one that beats is kept; one that has not said hello yet (still starting) is not
    judged."""
    import threading

    from infertrace.server.engine_link.messages import ToEngine, frame

    stopped, alive = subprocess.Popen(["sleep", "600"]), subprocess.Popen(["sleep", "600"])
    os.kill(stopped.pid, signal.SIGSTOP)
    engine = _ScriptedEngine()
    loop, thread, (silent, beating, starting) = _engine_loop(engine, 3, max_silence_s=0.5, farewell_s=0.5)
    done = threading.Event()

    def beat() -> None:
        while not done.wait(0.05):
            beating.sendall(frame(ToEngine("beat")))

    beater = threading.Thread(target=beat, daemon=True)
    try:
        silent.sendall(frame(ToEngine("hello", args={"pid": stopped.pid})))
        beating.sendall(frame(ToEngine("hello", args={"pid": alive.pid})))
        beater.start()
        assert stopped.wait(timeout=30) == -signal.SIGKILL
        why = _messages(silent, _told_why, deadline_s=5)[-1]
        assert why.kind == "dropped"
        assert "sent nothing, not even its heartbeat, for more than 0.5 s" in why.error["message"]
        time.sleep(2.0)  # four silence bounds more
        assert alive.poll() is None and thread.is_alive()
        assert sorted(p.pid or 0 for p in loop.peers.values()) == sorted([alive.pid, 0]) and loop.leaving == {}
    finally:
        done.set()
        beater.join(5)
        for proc in (stopped, alive):
            proc.kill()
            proc.wait()
        silent.close(), beating.close(), starting.close()
        thread.join(10)
    assert not thread.is_alive()


async def test_a_front_end_that_stops_reading_leaves_the_engine_process_serving_the_others(tiny_model_dir):
    """The real engine process with two front ends: ours, and a bare socket that reads while `reading` is set,
    its requests' outputs made large (64 KiB a step) by their request ids. When it stops reading, its outputs pile
    up unread, and our stream goes on at the speed it had before; when it reads again, it gets whole frames."""
    import dataclasses
    import threading

    from infertrace.engine import EngineConfig
    from infertrace.server.engine_link.client import ProcessEngine
    from infertrace.server.engine_link.messages import FrameReader, ToEngine, decode_from_engine, frame
    from infertrace.server.engine_link.process import EngineSpec, start_engine_process
    from infertrace.server.engine_link.runner import _reap

    config = EngineConfig.from_overrides({"kv_cache_tokens": 16384})
    proc, (ours, theirs) = start_engine_process(EngineSpec(str(tiny_model_dir), dataclasses.asdict(config)), 2)
    engine = ProcessEngine(ours)
    reading, done, received = threading.Event(), threading.Event(), []
    reading.set()

    def read_theirs() -> None:  # a front end whose event loop runs while `reading` is set
        reader = FrameReader()
        theirs.settimeout(0.1)
        while not done.is_set():
            if not reading.wait(0.1):
                continue
            try:
                data = theirs.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            received.extend(decode_from_engine(body) for body in reader.feed(data))

    async def stream(request_id: str) -> float:
        started = time.monotonic()
        outs = [out async for out in engine.generate(request_id, [1, 2, 3], SamplingParams(max_tokens=40,
                                                                                            ignore_eos=True))]
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 40
        return time.monotonic() - started

    thread = threading.Thread(target=read_theirs, daemon=True)
    thread.start()
    try:
        await asyncio.wait_for(engine.connect(), 120)
        for i in range(4):
            theirs.sendall(frame(ToEngine("add", request_id=f"{i}-" + "r" * (16 << 10), prompt=[1, 2, 3],
                                          params=SamplingParams(max_tokens=4000, ignore_eos=True))))
        before = await asyncio.wait_for(stream("before"), 60)
        reading.clear()  # SIGSTOP, as the engine sees it
        await asyncio.sleep(2)  # some tens of steps: past every buffer between the engine and it
        after = await asyncio.wait_for(stream("after"), max(30.0, 10 * before))
        reading.set()  # SIGCONT
        await asyncio.sleep(1)
        counts = lambda: [d.num_output_tokens for m in list(received)[1:] for d in m.outputs if d.request_id[0] == "0"]
        resumed_at, deadline = len(counts()), time.monotonic() + 30
        while time.monotonic() < deadline and len(counts()) < resumed_at + 5:
            await asyncio.sleep(0.1)
        assert received[0].kind == "ready" and all(m.kind == "step" for m in received[1:])
        got = counts()
        assert len(got) >= resumed_at + 5 and got == list(range(1, len(got) + 1))  # every step, in order, whole
    finally:
        done.set()
        theirs.close()
        await engine.close()
        thread.join(5)
        await _reap(proc)
    assert after < 2 * before + 1.0, (before, after)


def test_a_front_end_touches_only_its_own_requests_whatever_their_ids():
    """Two front ends' clients pick the same X-Request-Id: both requests run, and one front end's abort of that id
    (its client gone) leaves the other front end's request running to its end."""
    from infertrace.server.engine_link.messages import ToEngine, frame

    engine = _ScriptedEngine(tokens=100, text_bytes=8)
    loop, thread, (victim, other) = _engine_loop(engine, 2)
    try:
        victim.sendall(frame(ToEngine("add", request_id="same", prompt=[1])))
        other.sendall(frame(ToEngine("add", request_id="same", prompt=[1])))
        other.sendall(frame(ToEngine("abort", request_id="same")))
        got = _messages(victim, _finished("same"), deadline_s=20)
        deltas = [d for m in got for d in m.outputs]
        assert [d.finished for d in deltas] == [False] * 99 + [True] and deltas[-1].finish_reason == "length"
        assert {d.request_id for d in deltas} == {"same"}  # each front end hears its own id back
        assert engine.aborted == ["same"] and engine.running == {}  # the other one's, once
    finally:
        victim.close(), other.close()
        thread.join(10)
    assert not thread.is_alive()


async def test_a_refused_request_sends_no_abort_for_its_id():
    """The engine refuses a request (a duplicate id, a bad prompt): its generator closing must not send `abort`
    for that id, which would name whatever else the engine runs under it."""
    import socket

    from infertrace.server.engine_link.client import ProcessEngine
    from infertrace.server.engine_link.messages import FrameReader, FromEngine, decode_to_engine, frame

    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    loop = asyncio.get_running_loop()
    reader, seen = FrameReader(), []

    async def engine_side() -> None:
        await loop.sock_sendall(theirs, frame(FromEngine("ready", value={})))
        while True:
            data = await loop.sock_recv(theirs, 1 << 16)
            if not data:
                return
            for body in reader.feed(data):
                msg = decode_to_engine(body)
                seen.append(msg.kind)
                if msg.kind == "add":
                    await loop.sock_sendall(theirs, frame(FromEngine("refused", request_id=msg.request_id,
                                                                     error={"message": "already in use"})))

    task = asyncio.ensure_future(engine_side())
    engine = ProcessEngine(ours)
    try:
        await asyncio.wait_for(engine.connect(), 10)
        with pytest.raises(ValueError, match="already in use"):
            async for _ in engine.generate("dup", [1], SamplingParams(max_tokens=2)):
                pass
        engine.count({"marker": 1})  # sent after anything the generator's end sent
        for _ in range(500):
            if "count" in seen:
                break
            await asyncio.sleep(0.01)
    finally:
        await engine.close()
        await asyncio.wait_for(task, 10)
        theirs.close()
    assert "add" in seen and "count" in seen and "abort" not in seen
