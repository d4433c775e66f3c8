"""--dataset agent-trace: OpenTelemetry GenAI spans replayed as chat sessions, in order, at the trace's times.

tests/load/data/agent_trace.otlp.json is written by hand to the GenAI semantic conventions v1.37.0
(https://github.com/open-telemetry/semantic-conventions/blob/v1.37.0/docs/gen-ai/gen-ai-spans.md and
gen-ai-agent-spans.md), in OTLP JSON. Trace 4bf9... is an agent "planner" (3 chat calls, a web_search tool call
between the first two) with a subagent "researcher" (2 chat calls around a read_file tool call); trace 0af7... has
no agent span (2 chat calls around a calculator tool call). Each call's input_tokens is the previous call's input
and output plus what the tool result and the next message added.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from infertrace.load.client.targets import load_tokenizer
from infertrace.load.clock import ScriptedClock
from infertrace.load.command import bench
from infertrace.load.config import BenchConfig
from infertrace.load.records import RequestResult
from infertrace.load.workloads.agent_trace import AgentTraceLoad, read_spans, sessions_of, turns_of
from infertrace.load.workloads.conversation import SessionDriver
from infertrace.load.workloads.dataset import DatasetError

SAMPLE = Path(__file__).parent / "data" / "agent_trace.otlp.json"
A, B = "4bf92f3577b34da6a3ce929d0e0e4736", "0af7651916cd43dd8448eb211c80319c"


def test_a_trace_and_each_subagent_are_sessions_in_order_of_their_first_call():
    chains = sessions_of(read_spans(SAMPLE), SAMPLE)
    assert [(c.trace_id, c.agent_span_id) for c in chains] == [(A, None), (B, None), (A, "a000000000000005")]
    assert [[call.span_id[-1] for call in c.calls] for c in chains] == [["2", "4", "9"], ["1", "3"], ["6", "8"]]
    assert [c.tool_calls for c in chains] == [1, 1, 1]
    assert [(call.input_tokens, call.output_tokens) for call in chains[0].calls] == [(120, 24), (200, 16), (300, 32)]


def test_turns_grow_the_history_by_what_each_input_adds_and_pause_for_the_tool_time():
    planner, plain, researcher = sessions_of(read_spans(SAMPLE), SAMPLE)
    turns = turns_of(planner, None, 1.0, 1.0)
    assert [t.output_len for t in turns] == [24, 16, 32]
    assert [(t.pause_s) for t in turns] == pytest.approx([0.0, 1.5 - 0.6, 5.2 - 1.9])
    halved = turns_of(researcher, None, 0.5, 0.5)
    assert [t.output_len for t in halved] == [6, 10]
    assert [t.pause_s for t in halved] == pytest.approx([0.0, (3.5 - 2.4) * 0.5])


def test_messages_are_the_traced_token_counts_in_the_tokenizer(tiny_model_dir):
    from infertrace.load.workloads.dataset import PromptMaker, seeded_rng

    tokenizer = load_tokenizer(tiny_model_dir)
    planner = sessions_of(read_spans(SAMPLE), SAMPLE)[0]
    turns = turns_of(planner, PromptMaker(tokenizer, seeded_rng(0, "measure", 0)), 1.0, 1.0)
    # 120 first, then 200 - (120 + 24) and 300 - (200 + 16)
    assert [len(tokenizer.encode(t.user, add_special_tokens=False)) for t in turns] == [120, 56, 84]


class ScriptedChat:
    """Each answer takes `latency` seconds of the scripted clock and names the call it answers."""

    def __init__(self, clock, latency=0.25):
        self.clock, self.latency, self.sent = clock, latency, []

    async def send(self, spec, scheduled):
        self.sent.append((self.clock.now(), scheduled, spec))
        t0 = self.clock.now()
        self.clock.advance(self.latency)
        return RequestResult(spec.index, scheduled, t0, self.clock.now(), session=spec.session, turn=spec.turn,
                             text=f"answer {spec.session}.{spec.turn}")


def test_each_call_goes_after_the_previous_answer_and_the_traced_tool_time(tiny_model_dir):
    cfg = BenchConfig(dataset="agent-trace", dataset_path=str(SAMPLE), tokenizer=str(tiny_model_dir),
                      time_scale=0.5, token_scale=0.25)

    load = AgentTraceLoad(cfg, load_tokenizer(tiny_model_dir))
    assert load.offsets == pytest.approx([0.0, (1.0 - 0.1) * 0.5, (2.1 - 0.1) * 0.5])
    assert load.total == 7
    clock = ScriptedClock(100.0)
    chat = ScriptedChat(clock)
    driver = SessionDriver(chat.send, clock)
    asyncio.run(driver.play(load.sessions[0], 100.0))
    sent = [t for t, _, _ in chat.sent]
    # answer 0.25 s, then the tool gap (0.9 s traced, x0.5), answer, then 3.3 s x0.5
    assert sent == pytest.approx([100.0, 100.25 + 0.45, 100.25 + 0.45 + 0.25 + 1.65])
    specs = [spec for _, _, spec in chat.sent]
    assert [s.turn for s in specs] == [0, 1, 2] and [s.output_len for s in specs] == [6, 4, 8]
    assert [m["role"] for m in specs[2].messages] == ["user", "assistant", "user", "assistant", "user"]
    assert specs[2].messages[1]["content"] == "answer 0.0" and specs[2].messages[3]["content"] == "answer 0.1"


def test_the_phase_starts_sessions_at_their_offsets(tiny_model_dir):

    cfg = BenchConfig(dataset="agent-trace", dataset_path=str(SAMPLE), num_prompts=2)
    load = AgentTraceLoad(cfg, load_tokenizer(tiny_model_dir))
    started = []

    class Runner:
        async def send(self, spec, scheduled):
            raise AssertionError("not reached")

        async def open_sessions(self, sessions, offsets, play):
            started.extend((s.index, len(s.turns), o) for s, o in zip(sessions, offsets))

    asyncio.run(load.phase(Runner(), ScriptedClock(), None))
    assert started == [(0, 3, 0.0), (1, 2, pytest.approx(0.9))]  # --num-prompts 2: the first two sessions


def _write(tmp_path, doc) -> Path:
    path = tmp_path / "t.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def _sample_with(change) -> dict:
    doc = json.loads(SAMPLE.read_text())
    change(doc["resourceSpans"][0]["scopeSpans"][0]["spans"])
    return doc


def _drop_usage(spans):
    spans[1]["attributes"] = [a for a in spans[1]["attributes"] if a["key"] != "gen_ai.usage.input_tokens"]


def _reverse_times(spans):
    span = spans[1]
    span["startTimeUnixNano"], span["endTimeUnixNano"] = span["endTimeUnixNano"], span["startTimeUnixNano"]


@pytest.mark.parametrize("doc, words", [
    ("{not json", "not JSON"),
    ({"resourceLogs": []}, "no resourceSpans list"),
    ({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "t", "spanId": "s", "startTimeUnixNano": "1",
                                                    "endTimeUnixNano": "2"}]}]}]}, "no model call"),
    (_sample_with(_drop_usage), "span a000000000000002 (chat) needs gen_ai.usage.input_tokens"),
    (_sample_with(_reverse_times), "span a000000000000002: it ends before it starts"),
    (_sample_with(lambda spans: spans[1].update(startTimeUnixNano="soon")), "startTimeUnixNano is \"soon\""),
])
def test_bad_files_are_one_line_before_any_load(standin, tiny_model_dir, tmp_path, doc, words):
    path = _write(tmp_path, doc)
    with pytest.raises(DatasetError) as e:
        sessions_of(read_spans(path), path)
    assert words in str(e.value) and "\n" not in str(e.value)
    res = CliRunner().invoke(bench, ["--base-url", standin.url, "--dataset", "agent-trace", "--dataset-path",
                                     str(path), "--tokenizer", str(tiny_model_dir), "--scrape-interval", "0"])
    assert res.exit_code == 2 and words in " ".join(res.output.split()) and standin.count == 0


def test_a_line_per_document_is_read_as_a_collector_writes_it(tmp_path):
    doc = json.loads(SAMPLE.read_text())
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    lines = [{"resourceSpans": [{"scopeSpans": [{"spans": spans[:6]}]}]},
             {"resourceSpans": [{"scopeSpans": [{"spans": spans[6:]}]}]}]
    path = _write(tmp_path, "\n".join(json.dumps(x) for x in lines) + "\n")
    assert [len(c.calls) for c in sessions_of(read_spans(path), path)] == [3, 2, 2]


@pytest.mark.parametrize("kwargs, words", [
    ({"request_rate": 2.0}, "drop --request-rate"),
    ({"concurrency": 2}, "drop --concurrency"),
    ({"duration_s": 5.0}, "drop --duration"),
    ({"sweep_param": "request_rate", "sweep_values": (1.0, 2.0)}, "drop --sweep"),
    ({"find_max": "request_rate", "slo": {"p99_ttft_ms": 500}}, "drop --find-max"),
    ({"base_url": "http://x", "endpoint": "completions"}, "use --endpoint chat"),
    ({"dataset_path": None}, "needs --dataset-path"),
])
def test_bad_configs_are_one_line(kwargs, words):
    with pytest.raises(ValueError, match=words):
        BenchConfig(**{"dataset": "agent-trace", "dataset_path": str(SAMPLE), **kwargs})


def test_against_infertrace_serve(served_tiny, tiny_model_dir, tmp_path):
    out, reqs = tmp_path / "r.json", tmp_path / "r.jsonl"
    res = CliRunner().invoke(bench, [str(a) for a in (
        "--base-url", served_tiny, "--dataset", "agent-trace", "--dataset-path", SAMPLE, "--tokenizer",
        tiny_model_dir, "--time-scale", 0.2, "--token-scale", 0.5, "--ignore-eos", "--scrape-interval", 0,
        "--result-json", out, "--requests-jsonl", reqs)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["completed"] == 7 and data["failed"] == 0
    assert data["sessions"] == 3 and data["sessions_completed"] == 3
    assert data["agent_trace"] | {"path": None} == {
        "path": None, "sessions": 3, "subagent_sessions": 1, "model_calls": 7, "tool_calls": 3,
        "span_s": pytest.approx(5.6 * 0.2), "time_scale": 0.2, "token_scale": 0.5}
    lines = [json.loads(x) for x in reqs.read_text().splitlines()]
    assert data["total_output_tokens"] == sum(x["output_tokens"] for x in lines) == (24 + 16 + 32 + 8 + 10 + 12 + 20) / 2
    by_session = {}
    for x in sorted(lines, key=lambda x: x["t0_s"]):
        by_session.setdefault(x["session"], []).append(x)
    for calls in by_session.values():
        assert [c["turn"] for c in calls] == list(range(len(calls)))
        prompts = [c["prompt_tokens"] for c in calls]
        assert prompts == sorted(prompts) and len(set(prompts)) == len(prompts)  # the history grows
        for before, after in zip(calls, calls[1:]):  # after the answer and the tool time (x0.2)
            assert after["t0_s"] >= before["end_s"]
    planner = by_session[0]
    assert planner[1]["t0_s"] - planner[0]["end_s"] >= 0.9 * 0.2 - 0.01
    assert planner[2]["t0_s"] - planner[1]["end_s"] >= 3.3 * 0.2 - 0.01
    assert by_session[2][0]["t0_s"] >= 2.0 * 0.2 - 0.05  # the subagent starts at its own time
