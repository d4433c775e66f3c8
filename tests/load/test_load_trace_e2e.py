"""The first 200 requests of the shared Mooncake trace replayed against `infertrace serve` on the tiny model: the
server's own prefix-cache hits over the run match the reuse the trace implies, in the cache's blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from infertrace.load.command import bench

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "workloads" / "mooncake_conversation_first2000.jsonl"


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.is_file(), reason=f"the shared workload trace is not at {TRACE}")
def test_replayed_prefix_reuse_is_what_the_trace_implies(served_tiny, tiny_model_dir, tmp_path):
    out = tmp_path / "r.json"
    # One request at a time: a block is in the cache only once the request that computes it has been prefilled,
    # so requests in flight together cannot reuse each other's blocks (in vLLM neither); one at a time, every
    # block seen earlier in the trace is there when a later request is admitted.
    result = CliRunner().invoke(bench, [
        "--base-url", served_tiny, "--tokenizer", str(tiny_model_dir), "--dataset", "trace",
        "--dataset-path", str(TRACE), "--num-prompts", "200", "--token-scale", "1/32", "--time-scale", "0.01",
        "--concurrency", "1", "--result-json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["completed"] == 200 and doc["failed"] == 0
    assert doc["trace"]["requests"] == 200 and doc["trace"]["block_tokens"] == 16
    implied, servable = doc["trace_implied_prefix_reuse"], doc["trace_servable_prefix_reuse"]
    measured = doc["server_prefix_cache_hit_rate"]
    assert doc["server_prefix_cache_source"] == "counters"
    assert implied > 0.05 and servable <= implied
    assert measured == pytest.approx(servable, rel=0.10), (implied, servable, measured)


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.is_file(), reason=f"the shared workload trace is not at {TRACE}")
def test_a_salted_replay_implies_the_reuse_the_server_finds(served_tiny, tiny_model_dir, tmp_path):
    # --prompt-salt's line (under one 16-token block) starts every prompt: it shifts the trace's blocks but adds
    # no whole block of its own, so what the server finds is still what the trace implies, and nothing warns
    out = tmp_path / "r.json"
    result = CliRunner().invoke(bench, [
        "--base-url", served_tiny, "--tokenizer", str(tiny_model_dir), "--dataset", "trace",
        "--dataset-path", str(TRACE), "--num-prompts", "60", "--token-scale", "1/32", "--time-scale", "0.01",
        "--concurrency", "1", "--prompt-salt", "random", "--result-json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert 0 < doc["prompt_salt_tokens"] < 16 and doc["prompt_salt_cached_tokens"] == 0
    servable, measured = doc["trace_servable_prefix_reuse"], doc["server_prefix_cache_hit_rate"]
    assert measured == pytest.approx(servable, rel=0.10), (servable, measured)
    assert doc["prefix_cache_warnings"] == [] and "warmed" not in result.stderr
