"""The server's prefix-cache hit rate for every dataset, the rate the workload implies, and the warning when a
run found far more cached than its own prompts explain (a cache warmed by an earlier run)."""

import asyncio

import pytest

from infertrace.load.client.target import Target
from infertrace.load.config import BenchConfig
from infertrace.load.observe.scrape import ScrapeSeries
from infertrace.load.observe.server_counters import (
    PrefixCacheReading,
    implied_hit_rate,
    measured_hit_rate,
    prefix_cache_figures,
    read_prefix_cache,
)


def _scrape(hits, queries, gauge=None):
    s = ScrapeSeries("http://x/metrics", 1.0)
    for i, (h, q) in enumerate(zip(hits, queries)):
        s.add(100.0 + i, {} if gauge is None else {"prefix_cache_hit_rate": gauge[i]},
              {"prefix_cache_hits": h, "prefix_cache_queries": q})
    return s


class _Engine(Target):
    kind = "embedded"

    def engine_counters(self):
        return {"prefix_cache_queries": 300.0, "prefix_cache_hits": 128.0}


class _Server(Target):
    kind = "http"

    def __init__(self, body):
        self.body = body

    async def read_metrics(self):
        return self.body


def test_the_counters_are_read_through_what_the_target_offers():
    """The in-process engine's own counters, else the server's /metrics body; nothing from a target with neither,
    or from a body that is not Prometheus text."""
    assert asyncio.run(read_prefix_cache(_Engine())) == PrefixCacheReading(300.0, 128.0)
    body = ('# TYPE vllm:prefix_cache_queries_total counter\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 512.0\n'
            '# TYPE vllm:prefix_cache_hits_total counter\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64.0\n')
    assert asyncio.run(read_prefix_cache(_Server(body))) == PrefixCacheReading(512.0, 64.0)
    assert asyncio.run(read_prefix_cache(_Server(None))) is None
    assert asyncio.run(read_prefix_cache(_Server("<html>not metrics</html>"))) is None


def test_random_prompts_imply_no_hits_unless_cycled():
    cfg = BenchConfig(base_url="http://h", num_prompts=32)
    assert implied_hit_rate(cfg, None, 32) == 0.0
    cycled = BenchConfig(base_url="http://h", num_prompts=32, duration_s=10.0)
    assert implied_hit_rate(cycled, None, 128) == pytest.approx(96 / 128)  # every prompt after the 32nd is a repeat


def test_shared_prefixes_imply_every_use_after_the_first():
    cfg = BenchConfig(base_url="http://h", dataset="shared-prefix", num_prompts=32, num_prefixes=4, prefix_len=256,
                      input_len=256)
    assert implied_hit_rate(cfg, None, 32) == pytest.approx(28 * 256 / (32 * 512))


def test_a_salt_line_every_prompt_starts_with_is_reuse_the_run_implies_in_whole_blocks():
    """--prompt-salt's line starts every prompt: each prompt after the run's first may find its whole blocks cached
    (`prompt_salt_cached_tokens`), and a shared prefix used again comes with the salt before it (by hand: a 20-token
    salt, 16 of it in whole blocks; 32 prompts of 64 tokens; 4 prefixes of 256 before 256 tokens)."""
    salted = {"prompt_salt_tokens": 20, "prompt_salt_cached_tokens": 16}
    cfg = BenchConfig(base_url="http://h", num_prompts=32, input_len=64)
    assert implied_hit_rate(cfg, salted, 32) == pytest.approx(31 * 16 / (32 * 84))
    shared = BenchConfig(base_url="http://h", dataset="shared-prefix", num_prompts=32, num_prefixes=4, prefix_len=256,
                         input_len=256)
    assert implied_hit_rate(shared, salted, 32) == pytest.approx((28 * 276 + 3 * 16) / (32 * 532))


def test_salted_random_prompts_imply_nothing_where_the_salt_is_shorter_than_a_block():
    """A salt under a block ("run " and 12 hex digits) is found by no prompt: the run implies 0%, as the server
    measures, whether the block comes from the target (bench's `prompt_salt_cached_tokens`) or from the scrapes'
    `vllm:cache_config_info`."""
    cfg = BenchConfig(base_url="http://h", num_prompts=32, input_len=64)
    salted = {"prompt_salt_tokens": 13, "prompt_salt_cached_tokens": 0}
    assert implied_hit_rate(cfg, salted, 32) == 0.0
    assert implied_hit_rate(cfg, salted, 32, block_size=16) == 0.0
    scrape = _scrape([0, 0], [0, 32 * 77])
    scrape.gauges["kv_block_size"] = [16.0, 16.0]
    figures = prefix_cache_figures(cfg, salted, scrape, 32)
    assert figures["implied_prefix_cache_hit_rate"] == 0.0 and figures["server_prefix_cache_hit_rate"] == 0.0
    # the server's block, where it says one, decides: a 20-token salt is one 16-token block of it
    assert implied_hit_rate(cfg, {"prompt_salt_tokens": 20, "prompt_salt_cached_tokens": 0}, 32, block_size=16) \
        == pytest.approx(31 * 16 / (32 * 84))


def test_with_the_servers_block_size_only_whole_blocks_short_of_the_last_token_are_implied():
    """A server finds prompts in whole KV blocks and recomputes a prompt's last token (vLLM: at most length - 1 is
    a hit). By hand: a 10-token salt, 4 prefixes of 256 before 256 tokens, 32 prompts: with 128-token blocks a
    prefix used again is 256 of its 266 tokens and the salt alone none; a prompt of 256 sent again is 240 of its
    tokens in 16-token blocks (255 rounded down)."""
    shared = BenchConfig(base_url="http://h", dataset="shared-prefix", num_prompts=32, num_prefixes=4, prefix_len=256,
                         input_len=256)
    assert implied_hit_rate(shared, {"prompt_salt_tokens": 10}, 32, block_size=128) == pytest.approx(
        28 * 256 / (32 * 522))
    cycled = BenchConfig(base_url="http://h", num_prompts=32, input_len=256, duration_s=10.0)
    assert implied_hit_rate(cycled, None, 128, block_size=16) == pytest.approx(96 * 240 / (128 * 256))


