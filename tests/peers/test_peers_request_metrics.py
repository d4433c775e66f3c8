"""vLLM's per-request metrics from the real server: bench asks for them on its own (the server identifies as vLLM
0.32.0), every request carries vLLM's queue time and TTFT, its TTFT parts add up to the client's, and the tail
finding, printed and in the result file, explains the p99 cohort from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infertrace.load.results.render import plural
from infertrace.load.results.tail import DOMINANT_SHARE, PART_LABELS
from tests.peers.conftest import SERVED_NAME

pytestmark = pytest.mark.vllm

N = 24  # small: the tier must stay fast
PARTS = ("queue", "scheduled_to_first_token", "network_and_api_server")


def test_every_request_carries_vllms_queue_time_and_ttft(vllm_server, tmp_path):
    result_path, jsonl = tmp_path / "run.json", tmp_path / "requests.jsonl"
    command = [sys.executable, "-m", "infertrace", "bench", "--base-url", vllm_server.base_url, "--model", SERVED_NAME,
               "--tokenizer", str(vllm_server.model_dir), "--num-prompts", str(N), "--concurrency", "8",
               "--input-len", "64", "--output-len", "16", "--result-json", str(result_path),
               "--requests-jsonl", str(jsonl)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "COLUMNS": "400"})  # the findings table unwrapped
    vllm_server.check_alive()
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads(result_path.read_text())
    assert result["provenance"]["target"]["server_metrics"] == {"mode": "auto", "asked": True}

    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    ok = [r for r in lines if r["success"] and r["phase"] == "measured"]
    assert len(ok) == N
    carried = [r for r in ok if (r.get("server") or {}).get("queue_time_ms") is not None
               and r["server"].get("time_to_first_token_ms") is not None and r.get("ttft_parts")]
    assert len(carried) >= 0.99 * len(ok)
    for r in carried:
        assert r["server"]["source"] == "vllm_response"
        parts = r["ttft_parts"]
        assert tuple(parts) == PARTS
        assert sum(parts.values()) == pytest.approx(r["ttft_ms"], rel=1e-9, abs=1e-9)
        assert parts["queue"] == r["server"]["queue_time_ms"]
        # the engine's own times lie inside the client's TTFT: what is left is the API server and the network
        assert parts["network_and_api_server"] > 0

    joined = result["request_log"]
    assert joined["source"] == "vllm_response" and joined["explained"] == len(carried) and not joined["warnings"]
    p99 = joined["cohorts"]["p99"]
    (finding,) = [f for f in result["findings"] if f["rule"] == "ttft_tail"]
    # the finding names the p99 cohort's largest part with its share, or its top three when none holds half
    top = max(PARTS, key=lambda p: p99["parts_ms"][p])
    if p99["shares"][top] >= DOMINANT_SHARE:
        assert finding["what"] == f"p99 TTFT is {PART_LABELS[top]}: {p99['shares'][top]:.0%} of it"
    else:
        assert finding["what"].startswith("p99 TTFT has no single cause: " + PART_LABELS[top])
    for p in PARTS:
        assert f"{p} {p99['parts_ms'][p]:.1f}" in finding["evidence"]
    assert f"{plural(p99['requests'], 'request')} at or above TTFT p99" in finding["evidence"]
    assert finding["what"] in done.stderr  # printed as the result file holds it
