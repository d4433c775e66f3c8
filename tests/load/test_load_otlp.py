"""bench's OTLP receiver (`--otlp-receiver`), its traceparent and its own spans (`--otlp-traces-endpoint`).

The server's side is a stand-in for vLLM 0.33.0's tracing: an `llm_request` span per finished request with the
attribute names of vllm/tracing/utils.py `SpanAttributes` (vllm/v1/engine/output_processor.py `do_tracing`), under
the incoming traceparent, exported by opentelemetry-sdk's own OTLP exporters (gRPC and HTTP/protobuf) as vLLM's
vllm/tracing/otel.py sets them up.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import time

import pytest
from click.testing import CliRunner

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator  # noqa: E402

from infertrace.load.client import trace_context  # noqa: E402
from infertrace.load.command import bench  # noqa: E402
from infertrace.load.config import parse_receiver_url  # noqa: E402
from infertrace.load.observe import otlp_receiver  # noqa: E402
from infertrace.load.observe.otlp_receiver import SpanReceiver  # noqa: E402
from infertrace.load.records import RequestResult  # noqa: E402
from infertrace.load.results.peer_logs import VLLM_SPAN, PeerRecord, join_results, vllm_proto_record  # noqa: E402
from tests.load.conftest import StandInServer  # noqa: E402

WALL_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receiver(urls: list[str]) -> SpanReceiver:
    return SpanReceiver(urls, VLLM_SPAN, vllm_proto_record)


def _exporter(scheme: str, port: int):
    if scheme == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True, timeout=5)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout=5)


def _vllm_spans(n: int, traceparent: str | None = None) -> list:
    """`n` finished llm_request spans as vLLM makes them, the last one without its request id."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("vllm.llm_engine")
    parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent}) if traceparent else None
    for i in range(n):
        attrs = {"gen_ai.request.id": f"cmpl-run-{i}-0", "gen_ai.latency.time_in_queue": 0.002 * i,
                 "gen_ai.latency.time_in_model_prefill": 0.01, "gen_ai.latency.time_to_first_token": 0.02 + 0.002 * i,
                 "gen_ai.usage.prompt_tokens": 32}
        if i == n - 1:
            del attrs["gen_ai.request.id"]
        tracer.start_span("llm_request", context=parent, attributes=attrs).end()
    tracer.start_span("another_span").end()  # not vLLM's request span: passed over
    return memory.get_finished_spans()


@pytest.mark.parametrize("scheme", ["grpc", "http"])
async def test_the_receiver_takes_vllm_s_spans_over_either_protocol(scheme):
    port = _port()
    receiver = _receiver([f"{scheme}://127.0.0.1:{port}"])
    await receiver.start()
    try:
        parent = trace_context.traceparent("run-0")
        result = await asyncio.to_thread(_exporter(scheme, port).export, _vllm_spans(4, parent))
        assert result.name == "SUCCESS"
        records = await receiver.collect({"run-0", "run-1", "run-2"}, grace_s=5)
    finally:
        await receiver.close()
    assert sorted(r.request_id for r in records) == ["run-0", "run-1", "run-2"]
    first = next(r for r in records if r.request_id == "run-0")
    assert (first.queue, first.prefill, first.ttft) == (0.0, 0.01, 0.02)
    assert (first.trace_id, first.parent_span_id) == trace_context.ids("run-0")
    assert receiver.received.exports == 1 and receiver.received.skipped_spans == 1  # no gen_ai.request.id
    assert "gen_ai.request.id" in receiver.received.first_problem


async def test_collect_stops_at_the_grace_when_a_span_never_comes():
    receiver = _receiver([f"http://127.0.0.1:{_port()}"])
    await receiver.start()
    try:
        started = time.monotonic()
        records = await receiver.collect({"never-sent"}, grace_s=0.3)
        waited = time.monotonic() - started
    finally:
        await receiver.close()
    assert records == [] and 0.3 <= waited < 2
    assert "no OTLP export reached" in receiver.warnings()[0]


