"""vLLM's and SGLang's own per-request timings, read from stand-ins that speak their formats, and joined to bench's
records by id: the offset between the clocks, and each TTFT in parts that add up to it.

Stand-ins: vLLM 0.33.0's `llm_request` span as vllm/v1/engine/output_processor.py `do_tracing` builds it (attribute
names from vllm/tracing/utils.py `SpanAttributes`), exported as OTLP JSON by an OpenTelemetry collector's `file`
exporter; SGLang 0.5.23's `ReqTimeStats` log line as sglang/srt/managers/schedule_batch.py `log_time_stats` writes
it with sglang/srt/observability/req_time_stats.py `convert_to_duration` (NULL disaggregation: "unified").
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from infertrace.load.client.http_target import HttpTarget
from infertrace.load.command import bench
from infertrace.load.records import RequestSpec
from infertrace.load.results.peer_logs import join_peer, read_peer_log, read_sglang_log, read_vllm_otlp
from tests.load.conftest import StandInServer

WALL = 1_764_250_000.0  # the servers' wall clock at the client's origin (client clock 0)
# per request: client send (s), one-way up and down (s), queue, prefill (s), the front end's share before the queue
REQUESTS = [(0.00, 0.0010, 0.0012, 0.004, 0.030, 0.0020), (0.25, 0.0008, 0.0015, 0.120, 0.031, 0.0021),
            (0.50, 0.0012, 0.0009, 0.000, 0.029, 0.0019)]


def _client_records():
    out = []
    for i, (t0, up, down, queue, prefill, front) in enumerate(REQUESTS):
        ttft = up + front + queue + prefill + down
        out.append({"phase": "measured", "request_id": f"run-{i}", "t0_s": t0, "ttft_ms": ttft * 1e3,
                    "end_s": t0 + ttft + 0.5})
    return out


def _vllm_span(i, t0, up, down, queue, prefill, front):
    def dbl(key, v):
        return {"key": key, "value": {"doubleValue": v}}

    arrival = WALL + t0 + up
    return {"traceId": "0" * 32, "spanId": f"{i:016x}", "name": "llm_request", "kind": 2,
            "startTimeUnixNano": str(int(arrival * 1e9)), "endTimeUnixNano": str(int((arrival + 1) * 1e9)),
            "attributes": [dbl("gen_ai.latency.time_to_first_token", front + queue + prefill),
                           dbl("gen_ai.latency.e2e", 1.0), dbl("gen_ai.latency.time_in_queue", queue),
                           {"key": "gen_ai.usage.prompt_tokens", "value": {"intValue": "512"}},
                           {"key": "gen_ai.usage.completion_tokens", "value": {"intValue": "128"}},
                           dbl("gen_ai.latency.time_in_model_prefill", prefill),
                           dbl("gen_ai.latency.time_in_model_decode", 0.9),
                           dbl("gen_ai.latency.time_in_model_inference", 0.93),
                           {"key": "gen_ai.request.id", "value": {"stringValue": f"cmpl-run-{i}-0"}}]}


def _otlp_file(tmp_path: Path) -> Path:
    path = tmp_path / "spans.json"
    lines = []
    for i, row in enumerate(REQUESTS):  # one export request a line, as the collector's file exporter writes
        lines.append(json.dumps({"resourceSpans": [{"resource": {"attributes": []}, "scopeSpans": [
            {"scope": {"name": "vllm.llm_engine"}, "spans": [_vllm_span(i, *row)]}]}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_vllm_spans_join_by_the_x_request_id_inside_vllm_s_request_id(tmp_path):
    spans = read_vllm_otlp(_otlp_file(tmp_path)).records
    assert [s.request_id for s in spans] == ["run-0", "run-1", "run-2"]
    records = _client_records()
    summary = join_peer(records, spans, "vllm")
    assert summary["matched"] == summary["explained"] == 3 and summary["offset_consistent"]
    # the offset is the wall clock at the origin, within the fastest one-way trips (0.8 ms up, 0.9 ms down)
    assert summary["offset_ms"] == pytest.approx(WALL * 1e3, abs=1.0)
    assert summary["offset_error_ms"] <= 0.9
    for r, (_, _, _, queue, prefill, _) in zip(records, REQUESTS):
        parts = r["ttft_parts"]
        assert sum(parts.values()) == pytest.approx(r["ttft_ms"])
        assert parts["queue"] == pytest.approx(queue * 1e3) and parts["prefill_steps"] == pytest.approx(prefill * 1e3)
        assert min(parts.values()) >= -summary["offset_error_ms"] - 1e-6
    assert records[1]["server"]["figures"]["gen_ai.usage.prompt_tokens"] == 512


def _sglang_log(tmp_path: Path) -> Path:
    lines = ["[2026-11-27 14:00:00] INFO:     127.0.0.1:5000 - \"POST /v1/completions HTTP/1.1\" 200 OK"]
    for i, (t0, up, _, queue, prefill, front) in enumerate(REQUESTS):
        entry = WALL + t0 + up + front
        lines.append(f"[2026-11-27 14:00:0{i} TP0] ReqTimeStats(rid=run-{i}, input_len=512, cached_input_len=0, "
                     f"output_len=128, attempts=1, type=unified): queue_duration={queue * 1e3:.2f}ms, "
                     f"forward_duration={(prefill + 0.4) * 1e3:.2f}ms, entry_time={entry:.3f}")
    path = tmp_path / "sglang.log"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sglang_log_lines_give_the_queue_part(tmp_path):
    lines = read_sglang_log(_sglang_log(tmp_path)).records
    assert [(x.request_id, x.figures["input_len"]) for x in lines] == [(f"run-{i}", 512) for i in range(3)]
    records = _client_records()
    summary = join_peer(records, lines, "sglang")
    assert summary["explained"] == 3 and summary["offset_consistent"]
    for r, (_, _, _, queue, _, _) in zip(records, REQUESTS):
        parts = r["ttft_parts"]
        assert set(parts) == {"network_and_frontend", "queue", "prefill_and_first_token_send"}
        assert sum(parts.values()) == pytest.approx(r["ttft_ms"]) and parts["queue"] == pytest.approx(queue * 1e3,
                                                                                                      abs=0.01)


def test_which_peer_a_file_holds(tmp_path):
    assert read_peer_log(_otlp_file(tmp_path)).source == "vllm"
    assert read_peer_log(_sglang_log(tmp_path)).source == "sglang"
    junk = tmp_path / "junk.log"
    junk.write_text("nothing here\n")
    with pytest.raises(ValueError, match="neither vLLM"):
        read_peer_log(junk)


def test_sglang_gets_the_id_in_the_body_others_do_not():
    target = HttpTarget("http://x", "completions", "m", transport=None)
    spec = RequestSpec(0, "hi", 4, request_id="run-7")
    assert "rid" not in target.body(spec)
    target.server_info = {"endpoint": "/server_info", "body": {"internal_states": [{}], "version": "0.5.23"}}
    assert target.body(spec)["rid"] == "run-7"


# ----- hostile files: linear time, one line of error, no NaN, a bad entry skipped rather than the file -----
def _attr(key, value):
    return {"key": key, "value": value}


BAD_SPANS = [
    "a span",
    {"name": "llm_request", "attributes": 5, "startTimeUnixNano": "1"},
    {"name": "llm_request", "attributes": [{"value": {"stringValue": "x"}}], "startTimeUnixNano": "1"},
    {"name": "llm_request", "attributes": [_attr("gen_ai.request.id", {"intValue": "7"})], "startTimeUnixNano": "1"},
    {"name": "llm_request", "attributes": [_attr("gen_ai.request.id", {"stringValue": "cmpl-run-9-0"})],
     "startTimeUnixNano": "soon"},
    {"name": "llm_request", "attributes": [_attr("gen_ai.request.id", {"stringValue": "cmpl-run-9-0"}),
                                           _attr("gen_ai.latency.time_in_queue", {"doubleValue": "NaN"})],
     "startTimeUnixNano": "1"},
    {"name": "llm_request", "attributes": [_attr("gen_ai.request.id", {"stringValue": "cmpl-run-9-0"}),
                                           _attr("gen_ai.latency.e2e", {"doubleValue": 1e308 * 10})],
     "startTimeUnixNano": "1"},
    {"name": "llm_request", "attributes": [_attr("gen_ai.request.id", {"stringValue": "cmpl-run-9-0"})],
     "startTimeUnixNano": "9" * 5000},
]


def _hostile_otlp(tmp_path: Path) -> Path:
    path = _otlp_file(tmp_path)
    extra = [{"resourceSpans": [{"scopeSpans": [{"spans": BAD_SPANS}]}]}, {"resourceSpans": "none"},
             {"resourceSpans": [{"scopeSpans": [{"spans": [_vllm_span(5, *REQUESTS[0]) | {"attributes": [
                 *_vllm_span(5, *REQUESTS[0])["attributes"], _attr("gen_ai.usage.prompt_tokens",
                                                                    {"intValue": "9" * 5000})]}]}]}]}]
    path.write_text(path.read_text() + "".join(json.dumps(x).replace("Infinity", "1e999") + "\n" for x in extra)
                    + "[" * 100_000 + "\n")
    return path


def test_a_malformed_span_is_skipped_and_counted_not_the_file(tmp_path):
    log = read_peer_log(_hostile_otlp(tmp_path))
    assert log.source == "vllm" and log.skipped == len(BAD_SPANS)
    assert [r.request_id for r in log.records] == ["run-0", "run-1", "run-2", "run-5"]
    assert log.records[3].figures.get("gen_ai.usage.prompt_tokens") is None  # 5,000 digits: not a count


BAD_SGLANG = [
    "ReqTimeStats(rid=run-7, input_len=512, cached_input_len=0, output_len=1, attempts=1, type=unified)",
    "ReqTimeStats(rid=run-7, input_len=512, cached_input_len=0, output_len=1, attempts=1, type=unified): "
    "queue_duration=nanms, forward_duration=1.0ms, entry_time=1764250000.1",
    "ReqTimeStats(rid=run-7, input_len=" + "9" * 5000 + ", cached_input_len=0, output_len=1, attempts=1, "
    "type=unified): queue_duration=1.0ms, forward_duration=1.0ms, entry_time=1764250000.1",
    "ReqTimeStats(rid=run-7, input_len=512, cached_input_len=0, output_len=1, attempts=1, type=unified): "
    "queue_duration=1.0ms, forward_duration=1.0ms, entry_time=1e400",
    "ReqTimeStats(rid=run-7, input_len=512, type=unified): queue_duration=1.0ms",
]


def test_a_malformed_sglang_line_is_skipped_and_counted(tmp_path):
    path = _sglang_log(tmp_path)
    path.write_text(path.read_text() + "\n".join(BAD_SGLANG) + "\n")
    log = read_sglang_log(path)
    assert len(log.records) == 3 and log.skipped == len(BAD_SGLANG)
    assert "run-7" in log.first_problem or "without" in log.first_problem


def test_a_long_sglang_line_parses_in_linear_time(tmp_path):
    # a backtracking pattern took 243 s on one 66 KB line of repeated fields; this one has 200 KB
    path = tmp_path / "long.log"
    path.write_text("ReqTimeStats(rid=a, input_len=1, cached_input_len=1, output_len=1, " * 2900 + "\n"
                    + "x ReqTimeStats(rid=" + "a," * 100_000 + "\n")
    child = ("import sys, time\n"
             "from infertrace.load.results.peer_logs import read_sglang_log\n"
             "t = time.perf_counter(); log = read_sglang_log(sys.argv[1])\n"
             "print(len(log.records), log.skipped, time.perf_counter() - t)\n")
    import subprocess

    done = subprocess.run([sys.executable, "-c", child, str(path)], capture_output=True, text=True, timeout=60)
    records, skipped, seconds = done.stdout.split()
    assert (records, skipped) == ("0", "2") and float(seconds) < 0.5


class PeerStandIn(StandInServer):
    """The stand-in server writing its own record of each request it served to `path` as it ends, on its wall
    clock: vLLM's llm_request span as one OTLP JSON export a line (a collector's file exporter), or SGLang's
    ReqTimeStats line."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__()
        self.first_token_delay = 0.02
        self.path, self.kind = path, kind
        path.write_text("")

    async def generate(self, request):
        arrived = time.time()
        resp = await super().generate(request)
        rid = request.headers.get("X-Request-Id")
        if self.kind == "vllm":
            span = _vllm_span(0, arrived - WALL, 0.0, 0.0, 0.005, 0.01, 0.004)
            span["attributes"][-1] = {"key": "gen_ai.request.id", "value": {"stringValue": f"cmpl-{rid}-0"}}
            span["startTimeUnixNano"] = str(int(arrived * 1e9))
            line = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]})
        else:
            line = (f"[2026-12-06] INFO ReqTimeStats(rid={rid}, input_len=5, cached_input_len=0, output_len=4, "
                    f"attempts=1, type=unified): queue_duration=5.00ms, "
                    f"forward_duration={(time.time() - arrived) * 1e3 - 5:.3f}ms, "
                    f"entry_time={arrived:.6f}")
        with self.path.open("a") as f:
            f.write(line + "\n")
        return resp


