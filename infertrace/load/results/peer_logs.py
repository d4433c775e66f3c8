"""Per-request timings that vLLM and SGLang servers give, read in their own formats and joined to bench's requests
by id, with each TTFT split into the parts the peer's figures allow (they add up to the client's TTFT).

vLLM 0.33.0 (`--otlp-traces-endpoint`): one OpenTelemetry span `llm_request` per request, started at the request's
arrival (wall clock), with `gen_ai.request.id`, `gen_ai.latency.time_to_first_token` (arrival to first token, in
the front end), `gen_ai.latency.time_in_queue` (queued to scheduled), `gen_ai.latency.time_in_model_prefill`
(scheduled to first token: every chunk and the waits between), `..._decode`, `..._inference`, `gen_ai.latency.e2e`
and the token counts (vllm/v1/engine/output_processor.py `do_tracing`, vllm/tracing/utils.py `SpanAttributes`).
The request id is the front end's: `cmpl-{X-Request-Id}-{prompt index}` for completions (vllm/entrypoints/openai/
completion/serving.py), `chatcmpl-{X-Request-Id}` for chat. Spans leave over OTLP; an OpenTelemetry collector's
`file` exporter writes them as OTLP JSON, one export request a line, which `read_vllm_otlp` reads; bench's own
receiver (load/observe/otlp_receiver.py) takes them as protobuf, and `vllm_proto_record` reads each.

SGLang 0.5.23 (`--enable-request-time-stats-logging`): one log line per finished request, `ReqTimeStats(rid=..,
input_len=.., cached_input_len=.., output_len=.., attempts=.., type=unified): queue_duration=1.23ms,
forward_duration=45.67ms, entry_time=1764250000.123` (sglang/srt/managers/schedule_batch.py `log_time_stats`,
sglang/srt/observability/req_time_stats.py `convert_to_duration`): the wait-queue entry on the wall clock, the
queueing time, and the forward time from the first forward to completion; no first-token time. Its OpenAI routes
take the request id from the body's `rid` (sglang/srt/entrypoints/openai/serving_base.py), not a header, so bench
sends `rid` too when the server is SGLang.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from infertrace import input_files
from infertrace.load.records import RequestResult
from infertrace.load.results.join import ClockOffset, estimate_offset

VLLM_SPAN = "llm_request"
MAX_PEER_LOG_BYTES = 2 << 30
MAX_TIME_S = 1e12  # a bound beyond any clock or duration in seconds: NaN, infinities and overflow stay out
_VLLM_ID = re.compile(r"^(?:chatcmpl|cmpl)-(.+?)(?:-\d+)?$")  # anchored, one lazy group: linear
_SGLANG_MARK = "ReqTimeStats("
_SGLANG_HEAD = ("rid", "input_len", "cached_input_len", "output_len", "type")
_SGLANG_TAIL = ("queue_duration", "forward_duration", "entry_time")


@dataclass(slots=True)
class PeerRecord:
    """One request as a peer server timed it: `start` on the server's wall clock (seconds), durations in seconds
    (None where the peer gives none)."""

    request_id: str
    start: float  # vLLM: arrival; SGLang: wait-queue entry
    queue: float | None = None
    prefill: float | None = None  # vLLM: scheduled to first token
    ttft: float | None = None  # vLLM: arrival to first token, in its front end
    forward: float | None = None  # SGLang: first forward to completion
    e2e: float | None = None
    figures: dict = field(default_factory=dict)  # the rest, as the peer named them
    trace_id: str | None = None  # vLLM: the span's trace and parent span (hex): the client's traceparent, if sent
    parent_span_id: str | None = None


@dataclass(slots=True)
class PeerLog:
    """What a peer's file held: its requests, and how many spans or lines of its kind were malformed (skipped)."""

    source: str
    records: list[PeerRecord]
    skipped: int = 0
    first_problem: str | None = None


class _Malformed(ValueError):
    """One span or line that cannot be read; the rest of the file still is."""


def read_vllm_otlp(path: str | Path) -> PeerLog:
    """vLLM's `llm_request` spans from an OTLP JSON file (one export request a line, or one JSON document)."""
    return _vllm_spans(_read(path))


def _vllm_spans(text: str) -> PeerLog:
    log = PeerLog("vllm", [])
    for request in _json_documents(text):
        for span in _spans(request):
            try:
                if not isinstance(span, dict):
                    raise _Malformed("a span is not an object")
                if span.get("name") == VLLM_SPAN:
                    log.records.append(_vllm_record(span))
            except _Malformed as e:
                _skip(log, str(e))
    return log