async def test_malformed_exports_are_refused_with_the_protocol_s_error_and_counted(monkeypatch):
    import aiohttp
    import grpc

    monkeypatch.setattr(otlp_receiver, "MAX_EXPORT_BYTES", 1 << 16)
    http_port, grpc_port = _port(), _port()
    receiver = _receiver([f"http://127.0.0.1:{http_port}", f"grpc://127.0.0.1:{grpc_port}"])
    await receiver.start()
    url = f"http://127.0.0.1:{http_port}/v1/traces"
    proto = {"Content-Type": "application/x-protobuf"}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, data=b"\xff\xff\xff not protobuf", headers=proto) as r:
                assert r.status == 400
            async with session.post(url, data=b"x" * (1 << 17), headers=proto) as r:  # above the bound
                assert r.status == 413
            bomb = gzip.compress(b"\0" * (1 << 20))  # small on the wire, past the bound once inflated
            async with session.post(url, data=bomb, headers={**proto, "Content-Encoding": "gzip"}) as r:
                assert r.status == 413
            async with session.post(url, data=b"{}", headers={"Content-Type": "application/json"}) as r:
                assert r.status == 415
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await export(b"\xff\xff\xff not protobuf", timeout=5)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as big:
                await export(b"\0" * (1 << 17), timeout=5)
            assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # the receiver still takes a good export after all of that
        assert (await asyncio.to_thread(_exporter("grpc", grpc_port).export, _vllm_spans(2))).name == "SUCCESS"
    finally:
        await receiver.close()
    assert receiver.received.malformed_exports == 4  # two undecodable, two too large over HTTP
    assert [r.request_id for r in await receiver.collect(set(), grace_s=0)] == ["run-0"]


async def test_exports_are_held_in_the_window_and_read_after_it():
    port = _port()
    receiver = _receiver([f"grpc://127.0.0.1:{port}"])
    await receiver.start()
    try:
        await asyncio.to_thread(_exporter("grpc", port).export, _vllm_spans(3))
        assert receiver.received.exports == 1 and receiver.received.records == {}  # parsed, not read
        assert [r.request_id for r in await receiver.collect({"run-0"}, grace_s=5)] == ["run-0", "run-1"]
        # past `collect` the next window holds again
        await asyncio.to_thread(_exporter("grpc", port).export, _vllm_spans(1, trace_context.traceparent("x")))
        assert len(receiver.received.records) == 2
    finally:
        await receiver.close()


async def test_spans_past_the_bound_are_dropped_and_counted(monkeypatch):
    monkeypatch.setattr(otlp_receiver, "MAX_SPANS", 8)
    port = _port()
    receiver = _receiver([f"grpc://127.0.0.1:{port}"])
    await receiver.start()
    try:
        export = _exporter("grpc", port).export
        await asyncio.to_thread(export, _vllm_spans(5))  # six spans, held in the window
        await asyncio.to_thread(export, _vllm_spans(5))  # six more: past the bound, dropped whole
        assert receiver.received.dropped_spans == 6
        await receiver.collect(set(), grace_s=0)
        receiver._reading = True  # after the window, each span read as it comes, and kept to the bound
        await asyncio.to_thread(export, [s for s in _vllm_spans(11) if s.name == "llm_request"][5:10])
    finally:
        await receiver.close()
    assert len(receiver.received.records) == 8 and receiver.received.dropped_spans == 6 + 1
    assert any("past the 8 kept" in w for w in receiver.warnings())


async def test_a_taken_port_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for scheme in ("grpc", "http"):
            with pytest.raises(ValueError, match=f"--otlp-receiver {scheme}://127.0.0.1:{port}: cannot listen"):
                await _receiver([f"{scheme}://127.0.0.1:{port}"]).start()


