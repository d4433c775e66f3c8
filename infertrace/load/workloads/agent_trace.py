"""Replay of agent traces recorded as OpenTelemetry GenAI spans (OTLP JSON, semantic conventions v1.37.0:
docs/gen-ai/gen-ai-spans.md and gen-ai-agent-spans.md): a trace is a session, its model calls (`gen_ai.operation.name`
chat, text_completion or generate_content) a chain of chat turns, and an `invoke_agent` span inside another agent's
is a subagent whose calls are a session of their own.

Each session starts at its first call's time in the trace; each later call is sent once the previous answer is in
and the gap the trace shows between them (the tool calls' time) has passed, both times --time-scale. Lengths come
from `gen_ai.usage.input_tokens` and `gen_ai.usage.output_tokens`, times --token-scale: a call's new message is
what its input adds to the previous call's input and output, so the history grows as a conversation's does (the
assistant turns being the server's own replies; conversation.py plays them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from infertrace.load.clock import Clock
from infertrace.load.records import RequestResult, RequestSpec
from infertrace.load.workloads.conversation import Session, SessionDriver, Turn, per_turn
from infertrace.load.workloads.dataset import DatasetError, PromptMaker, regular_file, seeded_rng
from infertrace.load.workloads.replay import MAX_SPAN_S

MODEL_CALLS = ("chat", "text_completion", "generate_content")
TOOL_CALL, AGENT = "execute_tool", "invoke_agent"
INPUT_TOKENS, OUTPUT_TOKENS = "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"


@dataclass(frozen=True, slots=True)
class Span:
    trace_id: str
    span_id: str
    parent_id: str | None
    operation: str | None  # gen_ai.operation.name
    start_s: float  # seconds since the epoch
    end_s: float
    attributes: dict


@dataclass(frozen=True, slots=True)
class ModelCall:
    span_id: str
    start_s: float  # after the trace's first call, before --time-scale
    end_s: float
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class AgentSession:
    trace_id: str
    agent_span_id: str | None  # the subagent's invoke_agent span; None for the trace's own chain
    calls: tuple[ModelCall, ...]
    tool_calls: int  # execute_tool spans of this chain


def _value(v: dict):
    """An OTLP JSON AnyValue (https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding): 64-bit integers
    come as strings."""
    if not isinstance(v, dict):
        return None
    if "intValue" in v:
        try:
            return int(v["intValue"])
        except (TypeError, ValueError):
            return v["intValue"]
    for key in ("stringValue", "doubleValue", "boolValue"):
        if key in v:
            return v[key]
    return None


def _nanos(span: dict, key: str, where: str) -> float:
    value = span.get(key)
    try:
        return int(value) / 1e9
    except (TypeError, ValueError):
        raise DatasetError(f"{where}: {key} is {json.dumps(value)[:40]}, not nanoseconds since the epoch") from None


def _documents(path: Path) -> list:
    """The file as one OTLP JSON document, or one a line (a collector's file exporter)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"cannot read agent trace {path}: {e}") from None
    try:
        return [json.loads(text)]
    except ValueError:
        pass
    docs = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                docs.append(json.loads(line))
            except ValueError as e:
                raise DatasetError(f"{path}:{n}: not JSON ({e.msg})") from None
    return docs


def read_spans(path: str | Path) -> list[Span]:
    """Every span of the file; DatasetError naming the file (and span) for anything that is not OTLP JSON."""
    path = regular_file(path, "agent trace")
    spans = []
    for doc in _documents(path):
        resource_spans = doc.get("resourceSpans") if isinstance(doc, dict) else None
        if not isinstance(resource_spans, list):
            raise DatasetError(f"{path}: not OTLP JSON traces (no resourceSpans list)")
        for rs in resource_spans:
            for ss in (rs.get("scopeSpans") or []) if isinstance(rs, dict) else []:
                for s in (ss.get("spans") or []) if isinstance(ss, dict) else []:
                    if not isinstance(s, dict) or not s.get("traceId") or not s.get("spanId"):
                        raise DatasetError(f"{path}: a span without traceId or spanId")
                    where = f"{path}: span {s['spanId']}"
                    attributes = {a.get("key"): _value(a.get("value")) for a in s.get("attributes") or []
                                  if isinstance(a, dict)}
                    start, end = _nanos(s, "startTimeUnixNano", where), _nanos(s, "endTimeUnixNano", where)
                    if end < start:
                        raise DatasetError(f"{where}: it ends before it starts")
                    spans.append(Span(s["traceId"], s["spanId"], s.get("parentSpanId") or None,
                                      attributes.get("gen_ai.operation.name"), start, end, attributes))
    return spans


def _tokens(span: Span, key: str, minimum: int, path) -> int:
    value = span.attributes.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise DatasetError(f"{path}: span {span.span_id} ({span.operation}) needs {key} as an integer >= {minimum}, "
                           f"got {json.dumps(value)}")
    return value


def sessions_of(spans: list[Span], path) -> list[AgentSession]:
    """The chains of model calls: one per trace, and one per subagent (an invoke_agent span with an invoke_agent
    ancestor); in order of their first call. A span whose parent is not in the file starts its own tree."""
    by_id = {(s.trace_id, s.span_id): s for s in spans}

    def agents_above(s: Span) -> list[Span]:
        out, seen = [], set()
        while s.parent_id is not None and (s.trace_id, s.parent_id) in by_id and s.span_id not in seen:
            seen.add(s.span_id)
            s = by_id[(s.trace_id, s.parent_id)]
            if s.operation == AGENT:
                out.append(s)
        return out

    def chain(s: Span) -> tuple[str, str | None]:
        agents = agents_above(s)
        return s.trace_id, agents[0].span_id if len(agents) > 1 else None  # the outermost agent is the trace's

    calls: dict[tuple[str, str | None], list[Span]] = {}
    tools: dict[tuple[str, str | None], int] = {}
    for s in spans:
        if s.operation in MODEL_CALLS:
            calls.setdefault(chain(s), []).append(s)
        elif s.operation == TOOL_CALL:
            tools[chain(s)] = tools.get(chain(s), 0) + 1
    if not calls:
        raise DatasetError(f"{path}: no model call (a span with gen_ai.operation.name "
                           f"{', '.join(MODEL_CALLS)}) in {len(spans)} span(s)")
    out = []
    for key, chain_spans in calls.items():
        chain_spans.sort(key=lambda s: s.start_s)
        out.append(AgentSession(*key, tuple(
            ModelCall(s.span_id, s.start_s, s.end_s, _tokens(s, INPUT_TOKENS, 1, path),
                      _tokens(s, OUTPUT_TOKENS, 0, path)) for s in chain_spans), tools.get(key, 0)))
    out.sort(key=lambda a: a.calls[0].start_s)
    return out


def _scaled(n: int, token_scale: float, minimum: int = 1) -> int:
    return max(minimum, round(n * token_scale))


def turns_of(session: AgentSession, maker: PromptMaker | None, time_scale: float,
             token_scale: float) -> tuple[Turn, ...]:
    """The chain as chat turns: each a new message of the tokens its call's input adds to the previous call's input
    and output (at least one), max_tokens the call's output (at least one), and the pause the trace shows between
    the previous call's end and this call's start. Without a maker the messages are left empty (lengths only)."""
    turns, previous = [], None
    for call in session.calls:
        grown = call.input_tokens - (previous.input_tokens + previous.output_tokens if previous else 0)
        new = _scaled(max(1, grown), token_scale)
        pause = max(0.0, call.start_s - previous.end_s) * time_scale if previous else 0.0
        text = maker.exact(new)[0] if maker is not None else ""
        turns.append(Turn(text, _scaled(call.output_tokens, token_scale), pause))
        previous = call
    return tuple(turns)


class AgentTraceLoad:
    """`--dataset agent-trace`: the first --num-prompts sessions of the file (traces and subagents, in order of
    their first call), each started at its time in the trace and played turn by turn over chat."""

    reads_prefix_cache = True  # each call resends its chain's history

    def __init__(self, cfg, tokenizer, point: int = 0) -> None:
        if tokenizer is None:
            raise DatasetError("--dataset agent-trace builds messages of the traced token counts and needs the "
                               "target's tokenizer: pass --tokenizer DIR (or --model DIR)")
        self.cfg, self.tokenizer, self.point = cfg, tokenizer, point
        spans = read_spans(cfg.dataset_path)
        self.chains = sessions_of(spans, cfg.dataset_path)[:cfg.num_prompts]
        origin = self.chains[0].calls[0].start_s
        self.offsets = [(a.calls[0].start_s - origin) * cfg.time_scale for a in self.chains]
        last = max(o + sum(t.pause_s for t in turns_of(a, None, cfg.time_scale, cfg.token_scale))
                   for o, a in zip(self.offsets, self.chains))
        if not math.isfinite(last) or last > MAX_SPAN_S:
            raise DatasetError(f"{cfg.dataset_path}: the replay would span {last:.4g} s at --time-scale "
                               f"{cfg.time_scale:g}; more than {MAX_SPAN_S / 86400:g} days is refused")
        maker = PromptMaker(tokenizer, seeded_rng(cfg.seed, "measure", point))
        self.sessions = [Session(i, turns_of(a, maker, cfg.time_scale, cfg.token_scale))
                         for i, a in enumerate(self.chains)]
        self.driver: SessionDriver | None = None

    @property
    def total(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def warmup_specs(self, n: int) -> list[RequestSpec]:
        """One-message chats of the first calls' lengths, of text of their own (no prefix of the replay's)."""
        maker = PromptMaker(self.tokenizer, seeded_rng(self.cfg.seed, "warmup", self.point))
        firsts = [s.turns[0] for s in self.sessions]
        out = []
        for i in range(n):
            turn = firsts[i % len(firsts)]
            text = maker.exact(len(self.tokenizer.encode(turn.user, add_special_tokens=False)))[0]
            out.append(RequestSpec(i, text, turn.output_len, messages=[{"role": "user", "content": text}]))
        return out

    def phase(self, runner, clock: Clock, window: float | None):
        self.driver = SessionDriver(runner.send, clock, self.cfg.think_time_s)
        return runner.open_sessions(self.sessions, self.offsets, self.driver.play)

    def figures(self, results: list[RequestResult], target) -> dict:
        summary = self.driver.summary() if self.driver is not None else {}
        span = max((a.calls[-1].end_s for a in self.chains)) - self.chains[0].calls[0].start_s
        return {**summary, "per_turn": per_turn(results), "agent_trace": {
            "path": str(self.cfg.dataset_path), "sessions": len(self.chains),
            "subagent_sessions": sum(a.agent_span_id is not None for a in self.chains),
            "model_calls": sum(len(a.calls) for a in self.chains),
            "tool_calls": sum(a.tool_calls for a in self.chains),
            "span_s": span * self.cfg.time_scale, "time_scale": self.cfg.time_scale,
            "token_scale": self.cfg.token_scale}}
