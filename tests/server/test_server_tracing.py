"""`serve --otlp-traces-endpoint`: each request's spans reach an OTLP receiver, under the client's traceparent."""

from __future__ import annotations

import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infertrace.server.frontend import tracing

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
PHASES = {"tokenize", "queue", "prefill", "decode"}


class _Receiver:
    """An OTLP http/protobuf endpoint on a thread: every span POSTed to /v1/traces, decoded with the protocol
    package."""

    def __init__(self) -> None:
        self.spans: list = []
        self.posts = 0
        spans, receiver = self.spans, self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                ok = self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
                if ok:
                    request = ExportTraceServiceRequest.FromString(body)
                    receiver.posts += 1
                    spans.extend(span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(monkeypatch):
    monkeypatch.setenv(tracing.PROTOCOL_ENV, "http/protobuf")
    monkeypatch.setattr(tracing, "EXPORT_INTERVAL_S", 0.05)
    r = _Receiver()
    yield r
    r.close()


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = ([v.int_value for v in value.array_value.values] if kind == "array_value"
                       else getattr(value, kind))
    return out


async def _complete(client, headers: dict, max_tokens: int = 6) -> dict:
    resp = await client.post("/v1/completions", headers=headers, json={
        "model": "tiny", "prompt": "the spans of one request", "max_tokens": max_tokens, "ignore_eos": True})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_a_request_with_traceparent_is_one_trace_with_its_phases(serve_tiny, receiver):
    traceparent = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
    before_ns = time.time_ns()
    async with serve_tiny(otlp_traces_endpoint=receiver.url) as client:
        body = await _complete(client, {"traceparent": traceparent, "tracestate": "vendor=1",
                                        "X-Request-Id": "traced-1"})
        await _complete(client, {"X-Request-Id": "untraced-1"})
        await _complete(client, {"traceparent": "00-not-a-trace-id-01", "X-Request-Id": "malformed-1"})
        await _complete(client, {"traceparent": f"00-{'0' * 32}-{PARENT_SPAN_ID}-01", "X-Request-Id": "zero-1"})
    after_ns = time.time_ns()

    roots = {_attrs(s)["gen_ai.request.id"]: s for s in receiver.spans if s.name == tracing.SPAN_NAME}
    assert set(roots) == {"traced-1", "untraced-1", "malformed-1", "zero-1"}
    root = roots["traced-1"]
    assert root.trace_id.hex() == TRACE_ID
    assert root.parent_span_id.hex() == PARENT_SPAN_ID
    assert root.trace_state == "vendor=1"
    # without one, and with one the W3C rules reject, the request starts a trace of its own
    for name in ("untraced-1", "malformed-1", "zero-1"):
        assert roots[name].parent_span_id == b""
        assert roots[name].trace_id.hex() not in (TRACE_ID, "0" * 32)
    assert len({s.trace_id for s in roots.values()}) == 4

    # perf_counter times land on the wall clock: the span sits within the test's own reading of it
    assert before_ns <= root.start_time_unix_nano < root.end_time_unix_nano <= after_ns
    attrs = _attrs(root)
    assert attrs["gen_ai.usage.completion_tokens"] == body["usage"]["completion_tokens"] == 6
    assert attrs["gen_ai.usage.prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert attrs["infertrace.finish_reason"] == "length"
    duration_s = (root.end_time_unix_nano - root.start_time_unix_nano) / 1e9
    assert attrs["gen_ai.latency.e2e"] == pytest.approx(duration_s, abs=1e-6)
    assert 0 <= attrs["gen_ai.latency.time_in_queue"] <= attrs["gen_ai.latency.time_to_first_token"] <= duration_s

    children = [s for s in receiver.spans if s.parent_span_id == root.span_id]
    assert {s.name for s in children} == PHASES
    assert all(s.trace_id == root.trace_id for s in children)
    for span in children:  # each phase inside the request, and the phases one after another
        assert root.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
        assert span.end_time_unix_nano <= root.end_time_unix_nano
    ordered = sorted(children, key=lambda s: s.start_time_unix_nano)
    assert all(a.end_time_unix_nano <= b.start_time_unix_nano for a, b in zip(ordered, ordered[1:]))
    assert sum(s.end_time_unix_nano - s.start_time_unix_nano for s in children) <= (
        root.end_time_unix_nano - root.start_time_unix_nano)
    prefill = [_attrs(s) for s in children if s.name == "prefill"]
    decode = [_attrs(s) for s in children if s.name == "decode"]
    assert sum(p["infertrace.tokens"] for p in prefill) == attrs["gen_ai.usage.prompt_tokens"]
    # the prefill's step samples the first token, each decode step one more
    assert sum(d["infertrace.sampled"] for d in decode) + sum(p["infertrace.sampled"] for p in prefill) == 6
    assert decode[0]["infertrace.first_step"] > max(p["infertrace.step"] for p in prefill)
    assert decode[-1]["infertrace.last_step"] == attrs["infertrace.finish_step"]


async def test_an_unreachable_endpoint_costs_requests_nothing_and_warns_once(serve_tiny, monkeypatch, caplog):
    monkeypatch.setenv(tracing.PROTOCOL_ENV, "http/protobuf")
    monkeypatch.setattr(tracing, "EXPORT_INTERVAL_S", 0.05)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger="infertrace.server"):
        async with serve_tiny(otlp_traces_endpoint=f"http://127.0.0.1:{port}/v1/traces") as client:
            for i in range(3):
                await _complete(client, {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}, max_tokens=2)
            await client.state.tracer.export_ready(client.state)
            started = time.monotonic()
        closed_s = time.monotonic() - started
    assert closed_s < tracing.FINAL_FLUSH_S + 2  # the server's exit is not held by the endpoint
    warnings = [r.getMessage() for r in caplog.records if "cannot export request spans" in r.getMessage()]
    assert len(warnings) == 1 and f"127.0.0.1:{port}" in warnings[0]


async def test_spans_go_over_grpc_by_default(serve_tiny, monkeypatch):
    grpc = pytest.importorskip("grpc")
    from concurrent import futures

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    monkeypatch.delenv(tracing.PROTOCOL_ENV, raising=False)
    monkeypatch.setattr(tracing, "EXPORT_INTERVAL_S", 0.05)
    spans = []

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            spans.extend(span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans)
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        async with serve_tiny(otlp_traces_endpoint=f"127.0.0.1:{port}") as client:
            await _complete(client, {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01", "X-Request-Id": "g-1"},
                            max_tokens=2)
    finally:
        server.stop(None)
    root = next(s for s in spans if s.name == tracing.SPAN_NAME)
    assert (_attrs(root)["gen_ai.request.id"], root.trace_id.hex(), root.parent_span_id.hex()) == (
        "g-1", TRACE_ID, PARENT_SPAN_ID)


def test_an_unknown_protocol_is_refused_before_start(monkeypatch):
    monkeypatch.setenv(tracing.PROTOCOL_ENV, "http/json")
    with pytest.raises(ValueError, match="http/json"):
        tracing.check_available()


async def test_without_the_flag_nothing_is_traced_and_otel_is_not_loaded(serve_tiny):
    import subprocess
    import sys

    async with serve_tiny() as client:
        await _complete(client, {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}, max_tokens=1)
        assert client.state.tracer is None
    # serve's start-up imports (the command and the app) leave OpenTelemetry out
    code = ("import sys, infertrace.server.command, infertrace.server.frontend.app; "
            "print(any(m.startswith('opentelemetry') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


async def test_engine_process_requests_seen_in_flight_and_aborted_ones_are_exported(serve_tiny, receiver):
    """As `serve` runs: the engine in its own process. A round that reads a request's record while the request
    still streams moves past it and reads it again alone once it ends; a request its client dropped is exported
    once the engine has its abort."""
    import asyncio

    async with serve_tiny(engine_process=True, otlp_traces_endpoint=receiver.url) as client:
        state = client.state
        state.tracer_task.cancel()  # this test runs the rounds itself
        body = {"model": "tiny", "prompt": "a long one", "max_tokens": 40, "ignore_eos": True, "stream": True}
        resp = await client.post("/v1/completions", headers={"X-Request-Id": "long-1"}, json=body)
        await resp.content.readline()  # its first event: the request is running
        await state.tracer.export_ready(state)
        assert "long-1" in state.tracer.running
        cursor = state.tracer.cursor
        assert cursor > state.tracer.running["long-1"]
        await resp.read()

        dropped = await client.post("/v1/completions", headers={"X-Request-Id": "dropped-1"},
                                    json={**body, "max_tokens": 2000})
        await dropped.content.readline()
        dropped.close()
        for _ in range(200):  # the abort reaches the engine a little after the client left
            await state.tracer.export_ready(state)
            if not state.tracer.pending and not state.in_flight:
                break
            await asyncio.sleep(0.05)
        assert not state.tracer.pending
    roots = {_attrs(s)["gen_ai.request.id"]: _attrs(s) for s in receiver.spans if s.name == tracing.SPAN_NAME}
    assert roots["long-1"]["gen_ai.usage.completion_tokens"] == 40
    assert roots["long-1"]["infertrace.finish_reason"] == "length"
    assert roots["dropped-1"]["infertrace.finish_reason"] == "abort"
    assert roots["dropped-1"]["gen_ai.usage.completion_tokens"] < 2000


def test_the_flag_is_in_serve_help_and_a_bad_protocol_is_one_line(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from infertrace.server.command import serve

    assert "--otlp-traces-endpoint" in CliRunner().invoke(serve, ["--help"]).output
    monkeypatch.setenv(tracing.PROTOCOL_ENV, "http/json")
    result = CliRunner().invoke(serve, ["--model", str(tmp_path), "--otlp-traces-endpoint", "localhost:4317"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json' is not an OTLP protocol serve exports with: use grpc "
        "or http/protobuf"]


def test_bench_s_traceparent_parents_serve_s_spans_received_by_bench(tiny_model_dir, tmp_path):
    """`infertrace serve --otlp-traces-endpoint` pointed at `infertrace bench --otlp-receiver`: every request's
    llm_request span is the child of the traceparent bench sent, in bench's trace, and joined to its record."""
    import json

    from click.testing import CliRunner

    from infertrace.load.command import bench
    from tests.load.conftest import free_port, serve_subprocess

    otlp_port = free_port()
    lines = tmp_path / "r.jsonl"
    with serve_subprocess(tiny_model_dir, tmp_path, "--otlp-traces-endpoint",
                          f"http://127.0.0.1:{otlp_port}/v1/traces",
                          env={tracing.PROTOCOL_ENV: "http/protobuf"}) as url:
        res = CliRunner().invoke(bench, [
            "--base-url", url, "--model", str(tiny_model_dir), "--num-prompts", "8", "--concurrency", "4",
            "--input-len", "16", "--output-len", "4", "--warmup", "1", "--requests-jsonl", str(lines),
            "--result-json", str(tmp_path / "r.json"), "--otlp-receiver", f"http://127.0.0.1:{otlp_port}"],
            catch_exceptions=False)
    assert res.exit_code == 0, res.output
    records = [json.loads(x) for x in lines.read_text().splitlines() if json.loads(x)["phase"] == "measured"]
    assert len(records) == 8
    for r in records:
        # serve's request log tells more (six parts and its steps) and stays on top; the span is joined inside it
        assert len(r["ttft_parts"]) == 6
        span = r["server"]["vllm_otlp"]
        assert (span["trace_id"], span["parent_span_id"]) == (r["trace_id"], r["span_id"])
        assert span["figures"]["gen_ai.request.id"] == r["request_id"]
        assert span["queue_ms"] is not None and span["ttft_ms"] <= r["ttft_ms"]
    joined = json.loads((tmp_path / "r.json").read_text())["request_log"]
    assert joined["source"] == "infertrace" and joined["vllm_otlp"]["matched"] == 8
