"""The engine in a process of its own: the same answers as the engine on a thread, a torch-free front end, and
the process lifecycle (drain, engine death, front-end death, several front ends on one port)."""

from __future__ import annotations

import asyncio
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


async def test_metrics_and_server_info_report_the_engine_process(serve_tiny, metrics_of):
    async with serve_tiny(engine_process=True) as client:
        ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True})
        assert ok.status == 200
        info = await (await client.get("/server_info")).json()
        metrics = await metrics_of(client)
    assert info["engine_pid"] == client.engine_proc.pid
    assert info["frontend"] == {"pid": os.getpid(), "index": 0, "count": 1, "engine_in_process": False}
    assert info["engine_config"]["kv_cache_tokens"] == 16384 and info["versions"]["torch"]
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


def test_frame_reader_splits_frames_across_chunks():
    from infertrace.server.messages import FrameReader, FromEngine, decode_from_engine, frame

    data = b"".join(frame(FromEngine("reply", call_id=i, value={"n": i})) for i in range(5))
    reader, got = FrameReader(), []
    for k in range(0, len(data), 3):
        got += [decode_from_engine(b) for b in reader.feed(data[k:k + 3])]
    assert [(m.kind, m.call_id, m.value) for m in got] == [("reply", i, {"n": i}) for i in range(5)]


def test_chat_templates_render_as_transformers_renders_them(tiny_model_dir):
    from transformers import AutoTokenizer

    from infertrace.server.frontend_tokenizer import FrontendTokenizer

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
            "import infertrace.cli, infertrace.server.command, infertrace.server.runner, infertrace.server.app\n"
            "from infertrace.server.frontend_tokenizer import FrontendTokenizer\n"
            f"t = FrontendTokenizer({str(tiny_model_dir)!r})\n"
            "t.encode(t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ----- `infertrace serve` as a process tree -----
class Served:
    def __init__(self, model_dir: Path, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "infertrace", "serve", "--model", str(model_dir),
                                      "--port", "0", "--kv-cache-tokens", "16384", *args],
                                     stderr=subprocess.PIPE, text=True)
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
    assert "Error: the engine process is gone (the engine process was killed by SIGKILL)" in log


@pytest.mark.slow
def test_a_sigkilled_front_end_leaves_no_engine_behind(tiny_model_dir):
    served = Served(tiny_model_dir, "--api-server-count", "2")
    children = [int(p) for p in Path(f"/proc/{served.proc.pid}/task/{served.proc.pid}/children").read_text().split()]
    assert served.engine_pid in children and len(children) >= 2
    served.proc.kill()
    served.proc.wait(10)
    assert all(_gone(pid) for pid in children), [Path(f"/proc/{p}/cmdline").read_bytes() for p in children]


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
    from infertrace.server import app

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
