"""vLLM's real OTLP spans, received by bench itself: the tier's server exports its `llm_request` spans over gRPC to
the port bench's --otlp-receiver listens on; every request's span joins it by request id, carries the server's queue
time and TTFT, splits its TTFT in parts that add up to the client's, and is the child of the traceparent bench sent
(vLLM 0.32 takes the incoming trace context: vllm/tracing/otel.py `extract_trace_context`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.peers.conftest import SERVED_NAME

pytestmark = pytest.mark.vllm

N = 24  # small: the tier must stay fast


def test_bench_receives_and_joins_vllms_spans(vllm_server, tmp_path):
    assert vllm_server.otlp_port is not None
    result_path, jsonl = tmp_path / "run.json", tmp_path / "requests.jsonl"
    command = [sys.executable, "-m", "infertrace", "bench", "--base-url", vllm_server.base_url, "--model", SERVED_NAME,
               "--tokenizer", str(vllm_server.model_dir), "--num-prompts", str(N), "--concurrency", "8",
               "--input-len", "64", "--output-len", "16", "--result-json", str(result_path),
               "--requests-jsonl", str(jsonl), "--otlp-receiver", f"grpc://127.0.0.1:{vllm_server.otlp_port}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "400"})
    vllm_server.check_alive()
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    ok = [r for r in lines if r["success"] and r["phase"] == "measured"]
    assert len(ok) == N
    spanned = [r for r in ok if r["server"]["source"] == "vllm_otlp" and r["server"]["queue_ms"] is not None
               and r["server"]["ttft_ms"] is not None]
    assert len(spanned) >= 0.99 * N, done.stderr[-3000:]
    for r in spanned:
        assert sum(r["ttft_parts"].values()) == pytest.approx(r["ttft_ms"], rel=1e-6, abs=1e-6)
        assert (r["server"]["trace_id"], r["server"]["parent_span_id"]) == (r["trace_id"], r["span_id"])
        assert r["server"]["vllm_response"]["queue_time_ms"] is not None  # the in-response view, kept inside
    joined = json.loads(result_path.read_text())["request_log"]
    assert (joined["source"], joined["matched"]) == ("vllm_otlp", N) and joined["offset_consistent"]
    assert joined["vllm_response"]["matched"] == N
    assert "p99 TTFT" in done.stderr
