"""bench against `infertrace serve` drafting with n-gram lookup, and against the bundled engine drafting in-process:
the run's acceptance figures are the growth of the engine's own counters over the run, and equal to the drafts its
request log recorded."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from infertrace.cli import main
from infertrace.load.client.embedded_target import EmbeddedTarget
from tests.load.conftest import serve_subprocess

K = 3


def _spec_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode_"):
                position = sample.labels.get("position")
                out[sample.name + (f"[{position}]" if position is not None else "")] = sample.value
    return out


def test_bench_acceptance_equals_the_engines_counters(tiny_model_dir, tmp_path):
    config = json.dumps({"method": "ngram", "num_speculative_tokens": K})
    with serve_subprocess(tiny_model_dir, tmp_path, "--speculative-config", config) as url:
        before = _spec_counters(url)
        result_path, jsonl = tmp_path / "run.json", tmp_path / "requests.jsonl"
        done = subprocess.run(
            [sys.executable, "-m", "infertrace", "bench", "--base-url", url, "--tokenizer", str(tiny_model_dir),
             "--num-prompts", "8", "--concurrency", "2", "--input-len", "48", "--output-len", "32", "--warmup", "0",
             "--ignore-eos", "--scrape-interval", "0.2", "--result-json", str(result_path),
             "--requests-jsonl", str(jsonl)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        after = _spec_counters(url)
        with urllib.request.urlopen(url + "/v1/request_log", timeout=10) as r:
            log = json.loads(r.read())
    grew = {k: after[k] - before.get(k, 0.0) for k in after}
    drafts = grew["vllm:spec_decode_num_drafts_total"]
    drafted = grew["vllm:spec_decode_num_draft_tokens_total"]
    accepted = grew["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and accepted > 0  # the random model's greedy output repeats itself: lookup finds drafts

    result = json.loads(result_path.read_text())
    spec = result["speculative_decoding"]
    assert (spec["drafts"], spec["draft_tokens"], spec["accepted_tokens"]) == (drafts, drafted, accepted)
    assert spec["acceptance_rate"] == accepted / drafted
    assert spec["mean_acceptance_length"] == 1 + accepted / drafts
    per_position = [grew[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] / drafts for i in range(K)]
    assert spec["per_position_acceptance_rate"] == per_position
    assert result["spec_decode_acceptance_rate"] == accepted / drafted * 100  # vllm bench serve's key, in percent

    # the request log, kept apart from the counters, saw the same drafts
    rows = [d for r in log["requests"] for d in r.get("drafts") or []]
    assert (len(rows), sum(d[1] for d in rows), sum(d[2] for d in rows)) == (drafts, drafted, accepted)
    # several tokens a chunk, each counted: per-token ITL covers every request, chunk tokens add up to usage
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    ok = [r for r in lines if r["success"] and r["phase"] == "measured"]
    assert len(ok) == 8 and all(sum(r["chunk_tokens"]) == r["output_tokens"] == 32 for r in ok)
    assert any(n > 1 for r in ok for n in r["chunk_tokens"])
    assert result["itl_per_token_requests"] == 8


def test_the_embedded_engine_s_acceptance_is_its_own_counters(tmp_path):
    """bench without --base-url, the bundled engine drafting in-process: the run's acceptance figures are the growth
    of the engine's own counters over the measured requests (warmup left out), under the same definitions."""
    seen: list[EmbeddedTarget] = []
    original = EmbeddedTarget.engine_counters

    def spy(self):
        seen.append(self)
        return original(self)

    result_path = tmp_path / "run.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EmbeddedTarget, "engine_counters", spy)
        done = CliRunner().invoke(main, [
            "bench", "--num-prompts", "6", "--concurrency", "2", "--input-len", "48", "--output-len", "32",
            "--warmup", "2", "--ignore-eos", "--speculative-config", json.dumps({"method": "ngram",
                                                                                 "num_speculative_tokens": K}),
            "--result-json", str(result_path)])
    assert done.exit_code == 0, done.output
    spec = json.loads(result_path.read_text())["speculative_decoding"]
    engine = seen[-1].engine
    assert spec["source"] == "engine counters" and spec["drafts"] > 0 and spec["accepted_tokens"] > 0
    # every verify row is the run's or the warmup's: the run's are its measured requests' own
    log = engine.request_log.read(0)["requests"]
    measured = log[2:]  # the two warmup requests went first
    rows = [d for r in measured for d in r["drafts"]]
    assert (spec["drafts"], spec["draft_tokens"], spec["accepted_tokens"]) == (
        len(rows), sum(d[1] for d in rows), sum(d[2] for d in rows))
    assert spec["acceptance_rate"] == spec["accepted_tokens"] / spec["draft_tokens"]
    assert spec["mean_acceptance_length"] == 1 + spec["accepted_tokens"] / spec["drafts"]
    assert len(spec["per_position_acceptance_rate"]) == K
    assert sum(spec["per_position_acceptance_rate"]) * spec["drafts"] == pytest.approx(spec["accepted_tokens"])