def _read(path: str | Path) -> str:
    try:
        return input_files.read_text(path, MAX_PEER_LOG_BYTES)
    except input_files.InputFileError as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def check_readable(path: str | Path) -> None:
    """ValueError unless `path` is a regular file this process can read (the server may still be writing it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"--peer-log: cannot read {path}: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"--peer-log: cannot read {path}: not a regular file")
    finally:
        os.close(fd)


def _skip(log: PeerLog, why: str) -> None:
    log.skipped += 1
    log.first_problem = log.first_problem or why


def _json_documents(text: str):
    """The file as one JSON document, else one a line; a line that is not JSON is passed over."""
    try:
        yield _loads(text)
        return
    except ValueError:
        pass
    for line in text.splitlines():
        if line.strip():
            try:
                yield _loads(line)
            except ValueError:
                continue


def _loads(text: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _spans(request):
    """Every span of an OTLP export request, whatever else it holds."""
    for resource in _list(request, "resourceSpans"):
        for scope in _list(resource, "scopeSpans"):
            yield from _list(scope, "spans")


def _list(obj, key: str) -> list:
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, list) else []


def _vllm_record(span: dict) -> PeerRecord:
    attrs = {}
    for a in _list(span, "attributes"):
        if not isinstance(a, dict) or not isinstance(a.get("key"), str):
            raise _Malformed("an attribute without a key")
        attrs[a["key"]] = _otlp_value(a.get("value"))
    start_ns = span.get("startTimeUnixNano")
    if not isinstance(start_ns, (str, int)) or isinstance(start_ns, bool) or not str(start_ns).isdigit() \
            or len(str(start_ns)) > 30:
        start_ns = None
    return _record(attrs, None if start_ns is None else int(start_ns), _hex_id(span.get("traceId")),
                   _hex_id(span.get("parentSpanId")))


def vllm_proto_record(span) -> PeerRecord:
    """A PeerRecord from one protobuf `Span` (opentelemetry.proto.trace.v1) named `llm_request`; ValueError for
    one that cannot be read."""
    attrs = {kv.key: _proto_value(kv.value) for kv in span.attributes}
    return _record(attrs, span.start_time_unix_nano or None, span.trace_id.hex() or None,
                   span.parent_span_id.hex() or None)


def _record(attrs: dict, start_ns: int | None, trace_id: str | None, parent_span_id: str | None) -> PeerRecord:
    raw_id = attrs.get("gen_ai.request.id")
    if not isinstance(raw_id, str) or not raw_id:
        raise _Malformed("a span without gen_ai.request.id")
    if start_ns is None:
        raise _Malformed(f"span {raw_id[:40]!r}: startTimeUnixNano is not a number of nanoseconds")
    m = _VLLM_ID.match(raw_id)

    def duration(key: str) -> float | None:
        value = attrs.get(key)
        if value is None:
            return None
        if not _finite(value) or not 0 <= value <= MAX_TIME_S:
            raise _Malformed(f"span {raw_id[:40]!r}: {key} is not a duration in seconds")
        return float(value)

    return PeerRecord(m.group(1) if m else raw_id, _seconds(start_ns / 1e9, raw_id),
                      queue=duration("gen_ai.latency.time_in_queue"),
                      prefill=duration("gen_ai.latency.time_in_model_prefill"),
                      ttft=duration("gen_ai.latency.time_to_first_token"), e2e=duration("gen_ai.latency.e2e"),
                      figures={k: v for k, v in attrs.items() if not isinstance(v, float) or math.isfinite(v)},
                      trace_id=trace_id, parent_span_id=parent_span_id)


def _hex_id(value) -> str | None:
    """A trace or span id as OTLP JSON writes it (hex); None for anything else."""
    if not isinstance(value, str) or not 0 < len(value) <= 32:
        return None
    try:
        int(value, 16)
    except ValueError:
        return None
    return value.lower()


def _proto_value(value):
    """A protobuf AnyValue as the JSON route reads it: a string, bool, int or float; None for lists and maps."""
    kind = value.WhichOneof("value")
    if kind in ("string_value", "bool_value", "int_value", "double_value"):
        return getattr(value, kind)
    return None


def _seconds(t: float, rid: str) -> float:
    if not abs(t) <= MAX_TIME_S:
        raise _Malformed(f"request {rid[:40]!r}: its start is not a time")
    return t


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _otlp_value(value):
    """An OTLP JSON AnyValue: intValue comes as a string (proto3 JSON's int64), doubles may come as "NaN" or
    "Infinity" strings; None for what is none of these."""
    if not isinstance(value, dict):
        return None
    if "doubleValue" in value:
        v = value["doubleValue"]
        try:
            return float(v) if isinstance(v, (int, float, str)) and not isinstance(v, bool) else None
        except ValueError:
            return None
    for key in ("stringValue", "boolValue"):
        if key in value:
            return value[key]
    if "intValue" in value:
        v = value["intValue"]
        text = str(v) if isinstance(v, (int, str)) and not isinstance(v, bool) else ""
        return int(text) if text.lstrip("-").isdigit() and len(text) <= 20 else None
    return None


def read_sglang_log(path: str | Path) -> PeerLog:
    """SGLang's `ReqTimeStats` lines from its server log (other lines are passed over; one of its kind that
    cannot be read is skipped and counted). Read by splitting at fixed marks, in time linear in the line."""
    return _sglang_lines(_read(path))


def _sglang_lines(text: str) -> PeerLog:
    log = PeerLog("sglang", [])
    for line in text.splitlines():
        at = line.find(_SGLANG_MARK)
        if at < 0:
            continue
        try:
            log.records.append(_sglang_record(line[at + len(_SGLANG_MARK):]))
        except _Malformed as e:
            _skip(log, str(e))
    return log


def _sglang_record(rest: str) -> PeerRecord:
    """`rid=.., input_len=.., ..., type=unified): queue_duration=1.23ms, forward_duration=45.67ms, entry_time=..`"""
    head, sep, tail = rest.partition("):")
    if not sep:
        raise _Malformed("a ReqTimeStats line without its closing '):'")
    fields = _pairs(head)
    times = _pairs(tail)
    missing = [k for k in _SGLANG_HEAD if k not in fields] + [k for k in _SGLANG_TAIL if k not in times]
    if missing:
        raise _Malformed(f"a ReqTimeStats line without {', '.join(missing)}")
    rid = fields["rid"]
    counts = {k: _count(fields[k], k, rid) for k in ("input_len", "cached_input_len", "output_len")}
    queue = _number(times["queue_duration"].removesuffix("ms"), "queue_duration", rid) / 1e3
    forward = _number(times["forward_duration"].removesuffix("ms"), "forward_duration", rid) / 1e3
    entry = times["entry_time"].split(maxsplit=1)[0] if times["entry_time"].strip() else ""
    return PeerRecord(rid, _seconds(_number(entry, "entry_time", rid), rid), queue=queue, forward=forward,
                      figures={**counts, "type": fields["type"]})


def _pairs(text: str) -> dict[str, str]:
    """`a=1, b=2` as {"a": "1", "b": "2"}; the first of a repeated key."""
    out: dict[str, str] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if eq:
            out.setdefault(key.strip(), value.strip())
    return out


def _count(text: str, name: str, rid: str) -> int:
    if not text.isdigit() or len(text) > 15:
        raise _Malformed(f"request {rid[:40]!r}: {name}={text[:20]!r} is not a count")
    return int(text)


def _number(text: str, name: str, rid: str) -> float:
    """A plain decimal (digits and one point), as SGLang writes its times: no NaN, no exponent, no sign."""
    digits = text.replace(".", "", 1)
    if not digits.isdigit() or len(text) > 30:
        raise _Malformed(f"request {rid[:40]!r}: {name}={text[:20]!r} is not a number")
    return float(text)


def read_peer_log(path: str | Path) -> PeerLog:
    """vLLM's spans or SGLang's lines, whichever the file holds; ValueError when it holds neither (or cannot be
    read)."""
    text = _read(path)
    spans = _vllm_spans(text)
    if spans.records or spans.skipped:
        return spans
    lines = _sglang_lines(text)
    if lines.records or lines.skipped:
        return lines
    raise ValueError(f"{path} holds neither vLLM llm_request spans (OTLP JSON) nor SGLang ReqTimeStats lines")


def join_peer(records: list[dict], peer: list[PeerRecord], source: str) -> dict:
    """Give each --requests-jsonl record (`request_id`, `t0_s`, `ttft_ms`, `end_s`) whose id the peer timed a
    `server` view and `ttft_parts` (ms, adding up to `ttft_ms`); returns the join's summary. A record whose
    fields are not what bench writes is left as it is and counted in `skipped_records`."""
    by_id = {p.request_id: p for p in peer}
    usable = [r for r in records if _client_record_ok(r)]
    matched = [(r, by_id[r["request_id"]]) for r in usable if r["request_id"] in by_id]
    pairs = []
    for r, p in matched:
        if r.get("ttft_ms") is None:
            continue
        if p.ttft is not None:  # the server had the first token before the client read it
            pairs.append((r["t0_s"], p.start, p.start + p.ttft, r["t0_s"] + r["ttft_ms"] / 1e3))
        elif p.queue is not None and p.forward is not None and r.get("end_s") is not None:
            pairs.append((r["t0_s"], p.start, p.start + p.queue + p.forward, r["end_s"]))
    offset = estimate_offset(pairs)
    warnings = []
    if offset is not None and not offset.consistent:  # no offset fits every request: parts would be guesses
        warnings.append(f"the client's and the server's clocks disagree (their bounds cross by "
                        f"{2 * offset.error_s * 1e3:.3g} ms over {offset.pairs} requests); no TTFT is split into parts")
    explained = 0
    for r, p in matched:
        r["server"] = {"source": source, "start_ms": None if offset is None else
                       (p.start - offset.offset_s - r["t0_s"]) * 1e3,
                       **{k: None if v is None else v * 1e3 for k, v in
                          (("queue_ms", p.queue), ("prefill_ms", p.prefill), ("ttft_ms", p.ttft),
                           ("forward_ms", p.forward), ("e2e_ms", p.e2e))}, "figures": p.figures,
                       **({"trace_id": p.trace_id, "parent_span_id": p.parent_span_id} if p.trace_id else {})}
        parts = _parts(r, p, offset) if not warnings else None
        if parts is not None:
            r["ttft_parts"] = parts
            explained += 1
    return {"source": source, "requests": len(records), "matched": len(matched), "explained": explained,
            "skipped_records": len(records) - len(usable), "warnings": warnings, **_offset_json(offset)}


def join_results(results: list[RequestResult], peer: list[PeerRecord], source: str,
                 warmup: list[RequestResult] = ()) -> dict:
    """`join_peer` over bench's own records: each result (measured and `warmup`, whose sends bound the clock offset
    too) the peer timed gets its `server` view; the summary counts the measured ones.

    A result that already has a view keeps at the top the one whose TTFT parts are more: infertrace serve's request
    log (six), a vLLM span (five), vLLM's in-response metrics (three); the other stays inside it under its source's
    name, so nothing read is lost. `explained` counts the measured requests whose top view is the peer's."""
    everything = [*warmup, *results]
    rows = [{"request_id": r.request_id, "t0_s": r.t0, "end_s": r.end,
             "ttft_ms": None if r.ttft is None else r.ttft * 1e3} for r in everything]
    summary = join_peer(rows, peer, source)
    for r, row in zip(everything, rows):
        if "server" in row:
            r.server = _preferred(r.server, {**row["server"], "ttft_parts": row.get("ttft_parts")})
    measured = [r for r in results if r.request_id is not None]
    return {**summary, "requests": len(results), "skipped_records": len(results) - len(measured),
            "matched": sum(row.get("server") is not None for row in rows[len(warmup):]),
            "explained": sum(r.server is not None and r.server.get("source") == source
                             and r.server.get("ttft_parts") is not None for r in results)}