def _bench_peer_log(server, prompts_jsonl, tmp_path, peer_log):
    lines = tmp_path / "r.jsonl"
    res = CliRunner().invoke(bench, [
        "--base-url", server.url, "--dataset", "jsonl", "--dataset-path", str(prompts_jsonl), "--num-prompts", "6",
        "--concurrency", "2", "--warmup", "0", "--requests-jsonl", str(lines), "--result-json",
        str(tmp_path / "r.json"), "--peer-log", str(peer_log)])
    records = [json.loads(x) for x in lines.read_text().splitlines()] if lines.exists() else []
    doc = json.loads((tmp_path / "r.json").read_text()) if (tmp_path / "r.json").exists() else None
    return res, records, doc


@pytest.mark.parametrize(("kind", "parts"), [
    ("vllm", {"network_and_frontend", "frontend_and_handoff", "queue", "prefill_steps", "first_token_send"}),
    ("sglang", {"network_and_frontend", "queue", "prefill_and_first_token_send"})])
def test_bench_joins_the_peer_s_file_after_the_run(prompts_jsonl, tmp_path, kind, parts):
    server = PeerStandIn(tmp_path / f"{kind}.log", kind).start()
    try:
        res, records, doc = _bench_peer_log(server, prompts_jsonl, tmp_path, server.path)
    finally:
        server.stop()
    assert res.exit_code == 0, res.output
    assert len(records) == 6
    for r in records:
        assert r["server"]["source"] == kind and set(r["ttft_parts"]) == parts
        assert sum(r["ttft_parts"].values()) == pytest.approx(r["ttft_ms"])
        assert r["ttft_parts"]["queue"] == pytest.approx(5.0)
    joined = doc["request_log"]
    assert (joined["source"], joined["matched"], joined["explained"]) == (kind, 6, 6)
    assert set(joined["cohorts"]["p99"]["parts_ms"]) == parts


