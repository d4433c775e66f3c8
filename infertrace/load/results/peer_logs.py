"""Per-request timings that vLLM and SGLang servers give, read in their own formats and joined to bench's requests
by id, with each TTFT split into the parts the peer's figures allow (they add up to the client's TTFT).

vLLM 0.33.0 (`--otlp-traces-endpoint`): one OpenTelemetry span `llm_request` per request, started at the request's
arrival (wall clock), with `gen_ai.request.id`, `gen_ai.latency.time_to_first_token` (arrival to first token, in
the front end), `gen_ai.latency.time_in_queue` (queued to scheduled), `gen_ai.latency.time_in_model_prefill`
(scheduled to first token: every chunk and the waits between), `..._decode`, `..._inference`, `gen_ai.latency.e2e`
and the token counts (vllm/v1/engine/output_processor.py `do_tracing`, vllm/tracing/utils.py `SpanAttributes`).
The request id is the front end's: `cmpl-{X-Request-Id}-{prompt index}` for completions (vllm/entrypoints/openai/
completion/serving.py), `chatcmpl-{X-Request-Id}` for chat. Spans leave over OTLP; an OpenTelemetry collector's
`file` exporter writes them as OTLP JSON, one export request a line, which `read_vllm_otlp` reads.

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
import re
from dataclasses import dataclass, field
from pathlib import Path

from infertrace.load.results.join import ClockOffset, estimate_offset

VLLM_SPAN = "llm_request"
_VLLM_ID = re.compile(r"^(?:chatcmpl|cmpl)-(.+?)(?:-\d+)?$")
_SGLANG_LINE = re.compile(
    r"ReqTimeStats\(rid=(?P<rid>[^,]+),.*?input_len=(?P<input>\d+), cached_input_len=(?P<cached>\d+), "
    r"output_len=(?P<output>\d+),.*?type=(?P<type>\w+)\): queue_duration=(?P<queue>[\d.]+)ms, "
    r"forward_duration=(?P<forward>[\d.]+)ms, entry_time=(?P<entry>[\d.]+)")


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


def read_vllm_otlp(path: str | Path) -> list[PeerRecord]:
    """vLLM's `llm_request` spans from an OTLP JSON file (one export request a line, or one JSON document)."""
    out = []
    for request in _json_documents(Path(path)):
        for resource in request.get("resourceSpans") or []:
            for scope in resource.get("scopeSpans") or []:
                for span in scope.get("spans") or []:
                    if span.get("name") == VLLM_SPAN:
                        out.append(_vllm_record(span))
    return [r for r in out if r is not None]


def _json_documents(path: Path):
    text = path.read_text()
    try:
        yield json.loads(text)
        return
    except ValueError:
        pass
    for line in text.splitlines():
        if line.strip():
            yield json.loads(line)


def _vllm_record(span: dict) -> PeerRecord | None:
    attrs = {a["key"]: _otlp_value(a.get("value") or {}) for a in span.get("attributes") or []}
    raw_id = attrs.get("gen_ai.request.id")
    if raw_id is None or span.get("startTimeUnixNano") is None:
        return None
    m = _VLLM_ID.match(str(raw_id))
    return PeerRecord(m.group(1) if m else str(raw_id), int(span["startTimeUnixNano"]) / 1e9,
                      queue=attrs.get("gen_ai.latency.time_in_queue"),
                      prefill=attrs.get("gen_ai.latency.time_in_model_prefill"),
                      ttft=attrs.get("gen_ai.latency.time_to_first_token"), e2e=attrs.get("gen_ai.latency.e2e"),
                      figures=attrs)


def _otlp_value(value: dict):
    """An OTLP JSON AnyValue: intValue comes as a string (proto3 JSON's int64)."""
    for key in ("doubleValue", "stringValue", "boolValue"):
        if key in value:
            return value[key]
    if "intValue" in value:
        return int(value["intValue"])
    return None


def read_sglang_log(path: str | Path) -> list[PeerRecord]:
    """SGLang's `ReqTimeStats` lines from its server log (other lines are skipped)."""
    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        if (m := _SGLANG_LINE.search(line)) is not None:
            out.append(PeerRecord(m["rid"], float(m["entry"]), queue=float(m["queue"]) / 1e3,
                                  forward=float(m["forward"]) / 1e3,
                                  figures={"input_len": int(m["input"]), "cached_input_len": int(m["cached"]),
                                           "output_len": int(m["output"]), "type": m["type"]}))
    return out


def read_peer_log(path: str | Path) -> tuple[str, list[PeerRecord]]:
    """("vllm", spans) or ("sglang", lines), whichever the file holds; ValueError when it holds neither."""
    path = Path(path)
    try:
        spans = read_vllm_otlp(path)
    except (ValueError, KeyError, TypeError, AttributeError):
        spans = []
    if spans:
        return "vllm", spans
    lines = read_sglang_log(path)
    if lines:
        return "sglang", lines
    raise ValueError(f"{path} holds neither vLLM llm_request spans (OTLP JSON) nor SGLang ReqTimeStats lines")


def join_peer(records: list[dict], peer: list[PeerRecord], source: str) -> dict:
    """Give each --requests-jsonl record (`request_id`, `t0_s`, `ttft_ms`, `end_s`) whose id the peer timed a
    `server` view and `ttft_parts` (ms, adding up to `ttft_ms`); returns the join's summary."""
    by_id = {p.request_id: p for p in peer}
    matched = [(r, by_id[r["request_id"]]) for r in records if r.get("request_id") in by_id]
    pairs = []
    for r, p in matched:
        if r.get("ttft_ms") is None:
            continue
        if p.ttft is not None:  # the server had the first token before the client read it
            pairs.append((r["t0_s"], p.start, p.start + p.ttft, r["t0_s"] + r["ttft_ms"] / 1e3))
        elif p.queue is not None and p.forward is not None and r.get("end_s") is not None:
            pairs.append((r["t0_s"], p.start, p.start + p.queue + p.forward, r["end_s"]))
    offset = estimate_offset(pairs)
    explained = 0
    for r, p in matched:
        r["server"] = {"source": source, "start_ms": None if offset is None else
                       (p.start - offset.offset_s - r["t0_s"]) * 1e3,
                       **{k: None if v is None else v * 1e3 for k, v in
                          (("queue_ms", p.queue), ("prefill_ms", p.prefill), ("ttft_ms", p.ttft),
                           ("forward_ms", p.forward), ("e2e_ms", p.e2e))}, "figures": p.figures}
        parts = _parts(r, p, offset)
        if parts is not None:
            r["ttft_parts"] = parts
            explained += 1
    return {"source": source, "requests": len(records), "matched": len(matched), "explained": explained,
            **_offset_json(offset)}


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