def _preferred(had: dict | None, peer: dict) -> dict:
    if had is None:
        return peer
    if len(peer["ttft_parts"] or ()) > len(had.get("ttft_parts") or ()):
        return {**peer, had.get("source", "infertrace"): had}  # infertrace serve's view names no source
    return {**had, peer["source"]: peer}


def _client_record_ok(r) -> bool:
    """A --requests-jsonl record with an id and finite times (NaN or a huge number would spread into every
    figure the offset touches)."""
    if not isinstance(r, dict) or not isinstance(r.get("request_id"), str) or r.get("t0_s") is None:
        return False
    bounds = {"t0_s": MAX_TIME_S, "end_s": MAX_TIME_S, "ttft_ms": MAX_TIME_S * 1e3}
    return all(r.get(k) is None or (_finite(r[k]) and abs(r[k]) <= bound) for k, bound in bounds.items())


def _parts(r: dict, p: PeerRecord, offset: ClockOffset | None) -> dict | None:
    if offset is None or r.get("ttft_ms") is None:
        return None
    ttft = r["ttft_ms"] / 1e3
    arrived = p.start - offset.offset_s - r["t0_s"]  # seconds after the client's send
    if p.ttft is not None and p.queue is not None and p.prefill is not None:  # vLLM
        return {"network_and_frontend": arrived * 1e3, "frontend_and_handoff": (p.ttft - p.queue - p.prefill) * 1e3,
                "queue": p.queue * 1e3, "prefill_steps": p.prefill * 1e3,
                "first_token_send": (ttft - arrived - p.ttft) * 1e3}
    if p.queue is not None:  # SGLang: its queue entry and queueing time; the rest is prefill and the send
        return {"network_and_frontend": arrived * 1e3, "queue": p.queue * 1e3,
                "prefill_and_first_token_send": (ttft - arrived - p.queue) * 1e3}
    return None


def _offset_json(offset: ClockOffset | None) -> dict:
    if offset is None:
        return {"offset_ms": None, "offset_error_ms": None, "offset_pairs": 0, "offset_consistent": None}
    return {"offset_ms": offset.offset_s * 1e3, "offset_error_ms": offset.error_s * 1e3, "offset_pairs": offset.pairs,
            "offset_consistent": offset.consistent}
