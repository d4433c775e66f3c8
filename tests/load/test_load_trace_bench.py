"""Trace replay and sessions through bench: sends at the trace's times, bad traces refused before any load, the
server's prefix-cache counters read from each server's names."""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner

from infertrace.load.client.target import Target
from infertrace.load.clock import ScriptedClock
from infertrace.load.command import bench
from infertrace.load.config import BenchConfig
from infertrace.load.observe.server_counters import (
    PrefixCacheReading,
    parse_reading,
    prefix_cache_counters,
    run_hit_rate,
)
from infertrace.load.records import StreamEvent
from infertrace.load.run.runner import Runner
from infertrace.load.workloads.replay import TraceReplay


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


class Instant(Target):
    """Answers every request at once with one token; records when each was sent."""

    kind = "fake"

    def __init__(self, clock):
        self.clock, self.sent = clock, []

    async def stream(self, spec):
        self.sent.append((self.clock.now(), spec))
        yield [StreamEvent(text=" ok", output=True, completion_tokens=1, prompt_tokens=spec.prompt_len,
                           finish_reason="stop")]


def write_trace(path, stamps_ms):
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 20, "output_length": 2,
                                        "hash_ids": [i]}) + "\n" for i, t in enumerate(stamps_ms)))
    return path


def test_requests_go_out_at_the_trace_offsets_times_the_time_scale(tmp_path, tokenizer):
    path = write_trace(tmp_path / "t.jsonl", [5000, 6000, 7500, 7500])
    cfg = BenchConfig(dataset="trace", dataset_path=str(path), time_scale=0.5)
    replay = TraceReplay(cfg, tokenizer)
    clock = ScriptedClock(100.0)
    target = Instant(clock)
    runner = Runner(target, clock, cpu_clock=lambda: (0.0, 0.0))
    asyncio.run(replay.phase(runner, clock, None))
    assert sorted(r.scheduled for r in runner.results) == [100.0, 100.5, 101.25, 101.25]
    assert [s.prompt_len for _, s in target.sent] == [20] * 4


def test_trace_replay_warms_up_only_when_asked_and_never_with_trace_blocks(tmp_path, tokenizer):
    path = write_trace(tmp_path / "t.jsonl", [0, 10])
    assert BenchConfig(dataset="trace", dataset_path=str(path)).effective_warmup == 0
    assert BenchConfig(dataset="random").effective_warmup == 2
    cfg = BenchConfig(dataset="trace", dataset_path=str(path), warmup=2)
    replay = TraceReplay(cfg, tokenizer)
    warm = replay.warmup_specs(2)
    assert [s.prompt_len for s in warm] == [20, 20]
    assert not {tuple(s.prompt_ids) for s in warm} & {tuple(s.prompt_ids) for s in replay.specs}