@pytest.mark.parametrize("url", ["127.0.0.1:4317", "https://127.0.0.1:4317", "grpc://127.0.0.1", "grpc://h:99999",
                                 "http://127.0.0.1:4318/v2/other"])
def test_a_bad_receiver_url_is_refused(url):
    with pytest.raises(ValueError, match="expected grpc://HOST:PORT or http://HOST:PORT"):
        parse_receiver_url(url)


def test_traceparent_is_w3c_and_the_same_ids_as_the_record():
    header = trace_context.traceparent("abc-1")
    version, trace, span, flags = header.split("-")
    assert (version, flags) == ("00", "01") and len(trace) == 32 and len(span) == 16
    assert (trace, span) == trace_context.ids("abc-1") != trace_context.ids("abc-2")
    parsed = TraceContextTextMapPropagator().extract({"traceparent": header})
    from opentelemetry.trace import get_current_span

    context = get_current_span(parsed).get_span_context()
    assert (f"{context.trace_id:032x}", f"{context.span_id:016x}") == (trace, span) and context.is_valid


def _result(i: int, t0: float, ttft: float) -> RequestResult:
    return RequestResult(index=i, scheduled=t0, t0=t0, end=t0 + 0.5, ttft=ttft, e2el=0.5, request_id=f"run-{i}")


def test_the_span_with_more_parts_wins_and_the_other_is_kept():
    from infertrace.load.server_metrics import server_view

    results = [_result(i, 10.0 + i, 0.05) for i in range(3)]
    for r in results[:2]:  # vLLM's in-response metrics on two of them: three parts
        r.server = server_view({"queue_time_ms": 5.0, "time_to_first_token_ms": 20.0}, r.ttft)
    wall = 1_764_250_000.0
    # arrival 1 ms after the send; the front end had the first token 30 ms after arrival: 19 ms left to reach the
    # client
    peer = [PeerRecord(f"run-{i}", wall + 10.0 + i + 0.001, queue=0.005, prefill=0.02, ttft=0.03) for i in (0, 2)]
    summary = join_results(results, peer, "vllm_otlp")
    assert summary["matched"] == summary["explained"] == 2 and summary["offset_consistent"]
    a, b, c = results
    assert a.server["source"] == "vllm_otlp" and a.server["vllm_response"]["queue_time_ms"] == 5.0
    assert len(a.server["ttft_parts"]) == 5
    assert sum(a.server["ttft_parts"].values()) == pytest.approx(a.ttft * 1e3)
    assert b.server["source"] == "vllm_response" and "vllm_otlp" not in b.server  # no span: as it was
    assert c.server["source"] == "vllm_otlp" and "vllm_response" not in c.server
    line = a.to_json()
    assert line["ttft_parts"] == a.server["ttft_parts"] and line["server"]["vllm_response"]["source"] == "vllm_response"


