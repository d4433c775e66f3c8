"""bench's own OTLP trace receiver (`--otlp-receiver`): the server's `llm_request` spans, taken while the run goes on,
so that no collector stands between vLLM's `--otlp-traces-endpoint` and the join (load/results/peer_logs.py).

Both protocols vLLM's exporter speaks (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, vllm/tracing/otel.py
`get_span_exporter` in 0.33.0): gRPC (`grpc://HOST:PORT`, the TraceService's Export) and HTTP/protobuf
(`http://HOST:PORT`, POST /v1/traces). Each export is decoded with opentelemetry-proto's ExportTraceServiceRequest.
Nothing the server sends can take the run with it: a body above MAX_EXPORT_BYTES is refused by the transport, one
that does not decode is answered with the protocol's error and counted, and at most MAX_SPANS spans are kept.

Everything runs on the run's event loop. While the requests are measured an export is only parsed (about 2 us a
span: enough to answer a malformed one with its error) and held; its spans are read into records (about 40 us a
span) once `collect` is called, after the measured window, so the receiver takes next to nothing from the client's
timing loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infertrace.load.config import parse_receiver_url

SOURCE = "vllm_otlp"
# After the last measured request, how long the receiver waits for the spans still in the server's exporter: the
# OpenTelemetry SDK's BatchSpanProcessor (vLLM's) sends every 5 s by default (OTEL_BSP_SCHEDULE_DELAY), so twice
# that covers one late batch and its send. The wait ends as soon as every measured request has its span.
SPAN_GRACE_S = 10.0
MAX_EXPORT_BYTES = 32 << 20  # one export, decompressed: the SDK sends at most 512 spans of about 1 KB at once
MAX_SPANS = 200_000  # spans kept for the join; past it new ones are counted as dropped
_GRPC_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
HTTP_PATH = "/v1/traces"


@dataclass(slots=True)
class Received:
    """What the receiver has taken so far: the spans by request id, and what it could not use."""

    records: dict[str, Any] = field(default_factory=dict)  # what `read_span` made, by its request_id
    exports: int = 0
    malformed_exports: int = 0
    skipped_spans: int = 0  # llm_request spans that could not be read
    dropped_spans: int = 0  # past MAX_SPANS
    first_problem: str | None = None


class SpanReceiver:
    """Listens on every URL from `start` to `close`; `collect` waits for the measured requests' spans. The spans
    named `span_name` are kept, each as `read_span` makes it from the protobuf Span: a record with a `request_id`
    (load/results/peer_logs.py `vllm_proto_record`), or ValueError for one that cannot be read."""

    def __init__(self, urls: list[str] | tuple[str, ...], span_name: str, read_span: Callable[[Any], Any]) -> None:
        self.endpoints = [parse_receiver_url(u) for u in urls]
        self.urls = list(urls)
        self.span_name = span_name
        self.read_span = read_span
        self.received = Received()
        self._arrived = asyncio.Event()
        self._servers: list = []  # a grpc.aio server or an aiohttp AppRunner per URL
        self._held: list = []  # exports parsed and not yet read: the measured window is still open
        self._held_spans = 0
        self._reading = False  # set by `collect`: from then on each export is read as it comes

    async def start(self) -> None:
        """Bind every URL; ValueError with one line when one cannot be (a port taken, an address not here)."""
        try:
            for (scheme, host, port), url in zip(self.endpoints, self.urls):
                self._servers.append(await (self._grpc(host, port) if scheme == "grpc" else self._http(host, port)))
        except (OSError, RuntimeError) as e:
            await self.close()
            raise ValueError(f"--otlp-receiver {url}: cannot listen there: {e}") from None

    async def close(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            if hasattr(server, "cleanup"):
                await server.cleanup()
            else:
                await server.stop(grace=None)

    def ingest(self, body: bytes) -> str | None:
        """Take one export; None, or why it could not be decoded (the export is then counted, not kept)."""
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        got = self.received
        try:
            request = ExportTraceServiceRequest.FromString(body)
        except (DecodeError, RecursionError, ValueError) as e:
            got.malformed_exports += 1
            got.first_problem = got.first_problem or f"an export that is not OTLP protobuf ({e})"
            return f"not an OTLP ExportTraceServiceRequest: {e}"
        got.exports += 1
        if self._reading:
            self._read(request)
            self._arrived.set()
            return None
        spans = sum(len(scope.spans) for resource in request.resource_spans for scope in resource.scope_spans)
        if len(got.records) + self._held_spans + spans > MAX_SPANS:
            got.dropped_spans += spans
        else:
            self._held.append(request)
            self._held_spans += spans
        return None

    def _read(self, request) -> None:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    if span.name == self.span_name:
                        self._keep(span)

    def _keep(self, span) -> None:
        got = self.received
        try:
            record = self.read_span(span)
        except ValueError as e:
            got.skipped_spans += 1
            got.first_problem = got.first_problem or str(e)
            return
        if record.request_id not in got.records and len(got.records) >= MAX_SPANS:
            got.dropped_spans += 1
            return
        got.records[record.request_id] = record

    async def collect(self, request_ids: set[str], grace_s: float = SPAN_GRACE_S) -> list:
        """The records so far, once every id in `request_ids` has one or `grace_s` has passed since the call."""
        deadline = time.monotonic() + grace_s
        self._reading = True
        held, self._held, self._held_spans = self._held, [], 0
        for request in held:
            self._read(request)
        try:
            while not request_ids <= self.received.records.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except TimeoutError:
                    break
        finally:
            self._reading = False  # the next sweep point's window: held again
        return list(self.received.records.values())

    def warnings(self) -> list[str]:
        """What the receiver took and could not use, for the join's summary."""
        got, out = self.received, []
        if not got.exports:
            out.append(f"no OTLP export reached {', '.join(self.urls)}: start vLLM with --otlp-traces-endpoint "
                       "pointing there (and OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for an http:// one)")
        if got.malformed_exports:
            out.append(f"{got.malformed_exports} OTLP export(s) could not be decoded and were refused")
        if got.skipped_spans:
            out.append(f"{got.skipped_spans} llm_request span(s) could not be read (the first: {got.first_problem})")
        if got.dropped_spans:
            out.append(f"{got.dropped_spans} span(s) past the {MAX_SPANS:,} kept were dropped")
        return out

    async def _grpc(self, host: str, port: int):
        import grpc
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        async def export(body: bytes, context):
            if (why := self.ingest(body)) is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why[:200])
            return ExportTraceServiceResponse()

        handler = grpc.method_handlers_generic_handler(_GRPC_SERVICE, {"Export": grpc.unary_unary_rpc_method_handler(
            export, request_deserializer=None, response_serializer=ExportTraceServiceResponse.SerializeToString)})
        server = grpc.aio.server(handlers=[handler], options=[("grpc.max_receive_message_length", MAX_EXPORT_BYTES),
                                                              ("grpc.so_reuseport", 0)])
        if server.add_insecure_port(f"{host}:{port}") == 0:
            raise OSError(f"the port {port} is taken or the address is not this host's")
        await server.start()
        return server

    async def _http(self, host: str, port: int):
        from aiohttp import web
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        ok = ExportTraceServiceResponse().SerializeToString()

        async def export(request: web.Request) -> web.Response:
            if request.content_type != "application/x-protobuf":
                return web.Response(status=415, text="OTLP/HTTP here takes application/x-protobuf\n")
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                self.received.malformed_exports += 1
                raise
            if (why := self.ingest(body)) is not None:
                return web.Response(status=400, text=why[:200] + "\n")
            return web.Response(body=ok, content_type="application/x-protobuf")

        app = web.Application(client_max_size=MAX_EXPORT_BYTES)
        app.router.add_post(HTTP_PATH, export)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except BaseException:
            await runner.cleanup()
            raise
        return runner
