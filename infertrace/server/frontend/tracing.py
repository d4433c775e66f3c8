"""Each request's life as OpenTelemetry spans (`--otlp-traces-endpoint`): one `llm_request` span, as vLLM exports,
with child spans for its phases (tokenize, queue, each prefill step, each run of decode steps), under the client's
W3C `traceparent` when it sent one.

The spans are built from the request log, not timed anew: when a request ends the front end notes its id and
trace headers; a background task reads the log's new pages (paced like any reader, `ServerState.read_request_log`)
and a thread of its own turns each finished request's record into spans, which the SDK's BatchSpanProcessor
exports from its thread. Neither the event loop nor the engine's loop waits on the network.

The log's times are `time.perf_counter()` seconds (CLOCK_MONOTONIC); a span's are nanoseconds of the epoch. One
offset (`time.time_ns() - time.perf_counter_ns()`) taken when the tracer starts converts them, so a trace's spans
keep the log's exact durations and order, and the wall clock stepping later (NTP) does not tear a request apart.

OpenTelemetry is imported only here and only when the flag is given, so `serve` starts as fast without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from infertrace.server.frontend.request_log import MAX_PAGE_BYTES, MAX_PAGE_REQUESTS

log = logging.getLogger("infertrace.server")

# vLLM 0.33: vllm/tracing/otel.py (`get_span_exporter`) reads the protocol from this variable, grpc by default,
# and exports `llm_request` spans with the attribute names of vllm/tracing/utils.py (`SpanAttributes`), made in
# vllm/v1/engine/output_processor.py (`do_tracing`; latencies in seconds).
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "grpc"
SPAN_NAME = "llm_request"
INSTRUMENTATION = "infertrace.server"
EXPORT_INTERVAL_S = 1.0  # how often ended requests are looked up in the log: a span is late by at most this
PENDING_TTL_S = 120.0  # a request the log never shows (refused before the engine took it) is forgotten after this
MAX_PENDING = 100_000  # ended requests awaiting export; past it the oldest are dropped (a stuck engine)
# One page of the log (up to 1,000 requests, about 5 spans each) is made at once: the SDK's default queue (2,048
# spans) would drop part of it before the exporter's thread wakes; a slow endpoint still drops the excess.
MAX_QUEUED_SPANS = 8192
FINAL_FLUSH_S = 5.0  # on shutdown, how long the last requests' spans may take to leave


def protocol() -> str:
    """The OTLP protocol asked for (vLLM's variable and default); ValueError for one vLLM does not take."""
    value = os.environ.get(PROTOCOL_ENV, DEFAULT_PROTOCOL)
    if value not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_ENV}={value!r} is not an OTLP protocol serve exports with: use "
                         f"{' or '.join(PROTOCOLS)}")
    return value


def check_available() -> None:
    """ValueError naming what is missing when the flag is given without the OpenTelemetry packages."""
    protocol()
    try:
        _exporter_class(protocol())
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--otlp-traces-endpoint needs the OpenTelemetry packages (opentelemetry-sdk, "
                         f"opentelemetry-exporter-otlp-proto-grpc and -http): {e}") from None


def _exporter_class(name: str):
    if name == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter


class _WarnOnce:
    """The OTLP exporter, saying once that the endpoint cannot be reached instead of a warning per batch (the
    exporter's own retry lines are silenced); spans that cannot leave are dropped, never retried without end."""

    def __init__(self, exporter: Any, endpoint: str) -> None:
        self.exporter = exporter
        self.endpoint = endpoint
        self.warned = False

    def export(self, spans):
        try:
            result = self.exporter.export(spans)
        except Exception as e:  # the exporter should not raise; if it does, the spans are lost, not the thread
            result, why = None, f"{type(e).__name__}: {e}"
        else:
            why = "the export failed"
        if result is None or result.name != "SUCCESS":
            self.warn(why)
            from opentelemetry.sdk.trace.export import SpanExportResult

            return SpanExportResult.FAILURE
        return result

    def warn(self, why: str) -> None:
        if not self.warned:
            self.warned = True
            log.warning("cannot export request spans to %s (%s); spans are dropped while it cannot be reached",
                        self.endpoint, why)

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.exporter.force_flush(timeout_millis)