class VllmStandIn(StandInServer):
    """The stand-in server, exporting an llm_request span for each request it served, under its traceparent, to
    `endpoint` over OTLP, from a thread as vLLM's BatchSpanProcessor does."""

    def __init__(self, scheme: str, port: int) -> None:
        super().__init__()
        self.first_token_delay = 0.02
        self.traceparents: list[str | None] = []
        self.exporter = _exporter(scheme, port)
        self.propagator = TraceContextTextMapPropagator()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("vllm.llm_engine")

    async def generate(self, request):
        arrived = time.perf_counter()
        traceparent = request.headers.get("traceparent")
        self.traceparents.append(traceparent)
        resp = await super().generate(request)
        rid = request.headers.get("X-Request-Id")
        attrs = {"gen_ai.request.id": f"cmpl-{rid}-0", "gen_ai.latency.time_in_queue": 0.005,
                 "gen_ai.latency.time_in_model_prefill": 0.01, "gen_ai.latency.time_to_first_token": 0.02,
                 "gen_ai.latency.e2e": time.perf_counter() - arrived}
        asyncio.get_running_loop().run_in_executor(None, self._span, traceparent, arrived, attrs)
        return resp

    def _span(self, traceparent, arrived, attrs):
        parent = self.propagator.extract({"traceparent": traceparent})
        self.tracer.start_span("llm_request", context=parent, start_time=round(arrived * 1e9) + WALL_OFFSET_NS,
                               attributes=attrs).end()


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_bench_joins_the_spans_it_received_to_every_request(prompts_jsonl, tmp_path, scheme):
    port = _port()
    server = VllmStandIn(scheme, port).start()
    lines = tmp_path / "r.jsonl"
    try:
        started = time.monotonic()
        res = CliRunner().invoke(bench, [
            "--base-url", server.url, "--dataset", "jsonl", "--dataset-path", str(prompts_jsonl), "--num-prompts",
            "6", "--concurrency", "2", "--warmup", "1", "--requests-jsonl", str(lines),
            "--result-json", str(tmp_path / "r.json"), "--otlp-receiver", f"{scheme}://127.0.0.1:{port}"],
            catch_exceptions=False)
        took = time.monotonic() - started
    finally:
        server.stop()
        server.provider.shutdown()
    assert res.exit_code == 0, res.output
    assert took < otlp_receiver.SPAN_GRACE_S  # every span came: no grace waited out
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    assert [r["phase"] for r in records] == ["warmup"] + ["measured"] * 6 and len(server.traceparents) == 7
    for r in records:
        assert r["server"]["source"] == "vllm_otlp"
        assert r["server"]["queue_ms"] == pytest.approx(5.0)
        assert sum(r["ttft_parts"].values()) == pytest.approx(r["ttft_ms"])
        assert r["ttft_parts"]["queue"] == pytest.approx(5.0)
        # the traceparent sent is the record's, and the server's span is its child
        assert f"00-{r['trace_id']}-{r['span_id']}-01" in server.traceparents
        assert (r["server"]["trace_id"], r["server"]["parent_span_id"]) == (r["trace_id"], r["span_id"])
    # the result's join and its cohorts are the spans'
    joined = json.loads((tmp_path / "r.json").read_text())["request_log"]
    assert (joined["source"], joined["matched"], joined["explained"]) == ("vllm_otlp", 6, 6)
    assert list(joined["cohorts"]["p50"]["parts_ms"]) == list(records[1]["ttft_parts"])
    assert joined["cohorts"]["p99"]["parts_ms"]["queue"] == pytest.approx(5.0)
    assert "p99 TTFT" in res.stderr  # the tail's finding, from the spans


def test_a_server_that_sends_no_span_costs_the_grace_and_a_warning(standin, prompts_jsonl, tmp_path, monkeypatch):
    monkeypatch.setattr(otlp_receiver, "SPAN_GRACE_S", 0.5)
    lines = tmp_path / "r.jsonl"
    res = CliRunner().invoke(bench, [
        "--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", str(prompts_jsonl), "--num-prompts", "3",
        "--warmup", "0", "--requests-jsonl", str(lines), "--otlp-receiver", f"http://127.0.0.1:{_port()}"])
    assert res.exit_code == 0, res.output
    assert "warning: no OTLP export reached http://127.0.0.1:" in res.stderr
    records = [json.loads(line) for line in lines.read_text().splitlines()]
    assert len(records) == 3 and all("server" not in r and len(r["trace_id"]) == 32 for r in records)