def test_bench_skips_and_counts_a_hostile_peer_log_and_writes_no_nan(prompts_jsonl, tmp_path):
    server = PeerStandIn(tmp_path / "vllm.log", "vllm").start()
    try:
        hostile = _hostile_otlp(tmp_path)  # runs of other requests' spans, broken spans, deep nesting
        server.path.write_text(hostile.read_text())
        res, records, doc = _bench_peer_log(server, prompts_jsonl, tmp_path, server.path)
    finally:
        server.stop()
    assert res.exit_code == 0, res.output
    assert f"--peer-log: {len(BAD_SPANS)} malformed vllm entries skipped" in res.stderr
    assert all(r["server"]["source"] == "vllm" for r in records) and doc["request_log"]["explained"] == 6
    assert "NaN" not in (tmp_path / "r.jsonl").read_text()


@pytest.mark.parametrize("where", ["dir", "fifo", "missing"])
def test_a_peer_log_that_cannot_be_read_is_one_line_before_the_run(standin, tmp_path, where):
    import os

    path = tmp_path / "peer.log"
    if where == "dir":
        path = tmp_path
    elif where == "fifo":
        os.mkfifo(path)
    res = CliRunner().invoke(bench, ["--base-url", standin.url, "--num-prompts", "1", "--peer-log", str(path)])
    assert res.exit_code == 2 and standin.count == 0
    if where == "dir":  # click's own check of the flag
        assert "Invalid value for '--peer-log'" in res.output and "is a directory" in res.output
    else:
        assert res.output.startswith("error: --peer-log: cannot read ") and res.output.count("\n") == 1


def test_a_peer_log_of_neither_kind_costs_a_warning_not_the_run(standin, prompts_jsonl, tmp_path):
    junk = tmp_path / "junk.log"
    junk.write_bytes(b"\xff\xfe\x00" * 100)
    res, records, doc = _bench_peer_log(standin, prompts_jsonl, tmp_path, junk)
    assert res.exit_code == 0, res.output
    assert "warning: --peer-log: " in res.stderr and len(records) == 6
    assert doc["request_log"]["matched"] == 0