class RequestTracer:
    """Exports the spans of the requests this front end served. `ended` is called on the event loop (a dict
    insert); `run` is the background task; `close` exports what is left and stops the exporter."""

    def __init__(self, endpoint: str, served_model_name: str, frontend_index: int = 0) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        name = protocol()
        # as vLLM's get_span_exporter: gRPC without TLS, HTTP at the URL as given (the collector's .../v1/traces)
        exporter = (_exporter_class(name)(endpoint=endpoint, insecure=True) if name == "grpc"
                    else _exporter_class(name)(endpoint=endpoint))
        logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)  # _WarnOnce says it once
        self.exporter = _WarnOnce(exporter, endpoint)
        self.provider = TracerProvider(resource=Resource.create({
            "service.name": "infertrace", "infertrace.frontend": frontend_index, "process.pid": os.getpid()}))
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter, max_queue_size=MAX_QUEUED_SPANS))
        self.tracer = self.provider.get_tracer(INSTRUMENTATION)
        self.propagator = TraceContextTextMapPropagator()
        self.model = served_model_name
        self.offset_ns = time.time_ns() - time.perf_counter_ns()  # perf_counter -> epoch, once (module docstring)
        self.pending: dict[str, _Ended] = {}  # by request id: ended here, spans not yet made
        self.running: dict[str, int] = {}  # request id -> log number of this front end's requests seen in flight
        # the log's number from which new records are read: from its oldest at first, as the front end starts with
        # the engine and a request may end before the first read
        self.cursor = 0
        self.log_off_warned = False
        self.dropped = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="infertrace-spans")

    def ended(self, request_id: str, times: Mapping[str, float], headers: Mapping[str, str]) -> None:
        """A request this front end answered (called on the event loop, after its stamps went to the log): its
        spans go out once the log holds its whole record."""
        self.pending[request_id] = _Ended(times.get("received"), headers.get("traceparent"),
                                          headers.get("tracestate"), time.monotonic(),
                                          self.running.pop(request_id, None))
        if len(self.pending) > MAX_PENDING:
            del self.pending[next(iter(self.pending))]
            self.dropped += 1

    async def run(self, state: Any) -> None:
        """Every EXPORT_INTERVAL_S, look the ended requests up in the log and export them."""
        while True:
            await asyncio.sleep(EXPORT_INTERVAL_S)
            try:
                await self.export_ready(state)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a dead engine, a read timeout: the next round tries again
                log.debug("request spans not exported this round: %s", e)

    async def export_ready(self, state: Any) -> int:
        """Export every ended request the log holds finished; the number exported.

        The log is read once, from where the last round stopped to its end. A record of a request still in flight
        here is remembered by its number, and read again alone once the request has ended, so a long request
        never makes a round read the log again from its start."""
        self._expire(state.in_flight)
        exported = 0
        while True:
            page = await state.read_request_log({"since": self.cursor, "limit": MAX_PAGE_REQUESTS,
                                                 "max_bytes": MAX_PAGE_BYTES})
            if page is None:
                return self._log_off()
            if not page["requests"]:
                break
            exported += await self._export_page(page, state.in_flight)
            self.cursor = page["next"]
        for seq in sorted({e.seq for e in self.pending.values() if e.seq is not None and e.seq < self.cursor}):
            page = await state.read_request_log({"since": seq, "limit": 1, "max_bytes": MAX_PAGE_BYTES})
            if page is None:
                return self._log_off()
            if not page["requests"] or page["requests"][0]["seq"] != seq:  # gone from the log's ring
                self._forget(seq)
                continue
            exported += await self._export_page(page, state.in_flight)
        return exported

    async def _export_page(self, page: dict, in_flight: set[str]) -> int:
        ready = []
        for rec in page["requests"]:
            request_id = rec["request_id"]
            entry = self.pending.get(request_id)
            if entry is not None and rec["received"] in (None, entry.received):
                if rec["finished"] is None or rec["sent"] is None:  # an abort the engine has not yet seen
                    entry.seq = rec["seq"]
                    continue
                del self.pending[request_id]
                ready.append((rec, entry.traceparent, entry.tracestate))
            elif rec["sent"] is None and request_id in in_flight:
                self.running[request_id] = rec["seq"]
        if not ready:
            return 0
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.export_records, ready, page["steps"])

    def export_records(self, ready: list, steps: list[dict]) -> int:
        by_number = {st["step"]: st for st in steps}
        for rec, traceparent, tracestate in ready:
            self.export_record(rec, by_number, traceparent, tracestate)
            # hand the GIL to the event loop between requests: building a page of 400 requests' spans (0.4 s on a
            # busy 2-core host) let the loop run 63 times without it (p99 gap 63 ms), 242 times with it (p99 6 ms)
            time.sleep(0)
        return len(ready)

    def export_record(self, rec: dict, steps: Mapping[int, dict], traceparent: str | None = None,
                      tracestate: str | None = None) -> None:
        """One request's spans, from its log record and the steps it rode (number -> the log's step)."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        carrier = {"traceparent": traceparent} if traceparent else {}
        if traceparent and tracestate:
            carrier["tracestate"] = tracestate
        # W3C trace context: a malformed traceparent is ignored and the request starts a trace of its own
        parent = self.propagator.extract(carrier) if carrier else None
        rows = [_Row(steps[n], n, tokens, bool(prefill), bool(sampled)) for n, tokens, prefill, sampled in rec["steps"]
                if n in steps]
        ns = self._ns
        root = self.tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER,
                                      start_time=ns(rec["received"]), attributes=self._attributes(rec, rows))
        inside = set_span_in_context(root)

        def phase(name: str, start: float | None, end: float | None, **attributes) -> None:
            if start is None or end is None:
                return
            span = self.tracer.start_span(name, context=inside, start_time=ns(start),
                                          attributes={f"infertrace.{k}": v for k, v in attributes.items()})
            span.end(end_time=ns(max(start, end)))

        phase("tokenize", rec["received"], rec.get("tokenized"))
        phase("queue", rec["arrival"], rows[0].start if rows else rec["finished"],
              waiting_ahead=rec["waiting_ahead"], running_at_arrival=rec["running_at_arrival"])
        # each prefill step is a span (a chunked prompt's chunks, a recompute after preemption); decode steps in a
        # row make one
        for is_prefill, group in itertools.groupby(rows, key=lambda row: row.prefill):
            if is_prefill:
                for row in group:
                    phase("prefill", row.start, row.end, step=row.number, step_kind=row.step["kind"],
                          tokens=row.tokens, sampled=row.sampled, batch_size=row.step["batch_size"],
                          step_tokens=row.step["num_tokens"])
            else:
                run = list(group)
                phase("decode", run[0].start, run[-1].end, first_step=run[0].number, last_step=run[-1].number,
                      steps=len(run), tokens=sum(r.tokens for r in run), sampled=sum(r.sampled for r in run))
        if rec.get("first_output") is not None:
            root.add_event("first_output", timestamp=ns(rec["first_output"]))
        root.add_event("engine_arrival", timestamp=ns(rec["arrival"]))
        if rec["finished"] is not None:
            root.add_event("engine_finished", timestamp=ns(rec["finished"]))
        root.end(end_time=ns(max(rec["received"], rec["sent"])))

    def _attributes(self, rec: dict, rows: list) -> dict[str, Any]:
        """vLLM's attribute names where vLLM has the figure (seconds, as vLLM gives them), infertrace.* for the
        rest. The first token is the end of the first step that sampled one."""
        first_start = rows[0].start if rows else None
        first_token = next((row.end for row in rows if row.sampled), None)
        finished = rec["finished"]
        attributes = {
            "gen_ai.request.id": rec["request_id"],
            "gen_ai.response.model": self.model,
            "gen_ai.usage.prompt_tokens": rec["prompt_tokens"],
            "gen_ai.usage.completion_tokens": rec["output_tokens"],
            "gen_ai.latency.e2e": rec["sent"] - rec["received"],
            "gen_ai.latency.time_to_first_token": _minus(rec.get("first_output"), rec["received"]),
            "gen_ai.latency.time_in_queue": _minus(first_start, rec["arrival"]),
            "gen_ai.latency.time_in_model_prefill": _minus(first_token, first_start),
            "gen_ai.latency.time_in_model_decode": _minus(finished, first_token),
            "gen_ai.latency.time_in_model_inference": _minus(finished, first_start),
            "infertrace.log_seq": rec["seq"],
            "infertrace.cached_tokens": rec["cached_tokens"],
            "infertrace.finish_reason": rec["finish_reason"],
            "infertrace.finish_step": rec["finish_step"],
            "infertrace.first_step": rows[0].number if rows else None,
            "infertrace.steps": len(rows),
            "infertrace.prefill_steps": sum(row.prefill for row in rows),
            "infertrace.preempted_steps": list(rec["preempted"]) or None,
            "infertrace.waiting_ahead": rec["waiting_ahead"],
            "infertrace.running_at_arrival": rec["running_at_arrival"],
            "infertrace.steps_complete": rec["steps_complete"],
        }
        return {k: v for k, v in attributes.items() if v is not None}

    def _ns(self, t: float) -> int:
        return round(t * 1e9) + self.offset_ns

    def _expire(self, in_flight: set[str]) -> None:
        """Forget ended requests the log never showed finished (refused before the engine took them, or lost from
        its ring) after PENDING_TTL_S, and in-flight notes of requests no longer in flight."""
        old = time.monotonic() - PENDING_TTL_S
        for request_id in [k for k, e in self.pending.items() if e.noted < old]:
            del self.pending[request_id]
        for request_id in [k for k in self.running if k not in in_flight]:
            del self.running[request_id]

    def _forget(self, seq: int) -> None:
        for request_id in [k for k, e in self.pending.items() if e.seq == seq]:
            del self.pending[request_id]

    def _log_off(self) -> int:
        if not self.log_off_warned:
            self.log_off_warned = True
            log.warning("--otlp-traces-endpoint exports the request log, which is off (--request-log-size 0): "
                        "no request spans are exported")
        self.pending.clear()
        return 0

    async def close(self, state: Any) -> None:
        """Export what the log holds of the last requests, then flush and stop the exporter, within
        FINAL_FLUSH_S (an unreachable endpoint must not hold the server's exit)."""
        try:
            async with asyncio.timeout(FINAL_FLUSH_S / 2):
                await self.export_ready(state)
        except Exception as e:  # the engine gone or stuck: what is left is lost
            log.debug("the last request spans were not exported: %s", e)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(self._pool, self._stop), FINAL_FLUSH_S / 2)
        except TimeoutError:
            self.exporter.warn("still unsent at shutdown")
        self._pool.shutdown(wait=False)

    def _stop(self) -> None:
        self.provider.force_flush(int(FINAL_FLUSH_S / 2 * 1000))
        self.provider.shutdown()


class _Row(NamedTuple):
    """One step a request rode: the log's step, its number, the request's tokens in it, and the row's flags."""
    step: dict
    number: int
    tokens: int
    prefill: bool
    sampled: bool

    @property
    def start(self) -> float:
        return self.step["start"]

    @property
    def end(self) -> float:
        return self.step["start"] + self.step["duration"]


@dataclass(slots=True)
class _Ended:
    received: float | None
    traceparent: str | None
    tracestate: str | None
    noted: float  # time.monotonic() when the request ended
    seq: int | None  # its number in the log, once a read has shown it


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b