@pytest.mark.parametrize(("args", "message"), [
    (["--otlp-receiver", "tcp://127.0.0.1:1"], "expected grpc://HOST:PORT or http://HOST:PORT"),
    (["--otlp-receiver", "grpc://127.0.0.1:4317", "--otlp-receiver", "http://127.0.0.1:4317"],
     "each URL needs a port of its own"),
    (["--peer-log", "/nonexistent/spans.json"], "--peer-log: cannot read /nonexistent/spans.json"),
])
def test_bad_tracing_options_are_one_line_before_any_request(standin, args, message):
    res = CliRunner().invoke(bench, ["--base-url", standin.url, "--num-prompts", "1", *args])
    assert res.exit_code == 2
    assert message in res.output
    assert standin.count == 0


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_bench_exports_its_request_spans_with_the_ids_it_sent(standin, prompts_jsonl, tmp_path, monkeypatch,
                                                              protocol):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans = []

    class Collector(SpanReceiver):  # every span, not only vLLM's
        def ingest(self, body: bytes):
            request = ExportTraceServiceRequest.FromString(body)
            spans.extend(s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)

    port = _port()
    scheme = "grpc" if protocol == "grpc" else "http"
    collector = Collector([f"{scheme}://127.0.0.1:{port}"], VLLM_SPAN, vllm_proto_record)
    loop = asyncio.new_event_loop()
    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(collector.start(), loop).result(10)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    endpoint = f"127.0.0.1:{port}" if scheme == "grpc" else f"http://127.0.0.1:{port}/v1/traces"
    lines = tmp_path / "r.jsonl"
    standin.mode = lambda i: "500" if i == 3 else "ok"
    before_ns = time.time_ns()
    try:
        res = CliRunner().invoke(bench, [
            "--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", str(prompts_jsonl), "--num-prompts",
            "6", "--warmup", "0", "--requests-jsonl", str(lines), "--otlp-traces-endpoint", endpoint])
    finally:
        asyncio.run_coroutine_threadsafe(collector.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    after_ns = time.time_ns()
    assert res.exit_code == 0, res.output
    assert f"6 request spans exported to {endpoint}" in res.stderr
    records = {r["trace_id"]: r for r in map(json.loads, lines.read_text().splitlines())}
    assert len(spans) == 6 and {s.trace_id.hex() for s in spans} == set(records)
    for span in spans:
        r = records[span.trace_id.hex()]
        assert span.span_id.hex() == r["span_id"] and span.parent_span_id == b"" and span.name == "bench_request"
        assert before_ns <= span.start_time_unix_nano <= span.end_time_unix_nano <= after_ns
        attrs = {kv.key: kv.value for kv in span.attributes}
        assert attrs["gen_ai.request.id"].string_value == r["request_id"]
        if r["success"]:
            first = next(e for e in span.events if e.name == "first_token")
            assert (first.time_unix_nano - span.start_time_unix_nano) / 1e6 == pytest.approx(r["ttft_ms"], abs=1e-3)
            assert attrs["gen_ai.usage.completion_tokens"].int_value == r["output_tokens"]
        else:
            assert span.status.code == 2 and "HTTP 500" in span.status.message  # STATUS_CODE_ERROR


def test_an_unreachable_span_endpoint_costs_a_warning_not_the_run(standin, prompts_jsonl, tmp_path, monkeypatch):
    from infertrace.load.results import spans_out

    monkeypatch.setattr(spans_out, "EXPORT_TIMEOUT_S", 1.0)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    url = f"http://127.0.0.1:{_port()}/v1/traces"
    res = CliRunner().invoke(bench, ["--base-url", standin.url, "--num-prompts", "2", "--warmup", "0",
                                     "--otlp-traces-endpoint", url])
    assert res.exit_code == 0, res.output
    assert f"warning: only 0 of 2 request spans reached {url}" in res.stderr


def test_an_unknown_export_protocol_is_one_line_before_any_request(standin, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    res = CliRunner().invoke(bench, ["--base-url", standin.url, "--num-prompts", "1", "--otlp-traces-endpoint",
                                     "127.0.0.1:4317"])
    assert res.exit_code == 2 and standin.count == 0
    assert res.output.strip() == ("error: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL='http/json': --otlp-traces-endpoint "
                                  "exports with grpc or http/protobuf")
