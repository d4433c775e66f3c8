"""`infertrace bench --structured` against the real vLLM 0.32 (CPU build), whose structured output runs on xgrammar.

The server runs with compact JSON (`--structured-outputs-config {"backend": "xgrammar", "disable_any_whitespace":
true}`): by default the grammar allows any whitespace between tokens, and the tiny model's random weights, sampled
greedily, fill max_tokens with it, so no output would ever close. Tool choice other than auto needs a tool parser in
0.32 (vllm/renderers/online_renderer.py: `tool_choice="required" requires --tool-call-parser to be set`), hence
`--enable-auto-tool-choice --tool-call-parser hermes` (the Qwen family's).
"""

from __future__ import annotations

import json

import pytest

from tests.peers.conftest import DEFAULT_ARGS, run_infertrace_bench

pytestmark = pytest.mark.vllm

REQUESTS, OUTPUT_LEN = 12, 96
STRUCTURED_ARGS = (*DEFAULT_ARGS, "--structured-outputs-config",
                   json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
                   "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def structured_server(vllm_servers):
    return vllm_servers.get(STRUCTURED_ARGS)


def _finished(server) -> float:
    return sum(v for k, v in server.counters().items() if k.startswith("vllm:request_success_total"))


def _run(server, tmp_path, *args) -> tuple[dict, list[dict], float]:
    before = _finished(server)
    result = run_infertrace_bench(server, tmp_path, "ours", "--endpoint", "chat", *args, "--structured-share", "0.5",
                                  "--input-len", "16", "--output-len", str(OUTPUT_LEN), "--num-prompts",
                                  str(REQUESTS), "--concurrency", "4", "--warmup", "0", "--requests-jsonl",
                                  str(tmp_path / "r.jsonl"))
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    return result, lines, _finished(server) - before


def test_json_schema_outputs_of_random_weights_all_hold_to_their_schemas(structured_server, tmp_path):
    result, lines, finished = _run(structured_server, tmp_path, "--structured", "json-schema")
    s = result["structured"]
    constrained = [x for x in lines if "structured_valid" in x]
    assert result["completed"] == REQUESTS == finished
    assert s["total"] == len(constrained) == s["constrained"]["requests"] > 0
    assert s["unconstrained"]["requests"] == REQUESTS - s["total"] > 0
    assert (s["valid"], s["invalid"], s["refused"]) == (s["total"], 0, 0), s["invalid_examples"]
    assert all(x["finish_reason"] == "stop" for x in constrained)  # the grammar closed the object
    assert s["constrained"]["median_ttft_ms"] > 0 and s["unconstrained"]["median_ttft_ms"] > 0


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls_are_put_together_from_the_stream_and_judged(structured_server, tmp_path, choice):
    """vLLM 0.32's tool-call grammar keeps whitespace open inside the arguments even with disable_any_whitespace,
    so greedy random weights fill max_tokens with it: each call is counted, named as offered, and judged as cut."""
    result, lines, finished = _run(structured_server, tmp_path, "--structured", "tools", "--tool-choice", choice)
    s = result["structured"]
    constrained = [x for x in lines if "structured_valid" in x]
    assert result["completed"] == REQUESTS == finished and s["refused"] == 0
    assert s["total"] == len(constrained) == s["constrained"]["requests"] > 0
    for x in constrained:
        assert [c["name"] for c in x["tool_calls"]] == [f"record_{x['index']}"]
        assert x["structured_valid"] or x["structured_violation"].startswith("cut at max_tokens")
        assert x["structured_valid"] == (x["finish_reason"] != "length")
    assert s["valid"] + s["invalid"] == s["total"]


def test_the_default_server_refuses_tool_choice_and_bench_counts_the_refusals(vllm_server, tmp_path):
    """Without a tool parser vLLM 0.32 answers every non-auto tool_choice with 400: bench counts each refusal, in the
    server's words, and the unconstrained half of the run still stands."""
    result, lines, finished = _run(vllm_server, tmp_path, "--structured", "tools")
    s = result["structured"]
    assert s["refused"] == s["constrained"]["requests"] == result["failed"] > 0 and s["total"] == 0
    assert "requires --tool-call-parser" in s["refused_example"] and s["refused_example"].startswith("HTTP 400")
    assert s["unconstrained"]["completed"] == REQUESTS - s["refused"] == finished

