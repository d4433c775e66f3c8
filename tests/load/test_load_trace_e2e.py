"""The first 200 requests of the shared Mooncake trace replayed against `infertrace serve` on the tiny model: the
server's own prefix-cache hits over the run match the reuse the trace implies, in the cache's blocks."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from infertrace.load.command import bench

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "workloads" / "mooncake_conversation_first2000.jsonl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def served_tiny(tiny_model_dir, tmp_path):
    """`infertrace serve` in a subprocess with KV room for the whole replay (no eviction)."""
    port = _free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "infertrace", "serve", "--model", str(tiny_model_dir), "--port",
                             str(port), "--kv-cache-tokens", "131072"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


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