@pytest.mark.parametrize("options, message", [
    ({"request_rate": 2.0}, "drop --request-rate"),
    ({"duration_s": 5.0}, "drop --duration"),
    ({"time_scale": 0.0}, "time_scale must be a positive"),
    ({"token_scale": float("nan")}, "token_scale must be a positive"),
])
def test_trace_options_refused(options, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(dataset="trace", dataset_path="x.jsonl", **options)


def test_conversation_over_http_needs_chat_and_the_cli_switches_to_it():
    with pytest.raises(ValueError, match="use --endpoint chat"):
        BenchConfig(dataset="conversation", base_url="http://x", endpoint="completions")
    with pytest.raises(ValueError, match="drop --concurrency"):
        BenchConfig(dataset="conversation", request_rate=1.0, concurrency=2)
    with pytest.raises(ValueError, match="turns must be at least 1"):
        BenchConfig(dataset="conversation", turns=0)


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}', ":2: missing field 'hash_ids'"),
    ('{"timestamp": -5, "input_length": 5, "output_length": 1, "hash_ids": [1]}', ":2: timestamp -5 is earlier"),
    ('{"timestamp": 9, "input_length": -5, "output_length": 1, "hash_ids": []}', ":2: input_length must be at least"),
])
def test_a_bad_trace_is_one_line_naming_the_line_and_exit_2_before_any_request(standin, tmp_path, tiny_model_dir,
                                                                            line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n' + line + "\n")
    result = CliRunner().invoke(bench, ["--base-url", standin.url, "--tokenizer", str(tiny_model_dir),
                                        "--dataset", "trace", "--dataset-path", str(path)], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert standin.count == 0


def test_an_unknown_trace_format_is_exit_2(standin, tmp_path, tiny_model_dir):
    path = tmp_path / "x.csv"
    path.write_text("a,b,c\n1,2,3\n")
    result = CliRunner().invoke(bench, ["--base-url", standin.url, "--tokenizer", str(tiny_model_dir),
                                        "--dataset", "trace", "--dataset-path", str(path)], catch_exceptions=False)
    assert result.exit_code == 2 and ":1: not a known trace format" in result.output
    assert standin.count == 0


def test_sessions_over_http_with_per_turn_figures_in_the_result(standin, tmp_path, tiny_model_dir):
    out, reqs = tmp_path / "r.json", tmp_path / "r.jsonl"
    result = CliRunner().invoke(bench, ["--base-url", standin.url, "--tokenizer", str(tiny_model_dir),
                                        "--dataset", "conversation", "--turns", "3", "--turn-input-len", "8",
                                        "--output-len", "2", "--num-prompts", "4", "--concurrency", "2",
                                        "--warmup", "0", "--result-json", str(out), "--requests-jsonl", str(reqs)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["config"]["endpoint"] == "chat"
    assert (doc["sessions"], doc["sessions_completed"], doc["sessions_ended_by_failure"]) == (4, 4, 0)
    assert [t["turn"] for t in doc["per_turn"]] == [0, 1, 2] and all(t["requests"] == 4 for t in doc["per_turn"])
    lines = [json.loads(x) for x in reqs.read_text().splitlines()]
    assert sorted((x["session"], x["turn"]) for x in lines) == [(s, k) for s in range(4) for k in range(3)]
    assert "turn 2" in result.output


def test_a_failed_turn_ends_its_session_not_the_run(standin, tmp_path, tiny_model_dir):
    standin.mode = lambda i: "500" if i == 1 else "ok"  # the second request sent: session 0's second turn
    out = tmp_path / "r.json"
    result = CliRunner().invoke(bench, ["--base-url", standin.url, "--tokenizer", str(tiny_model_dir),
                                        "--dataset", "conversation", "--turns", "3", "--turn-input-len", "8",
                                        "--output-len", "2", "--num-prompts", "3", "--concurrency", "1",
                                        "--warmup", "0", "--result-json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["sessions_ended_by_failure"] == 1 and doc["sessions_completed"] == 2
    assert doc["completed"] == 7 and doc["failed"] == 1


# As vLLM 0.33 (vllm/v1/metrics/loggers.py, through prometheus_client) and SGLang 0.5.23 write them.
VLLM = """# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
"""
SGLANG = """# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m",tp_rank="0"} 0.4
"""
INFERTRACE = """# TYPE infertrace:prefix_cache_queries_total counter
infertrace:prefix_cache_queries_total{model_name="tiny"} 64
# TYPE infertrace:prefix_cache_hits_total counter
infertrace:prefix_cache_hits_total{model_name="tiny"} 16
# TYPE infertrace:prefix_cache_hit_rate gauge
infertrace:prefix_cache_hit_rate{model_name="tiny"} 0.25
"""


def test_prefix_cache_counters_of_each_server():
    assert prefix_cache_counters(VLLM) == (1000.0, 250.0)
    assert prefix_cache_counters(INFERTRACE) == (64.0, 16.0)
    assert prefix_cache_counters(SGLANG) is None and parse_reading(SGLANG).hit_rate_gauge == 0.4
    assert parse_reading(INFERTRACE).hit_rate_gauge is None  # counters exist: the gauge since start is not used
    assert parse_reading("<html>not metrics</html>") is None


def test_run_hit_rate_is_the_growth_of_hits_over_queries():
    before, after = PrefixCacheReading(1000, 250), PrefixCacheReading(1400, 550)
    figures = run_hit_rate(before, after)
    assert figures["server_prefix_cache_hit_rate"] == 0.75 and figures["server_prefix_cache_source"] == "counters"
    gauge = run_hit_rate(parse_reading(SGLANG), parse_reading(SGLANG))
    assert gauge["server_prefix_cache_hit_rate"] == 0.4 and "gauge after the run" in gauge["server_prefix_cache_source"]
    assert run_hit_rate(None, None)["server_prefix_cache_hit_rate"] is None


def test_trace_replay_is_an_open_loop_with_no_cap_on_requests_in_flight(standin, tmp_path, tiny_model_dir):
    """Sixteen requests due at once against a server whose first token takes 500 ms: all reach the server
    together (no connection pool or default concurrency holds any back), and each TTFT is the server's."""
    standin.first_token_delay = 0.5
    path = write_trace(tmp_path / "burst.jsonl", [0] * 16)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(bench, ["--base-url", standin.url, "--tokenizer", str(tiny_model_dir),
                                        "--dataset", "trace", "--dataset-path", str(path), "--num-prompts", "16",
                                        "--result-json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert len(standin.arrivals) == 16
    assert max(standin.arrivals) - min(standin.arrivals) < 0.25  # a cap of 8 sends the second half 0.5 s later
    doc = json.loads(out.read_text())
    assert doc["completed"] == 16 and doc["max_concurrency"] is None
    assert doc["p99_ttft_ms"] < 800
    assert BenchConfig(dataset="trace", dataset_path=str(path)).open_loop


def test_trace_replay_capped_by_concurrency_shows_the_wait_as_schedule_lag(standin, tmp_path, tiny_model_dir):
    """With --concurrency 4, the requests that wait for a slot show that wait as slot wait and schedule lag,
    never as TTFT."""
    standin.first_token_delay = 0.3
    path = write_trace(tmp_path / "burst.jsonl", [0] * 8)
    out, reqs = tmp_path / "r.json", tmp_path / "r.jsonl"
    result = CliRunner().invoke(bench, ["--base-url", standin.url, "--tokenizer", str(tiny_model_dir),
                                        "--dataset", "trace", "--dataset-path", str(path), "--num-prompts", "8",
                                        "--concurrency", "4", "--result-json", str(out),
                                        "--requests-jsonl", str(reqs)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["max_concurrency"] == 4
    lines = [json.loads(x) for x in reqs.read_text().splitlines()]
    assert all(r["ttft_ms"] < 550 for r in lines)
    waited = [r for r in lines if r["slot_wait_ms"] > 200]
    assert len(waited) == 4 and all(r["schedule_lag_ms"] >= r["slot_wait_ms"] for r in waited)
