"""bench's view of a real vLLM's Prometheus metrics: the /metrics scrape, the server's counters in the result and the
report, and the prefix-cache hit rate, checked against the same counters read by the test around the run."""

from __future__ import annotations

import pytest

from tests.peers.conftest import run_infertrace_bench

pytestmark = pytest.mark.vllm

PROMPTS, PREFIXES, OUTPUT = 8, 2, 48


@pytest.fixture(scope="module")
def shared_prefix_run(vllm_server, tmp_path_factory):
    """A shared-prefix run with a report; the server's counters before and after it."""
    root = tmp_path_factory.mktemp("metrics")
    before = vllm_server.counters()
    result = run_infertrace_bench(
        vllm_server, root, "shared-prefix", "--dataset", "shared-prefix", "--num-prefixes", str(PREFIXES),
        "--prefix-len", "192", "--input-len", "32", "--output-len", str(OUTPUT), "--ignore-eos", "--num-prompts",
        str(PROMPTS), "--concurrency", "2", "--warmup", "0", "--prompt-salt", "random", "--scrape-interval", "0.2",
        "--report", str(root / "report.html"))
    after = vllm_server.counters()
    delta = {k: after[k] - before.get(k, 0.0) for k in ("prompt_tokens", "generation_tokens",
                                                         "prefix_cache_queries", "prefix_cache_hits")}
    return result, delta, (root / "report.html").read_text()


def test_scrape_reads_the_real_server(shared_prefix_run):
    result, _, _ = shared_prefix_run
    scraped = result["server_metrics"]
    assert scraped["server"] == "vllm" and scraped["failures"] == 0 and scraped["scrapes"] >= 2, scraped["notes"]
    # vLLM's gauges under the common names, sampled at every scrape
    for gauge in ("running", "waiting", "kv_usage"):
        values = [v for v in scraped["gauges"][gauge] if v is not None]
        assert len(values) == scraped["scrapes"], gauge
    assert max(scraped["gauges"]["running"]) >= 1
    assert all(0.0 <= v <= 1.0 for v in scraped["gauges"]["kv_usage"])


def test_run_deltas_are_the_servers_counts(shared_prefix_run):
    """The scraped counters' growth over the run is what the server counted, and what bench counted itself."""
    result, delta, _ = shared_prefix_run
    deltas = result["server_metrics"]["deltas"]
    for key in ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits"):
        assert deltas[key] == delta[key], key
    assert deltas["prompt_tokens"] == result["total_input_tokens"]
    assert deltas["generation_tokens"] == result["total_output_tokens"] == PROMPTS * OUTPUT
    assert deltas["preemptions"] == 0


def test_prefix_cache_hit_rate_is_the_servers(shared_prefix_run):
    """The run's hit rate is the growth of vLLM's hits over its queries; the shared prefixes were found, and exactly
    as much of them as the workload implies in the server's whole blocks (128 tokens on the CPU: one block of each
    192-token prefix and the salt before it, for every use after the prefix's first)."""
    result, delta, _ = shared_prefix_run
    assert delta["prefix_cache_hits"] > 0
    assert result["server_prefix_cache_hit_rate"] == pytest.approx(delta["prefix_cache_hits"]
                                                                   / delta["prefix_cache_queries"], rel=1e-12)
    assert result["server_prefix_cache_source"] == "counters"
    assert result["prefix_cache_warnings"] == []
    assert result["server_prefix_cache_hit_rate"] == pytest.approx(result["implied_prefix_cache_hit_rate"],
                                                                   rel=1e-12)


def test_report_shows_the_server_series_and_hit_rate(shared_prefix_run):
    result, _, html = shared_prefix_run
    assert "server prefix-cache hit rate" in html
    assert f"{100 * result['server_prefix_cache_hit_rate']:.1f}" in html
    for name in ('"name":"running"', '"name":"waiting"', '"name":"KV usage (%)"'):
        assert name in html, name


def test_multi_turn_chat_against_the_servers_counts(vllm_server, tmp_path):
    """Multi-turn sessions over chat (`vllm bench serve` 0.32 has no multi-turn workload to set beside it): every
    turn's prompt (the chat template over the whole history) is what the server counted, and the history sent again
    is found in its prefix cache (vLLM's CPU blocks are 128 tokens: by the third turn a prompt's history is longer than
    a block)."""
    sessions, turns = 3, 3
    before = vllm_server.counters()
    result = run_infertrace_bench(
        vllm_server, tmp_path, "conversation", "--dataset", "conversation", "--endpoint", "chat", "--num-prompts",
        str(sessions), "--turns", str(turns), "--turn-input-len", "64", "--output-len", "8", "--ignore-eos",
        "--concurrency", "3", "--warmup", "0", "--prompt-salt", "random")
    after = vllm_server.counters()
    assert result["completed"] == sessions * turns and result["failed"] == 0
    assert result["total_input_tokens"] == after["prompt_tokens"] - before["prompt_tokens"]
    assert result["total_output_tokens"] == after["generation_tokens"] - before["generation_tokens"] \
        == sessions * turns * 8
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] > 0
