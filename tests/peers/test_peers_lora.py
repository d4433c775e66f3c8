"""`infertrace bench --lora-modules` against the real vLLM 0.32 (CPU build) serving two LoRA adapters that `infertrace
model init --lora` wrote for the tiny model (`--enable-lora --lora-modules a=DIR b=DIR`).

Each request's adapter is checked against the server's own record of it: with --enable-log-requests vLLM logs
`Received request <id>: params: ..., lora_request: LoRARequest(lora_name='a', ...)` for every request
(vllm/entrypoints/serve/utils/request_logger.py, 0.32), the id holding the X-Request-Id bench sent. Token and request
counts are checked against the server's counters.
"""

from __future__ import annotations

import json
import re

import pytest

from infertrace.load.observe.scrape import parse_exposition
from infertrace.modelgen import PRESETS, hf_config
from infertrace.modelgen.lora import init_adapters
from tests.peers.conftest import DEFAULT_ARGS, run_infertrace_bench

pytestmark = pytest.mark.vllm

REQUESTS, INPUT_LEN, OUTPUT_LEN, RANK = 16, 32, 8, 8
RECEIVED = re.compile(r"Received request (\S+): .*lora_request: (?:LoRARequest\(.*?lora_name='([^']+)'|None)")


@pytest.fixture(scope="module")
def lora_server(vllm_servers, tmp_path_factory):
    base = tmp_path_factory.mktemp("lora-base")
    (base / "config.json").write_text(json.dumps(hf_config(PRESETS["tiny"], "float32")))  # the tier's model's shapes
    a, b = init_adapters(base, 2, RANK, seed=0)
    return vllm_servers.get((*DEFAULT_ARGS, "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2",
                             "--lora-modules", f"a={a}", f"b={b}", "--enable-log-requests"))


def _counts(server) -> dict[str, float]:
    status, body = server.get("/metrics")
    assert status == 200, body[:300]
    figures = parse_exposition(body)[1]
    return {"prompt_tokens": figures.get("prompt_tokens", 0.0),
            "generation_tokens": figures.get("generation_tokens", 0.0),
            "requests": sum(v for k, v in figures.items() if k.startswith("vllm:request_success_total"))}


@pytest.fixture(scope="module")
def run(lora_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    before = _counts(lora_server)
    result = run_infertrace_bench(lora_server, root, "ours", "--lora-modules", "a=3,b=1", "--input-len",
                                  str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--ignore-eos", "--num-prompts",
                                  str(REQUESTS), "--concurrency", "4", "--warmup", "0", "--requests-jsonl",
                                  str(root / "requests.jsonl"))
    after = _counts(lora_server)
    lines = [json.loads(x) for x in (root / "requests.jsonl").read_text().splitlines()]
    return result, {k: after[k] - before[k] for k in before}, lines


def test_vllm_lists_the_adapters(lora_server):
    status, body = lora_server.get("/v1/models")
    assert status == 200 and {"a", "b"} <= {m["id"] for m in json.loads(body)["data"]}


def test_each_request_ran_on_the_adapter_its_record_names(lora_server, run):
    result, _, lines = run
    # vLLM names a completion `cmpl-<X-Request-Id>-<choice>` (serving_completion.py, 0.32)
    logged = {re.sub(r"^cmpl-(.*)-\d+$", r"\1", rid): name
              for rid, name in RECEIVED.findall(lora_server.log_path.read_text())}
    assert all(logged[x["request_id"]] == x["adapter"] for x in lines)
    counts = {name: sum(x["adapter"] == name for x in lines) for name in ("a", "b")}
    assert counts["a"] + counts["b"] == REQUESTS and min(counts.values()) > 0
    for name, count in counts.items():
        assert result["per_adapter"][name]["requests"] == result["per_adapter"][name]["completed"] == count


def test_per_adapter_tokens_add_up_to_the_servers_counters(run):
    result, delta, _ = run
    per = result["per_adapter"]
    assert result["completed"] == delta["requests"] == REQUESTS and result["failed"] == 0
    for name in ("a", "b"):
        assert per[name]["total_input_tokens"] == per[name]["requests"] * INPUT_LEN
        assert per[name]["total_output_tokens"] == per[name]["requests"] * OUTPUT_LEN
        assert per[name]["median_ttft_ms"] > 0 and per[name]["p99_e2el_ms"] >= per[name]["median_e2el_ms"]
    assert sum(f["total_input_tokens"] for f in per.values()) == delta["prompt_tokens"] == REQUESTS * INPUT_LEN
    assert sum(f["total_output_tokens"] for f in per.values()) == delta["generation_tokens"] == REQUESTS * OUTPUT_LEN
