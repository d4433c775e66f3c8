"""`infertrace bench --dataset agent-trace` against the real vLLM 0.32 (CPU build): the hand-written GenAI span file
of tests/load/data replayed over chat, its token counts equal to the server's counters, every call after the
previous answer and the traced tool time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.peers.conftest import run_infertrace_bench

pytestmark = pytest.mark.vllm

SAMPLE = Path(__file__).parents[1] / "load" / "data" / "agent_trace.otlp.json"
TIME_SCALE = 0.2
OUTPUTS = (24, 16, 32, 8, 10, 12, 20)  # gen_ai.usage.output_tokens of the file's seven chat spans


def test_agent_trace_replay_on_vllm(vllm_server, tmp_path):
    before = vllm_server.counters()
    reqs = tmp_path / "calls.jsonl"
    result = run_infertrace_bench(vllm_server, tmp_path, "agents", "--dataset", "agent-trace", "--dataset-path",
                                  str(SAMPLE), "--time-scale", str(TIME_SCALE), "--ignore-eos",
                                  "--requests-jsonl", str(reqs))
    after = vllm_server.counters()
    assert result["completed"] == 7 and result["failed"] == 0 and result["sessions_completed"] == 3
    assert result["agent_trace"]["subagent_sessions"] == 1 and result["agent_trace"]["tool_calls"] == 3
    assert result["total_output_tokens"] == after["generation_tokens"] - before["generation_tokens"] == sum(OUTPUTS)
    assert result["total_input_tokens"] == after["prompt_tokens"] - before["prompt_tokens"]
    calls = [json.loads(x) for x in reqs.read_text().splitlines()]
    by_session: dict[int, list[dict]] = {}
    for c in sorted(calls, key=lambda c: c["t0_s"]):
        by_session.setdefault(c["session"], []).append(c)
    planner = by_session[0]
    # each call after the previous answer and the traced gap (0.9 s and 3.3 s, x0.2)
    assert planner[1]["t0_s"] - planner[0]["end_s"] >= 0.9 * TIME_SCALE - 0.01
    assert planner[2]["t0_s"] - planner[1]["end_s"] >= 3.3 * TIME_SCALE - 0.01
    for session in by_session.values():  # the history grows: each call's prompt holds the one before and its reply
        for before_call, call in zip(session, session[1:]):
            assert call["prompt_tokens"] > before_call["prompt_tokens"] + before_call["output_tokens"]