def test_the_block_size_comes_from_the_scrapes():
    """vLLM says its block size in `vllm:cache_config_info`; the implied rate of a run scraped from it uses it."""
    shared = BenchConfig(base_url="http://h", dataset="shared-prefix", num_prompts=8, num_prefixes=2, prefix_len=192,
                         input_len=32)
    scrape = _scrape([0, 768], [0, 1792])
    for i in range(len(scrape.times)):
        scrape.gauges.setdefault("kv_block_size", []).append(128.0)
    figures = prefix_cache_figures(shared, None, scrape, 8)
    assert figures["implied_prefix_cache_hit_rate"] == pytest.approx(6 * 128 / (8 * 224))
    assert figures["server_prefix_cache_hit_rate"] == pytest.approx(figures["implied_prefix_cache_hit_rate"])


def test_a_trace_implies_its_servable_reuse_and_none_without_hashes():
    cfg = BenchConfig(base_url="http://h", dataset="trace", dataset_path="t.jsonl")
    assert implied_hit_rate(cfg, {"trace": {}, "trace_servable_prefix_reuse": 0.42}, 10) == 0.42
    assert implied_hit_rate(cfg, {"trace": {}, "trace_servable_prefix_reuse": None}, 10) == 0.0  # Azure, BurstGPT
    files = BenchConfig(base_url="http://h", dataset="jsonl", dataset_path="p.jsonl")
    assert implied_hit_rate(files, None, 10) is None


def test_the_measured_rate_comes_from_the_scrapes_for_any_dataset():
    assert measured_hit_rate(None, _scrape([0, 900, 1856], [0, 1000, 2000])) == (pytest.approx(0.928), "counters")
    sglang = _scrape([None, None], [None, None], gauge=[0.1, 0.9])
    rate, source = measured_hit_rate(None, sglang)
    assert rate == 0.9 and "sglang:cache_hit_rate" in source
    read_around = {"server_prefix_cache_hit_rate": 0.5, "server_prefix_cache_source": "counters"}
    assert measured_hit_rate(read_around, _scrape([0, 10], [0, 10])) == (0.5, "counters")
    assert measured_hit_rate(None, None) == (None, None)


def test_a_warm_cache_on_a_repeated_random_run_is_warned_about():
    cfg = BenchConfig(base_url="http://h", num_prompts=32)
    second = prefix_cache_figures(cfg, None, _scrape([0, 1856], [0, 2000]), 32)
    assert second["server_prefix_cache_hit_rate"] == pytest.approx(0.928)
    assert second["implied_prefix_cache_hit_rate"] == 0.0
    [warning] = second["prefix_cache_warnings"]
    assert "92.8% where this workload implies 0.0%" in warning and "--prompt-salt random" in warning \
        and "--reset-prefix-cache" in warning
    first = prefix_cache_figures(cfg, None, _scrape([0, 30], [0, 2000]), 32)
    assert first["prefix_cache_warnings"] == []  # 1.5%: within what a chat template's shared start can give
    unknown = prefix_cache_figures(BenchConfig(base_url="http://h", dataset="jsonl", dataset_path="p"), None,
                                   _scrape([0, 1900], [0, 2000]), 32)
    assert unknown["server_prefix_cache_hit_rate"] == pytest.approx(0.95) and unknown["prefix_cache_warnings"] == []


def test_a_repeated_run_against_infertrace_serve_is_warned_and_a_salted_one_is_not(served_tiny, tiny_model_dir,
                                                                                  tmp_path):
    """The issue's case on the bundled server: the same random prompts sent twice are served from the prefix
    cache the second time, which is now said; --prompt-salt random makes the run start cold again."""
    import json

    from click.testing import CliRunner

    from infertrace.load.command import bench

    def run(name, *extra):
        out = tmp_path / f"{name}.json"
        res = CliRunner().invoke(bench, ["--base-url", served_tiny, "--tokenizer", str(tiny_model_dir),
                                         "--num-prompts", "4", "--input-len", "64", "--output-len", "4",
                                         "--warmup", "0", "--concurrency", "2", "--scrape-interval", "0.2",
                                         "--result-json", str(out), *extra], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return json.loads(out.read_text()), res.output

    first, _ = run("first")
    second, output = run("second")
    salted, _ = run("salted", "--prompt-salt", "random")
    assert first["server_prefix_cache_hit_rate"] < 0.1 and first["prefix_cache_warnings"] == []
    assert second["server_prefix_cache_hit_rate"] > 0.5 and len(second["prefix_cache_warnings"]) == 1
    assert "warm" in output and "--prompt-salt random" in output
    # salted, the run's prompts share only the salt line they all start with, shorter than a KV block: no prompt
    # finds any of it, and the run implies none
    assert salted["prompt_salt_cached_tokens"] == 0 and salted["implied_prefix_cache_hit_rate"] == 0.0
    assert salted["prefix_cache_warnings"] == []
    assert salted["config"]["prompt_salt"].startswith("run ") and salted["input_token_mismatches"] == 0
    spread, _ = run("spread", "--prompt-salt", "random", "--workers", "2")  # each worker counts the salt too
    assert spread["input_tokens_compared"] == 4 and spread["input_token_mismatches"] == 0
    assert spread["prefix_cache_warnings"] == []
