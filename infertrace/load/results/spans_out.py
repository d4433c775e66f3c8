"""bench's own span of each measured request, exported over OTLP after the run (`--otlp-traces-endpoint`), with the
trace and span ids its `traceparent` carried (load/client/trace_context.py): the server's span of the request
(vLLM's `llm_request`, infertrace serve's) is then its child, and one request is one trace in any OTLP backend.

A span runs from the send to the stream's close, with events at the first and the last token. Its times are the
run's clock (perf_counter seconds, CLOCK_MONOTONIC); OTLP's are nanoseconds of the epoch: one offset
(`time.time_ns() - time.perf_counter_ns()`) taken before the measured window converts them all, so the spans keep
the client's exact durations and order even if the wall clock steps during the run.

Nothing is exported inside the measured window: the spans are made from the RequestResults once it is over, and
OpenTelemetry is imported only then.
"""

from __future__ import annotations

import logging
import os
import time

from infertrace.load.records import RequestResult

# as vLLM 0.33.0 (vllm/tracing/otel.py `get_span_exporter`): the protocol from this variable, grpc by default
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("grpc", "http/protobuf")
SPAN_NAME = "bench_request"
INSTRUMENTATION = "infertrace.bench"
BATCH = 512  # spans a call: the SDK's own export batch
EXPORT_TIMEOUT_S = 10.0  # one batch, retries included; an endpoint that does not answer costs at most this once


def protocol() -> str:
    """The OTLP protocol asked for; ValueError for one vLLM does not take."""
    value = os.environ.get(PROTOCOL_ENV, "grpc")
    if value not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_ENV}={value!r}: --otlp-traces-endpoint exports with {' or '.join(PROTOCOLS)}")
    return value


def epoch_offset_ns() -> int:
    """Nanoseconds to add to perf_counter nanoseconds for the epoch's."""
    return time.time_ns() - time.perf_counter_ns()


def spans(results: list[RequestResult], offset_ns: int) -> list:
    """One ReadableSpan per result sent with a trace context."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    resource = Resource.create({"service.name": "infertrace-bench", "process.pid": os.getpid()})
    scope = InstrumentationScope(INSTRUMENTATION)

    def ns(t: float) -> int:
        return round(t * 1e9) + offset_ns

    out = []
    for r in results:
        if r.trace_id is None or r.span_id is None:
            continue
        context = SpanContext(int(r.trace_id, 16), int(r.span_id, 16), is_remote=False,
                              trace_flags=TraceFlags(TraceFlags.SAMPLED))
        events = []
        if r.ttft is not None:
            events.append(Event("first_token", timestamp=ns(r.t0 + r.ttft)))
        if r.e2el is not None:
            events.append(Event("last_token", timestamp=ns(r.t0 + r.e2el)))
        attributes = {"gen_ai.request.id": r.request_id, "infertrace.index": r.index,
                      "gen_ai.usage.prompt_tokens": r.prompt_tokens, "gen_ai.usage.completion_tokens": r.output_tokens,
                      "infertrace.ttft_ms": None if r.ttft is None else r.ttft * 1e3,
                      "infertrace.schedule_lag_ms": r.schedule_lag * 1e3, "infertrace.finish_reason": r.finish_reason,
                      "infertrace.success": r.success, "error.type": r.error.split(":", 1)[0] if r.error else None,
                      "infertrace.error": r.error}
        status = Status(StatusCode.ERROR, r.error) if r.error else Status(StatusCode.OK)
        out.append(ReadableSpan(SPAN_NAME, context, kind=SpanKind.CLIENT, resource=resource,
                                attributes={k: v for k, v in attributes.items() if v is not None}, events=events,
                                status=status, start_time=ns(r.t0), end_time=ns(max(r.t0, r.end)),
                                instrumentation_scope=scope))
    return out


def export(endpoint: str, results: list[RequestResult], offset_ns: int) -> str:
    """Send the results' spans to `endpoint`, batch by batch; one line saying what left (an endpoint that cannot be
    reached costs the spans, never the run)."""
    made = spans(results, offset_ns)
    if not made:
        return "no request span to export (no request went with a traceparent)"
    name = protocol()
    if name == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=EXPORT_TIMEOUT_S)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
    logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)  # the line returned says it once
    sent = 0
    try:
        for at in range(0, len(made), BATCH):
            batch = made[at:at + BATCH]
            try:
                ok = exporter.export(batch).name == "SUCCESS"
            except Exception:  # noqa: BLE001 - the exporter should not raise; if it does, the spans are lost
                ok = False
            if not ok:
                break
            sent += len(batch)
    finally:
        exporter.shutdown()
    if sent < len(made):
        return f"warning: only {sent} of {len(made)} request spans reached {endpoint} ({name})"
    return f"{sent} request spans exported to {endpoint} ({name})"
