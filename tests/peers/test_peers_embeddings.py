"""`infertrace bench --endpoint embeddings` against the real vLLM 0.32 (CPU build) serving the tiny model as an
embedding model (`--runner pooling`: vLLM converts the causal LM with `--convert embed`, LAST-token pooling and
normalisation, as its start-up log says), beside `vllm bench serve --backend openai-embeddings` on the same server.

Token and request counts are checked exactly against the server's own counters; the figures' definitions by feeding
vLLM's per-request records to infertrace's metric code; the vectors against Hugging Face's last hidden state of the
same weights, which infertrace serve's equal (tests/server/test_server_embeddings.py).
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch

from infertrace.load.observe.scrape import parse_exposition
from infertrace.load.records import RequestResult
from infertrace.load.results.metrics import compute_metrics, vllm_keys
from tests.peers.conftest import DEFAULT_ARGS, SERVED_NAME, run_infertrace_bench, run_vllm_bench

pytestmark = pytest.mark.vllm

POOLING_ARGS = (*DEFAULT_ARGS, "--runner", "pooling")
REQUESTS, BATCH, INPUT_LEN = 8, 4, 32
# vLLM's embedding figures (benchmarks/serve.py 0.32, calculate_metrics_for_embeddings and the result it saves)
VLLM_EMBEDDING_KEYS = ("completed", "duration", "total_input_tokens", "total_input_sequences", "request_throughput",
                       "input_sequence_throughput", "total_token_throughput", "mean_e2el_ms", "median_e2el_ms",
                       "std_e2el_ms", "p99_e2el_ms")


@pytest.fixture(scope="module")
def pooling_server(vllm_servers):
    return vllm_servers.get(POOLING_ARGS)


def _counts(server) -> dict[str, float]:
    """Tokens, finished requests (vLLM counts each input of a batch as a request) and /v1/embeddings HTTP calls."""
    status, body = server.get("/metrics")
    assert status == 200, body[:300]
    figures = parse_exposition(body)[1]
    return {"prompt_tokens": figures.get("prompt_tokens", 0.0),
            "inputs": sum(v for k, v in figures.items() if k.startswith("vllm:request_success_total")),
            "calls": sum(v for k, v in figures.items()
                         if k.startswith('http_requests_total{handler="/v1/embeddings"') and 'status="2xx"' in k)}


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


@pytest.fixture(scope="module")
def runs(pooling_server, tmp_path_factory):
    """Each client once on the same server, with the server's counters read around each run."""
    root = tmp_path_factory.mktemp("embeddings")
    out = {}
    before = _counts(pooling_server)
    ours = run_infertrace_bench(pooling_server, root, "ours", "--endpoint", "embeddings", "--input-len",
                                str(INPUT_LEN), "--random-batch-size", str(BATCH), "--num-prompts", str(REQUESTS),
                                "--concurrency", "2", "--warmup", "0")
    middle = _counts(pooling_server)
    out["ours"] = (ours, _delta(before, middle))
    theirs = run_vllm_bench(pooling_server, root, "theirs", "--backend", "openai-embeddings", "--endpoint",
                            "/v1/embeddings", "--percentile-metrics", "e2el", "--dataset-name", "random",
                            "--random-input-len", str(INPUT_LEN), "--random-output-len", "1", "--random-batch-size",
                            str(BATCH), "--num-prompts", str(REQUESTS * BATCH), "--max-concurrency", "2",
                            "--seed", "0")
    out["theirs"] = (theirs, _delta(middle, _counts(pooling_server)))
    return out


def test_token_and_input_counts_are_the_servers(runs):
    ours, delta = runs["ours"]
    assert ours["completed"] == REQUESTS and ours["failed"] == 0
    assert ours["total_input_tokens"] == delta["prompt_tokens"] == REQUESTS * BATCH * INPUT_LEN
    assert ours["total_input_sequences"] == delta["inputs"] == REQUESTS * BATCH
    assert delta["calls"] == REQUESTS
    assert ours["input_tokens_compared"] == REQUESTS and ours["input_token_mismatches"] == 0
    theirs, delta = runs["theirs"]
    assert theirs["completed"] == delta["calls"] == REQUESTS
    assert theirs["total_input_tokens"] == delta["prompt_tokens"]
    assert theirs["total_input_sequences"] == delta["inputs"] == REQUESTS * BATCH


def test_keys_and_definitions_match_vllm_bench_serve(runs):
    """infertrace's result carries vLLM's embedding keys, and its metric code fed vLLM's per-request records gives
    vLLM's figures (duration aside: vLLM's runs from before its first send to after its gather)."""
    ours, theirs = runs["ours"][0], runs["theirs"][0]
    assert set(VLLM_EMBEDDING_KEYS) <= set(ours)
    assert "mean_ttft_ms" not in ours and "output_throughput" not in ours
    records = [RequestResult(index=i, scheduled=0.0, t0=0.0, end=latency, e2el=latency, prompt_tokens=n,
                             num_inputs=BATCH, output_tokens=0, error=error or None)
               for i, (latency, n, error) in enumerate(zip(theirs["latencies"], theirs["input_lens"], theirs["errors"]))]
    mine = vllm_keys(compute_metrics(records, embeddings=True))
    for key in ("completed", "total_input_tokens", "total_input_sequences", "mean_e2el_ms", "median_e2el_ms",
                "std_e2el_ms", "p99_e2el_ms"):
        assert mine[key] == pytest.approx(theirs[key], rel=1e-9), key
    for key, count in (("request_throughput", "completed"), ("input_sequence_throughput", "total_input_sequences"),
                       ("total_token_throughput", "total_input_tokens")):
        assert theirs[key] * theirs["duration"] == pytest.approx(theirs[count], rel=1e-9), key
        assert ours[key] * ours["duration"] == pytest.approx(ours[count], rel=1e-9), key


def test_vllm_pools_the_last_token_and_normalises_as_infertrace_serve_does(pooling_server):
    from transformers import AutoModel, AutoTokenizer

    text = "the model token batch"
    request = urllib.request.Request(f"{pooling_server.base_url}/v1/embeddings",
                                     data=json.dumps({"model": SERVED_NAME, "input": text}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        vector = np.asarray(json.load(resp)["data"][0]["embedding"])
    ids = AutoTokenizer.from_pretrained(pooling_server.model_dir).encode(text)
    model = AutoModel.from_pretrained(pooling_server.model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    expected = torch.nn.functional.normalize(hidden[-1], dim=0).numpy()
    # vLLM's CPU build runs the float32 weights in float16: agreement to float16's precision
    np.testing.assert_allclose(vector, expected, atol=2e-3)
    assert float(vector @ expected) == pytest.approx(1.0, abs=1e-4)
