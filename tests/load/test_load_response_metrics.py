"""vLLM's per-request metrics read from the response: the final usage chunk's `metrics` kept per request, its TTFT
split into parts that add up to the client's, --server-metrics deciding who is asked, and the tail explained from
them. The streams are scripted as vLLM 0.32.0 sends them (vllm/entrypoints/openai/completion/serving.py and
chat_completion/serving.py: `metrics` rides on the `choices: []` usage chunk, dumped with exclude_none)."""

from __future__ import annotations

import math

import msgspec
import pytest
from click.testing import CliRunner

from infertrace.cli import main
from infertrace.load.benchmark import worker_config
from infertrace.load.client.http_target import HttpTarget, decode_data
from infertrace.load.client.timing import measure
from infertrace.load.clock import ScriptedClock
from infertrace.load.config import BenchConfig
from infertrace.load.records import RequestResult, RequestSpec
from infertrace.load.report.requests import requests_data, requests_html
from infertrace.load.results import response_metrics
from infertrace.load.results.tail import cohorts, slowest, tail_findings, tail_summary
from infertrace.load.run.worker import Batch
from tests.load.test_load_http_target import JsonTransport
from tests.load.test_load_timing import DONE, T0, ScriptedResponse, ScriptedTransport, chat, comp, sse

METRICS = {"time_to_first_token_ms": 212.5, "generation_time_ms": 301.0, "queue_time_ms": 40.25,
           "mean_itl_ms": 100.3, "tokens_per_second": 7.9}


def final_usage(metrics=METRICS, obj="text_completion"):
    """vLLM 0.32's last chunk before [DONE], as the real server sent it: no choices, the usage, and its metrics
    (absent when the server runs without --enable-per-request-metrics, whether or not the body asks)."""
    body = {"id": "cmpl-9d505ae4278ad32e", "object": obj, "created": 1796540037, "model": "tiny", "choices": [],
            "usage": {"prompt_tokens": 7, "total_tokens": 11, "completion_tokens": 4},
            "system_fingerprint": "vllm-0.32.0-da28babb"}
    if metrics is not None:
        body["metrics"] = metrics
    return body


async def run(reads, endpoint="completions", server_metrics="auto"):
    clock = ScriptedClock(T0)
    transport = ScriptedTransport(ScriptedResponse(clock, [(t, o if o == DONE else sse(o)) for t, o in reads]))
    target = HttpTarget("http://x", endpoint, "tiny", transport, server_metrics=server_metrics)
    result = RequestResult(0, scheduled=T0, t0=0.0, end=0.0)
    await measure(result, target, RequestSpec(0, "hello", 4, prompt_len=7), clock)
    return result, transport


COMPLETION = [(10.3, comp("a", usage=1)), (10.4, comp("b", usage=2)), (10.5, comp("c", usage=3)),
              (10.6, comp("d", finish="length", usage=4)), (10.61, final_usage()), (10.62, DONE)]


async def test_the_final_usage_chunk_metrics_join_the_request_and_parts_add_up():
    result, _ = await run(COMPLETION)
    assert result.success and result.ttft == pytest.approx(0.3)
    server = result.server
    assert server["source"] == "vllm_response"
    assert {k: server[k] for k in METRICS} == METRICS  # named as vLLM names them
    parts = server["ttft_parts"]
    assert parts["queue"] == 40.25 and parts["scheduled_to_first_token"] == 212.5
    assert parts["network_and_api_server"] == pytest.approx(300.0 - 40.25 - 212.5)
    line = result.to_json()
    assert math.isclose(sum(line["ttft_parts"].values()), line["ttft_ms"], rel_tol=1e-12)
    assert line["server"]["queue_time_ms"] == 40.25 and "ttft_parts" not in line["server"]


async def test_chat_streams_carry_them_the_same_way():
    result, _ = await run([(10.2, chat(role=True)), (10.5, chat("Hi", usage=1)), (10.6, chat(finish="stop", usage=1)),
                           (10.7, final_usage(obj="chat.completion.chunk")), (10.8, DONE)], endpoint="chat")
    assert result.ttft == pytest.approx(0.5)
    assert sum(result.server["ttft_parts"].values()) == pytest.approx(500.0)


async def test_without_the_server_flag_there_is_no_server_view():
    result, _ = await run([*COMPLETION[:4], (10.61, final_usage(metrics=None)), (10.62, DONE)])
    assert result.success and result.server is None
    assert "server" not in result.to_json()


async def test_off_neither_asks_nor_reads():
    result, transport = await run(COMPLETION, server_metrics="off")
    assert result.success and result.server is None
    assert "include_metrics" not in transport.sent[0][1]


async def test_on_asks_any_server():
    _, transport = await run(COMPLETION, server_metrics="on")
    assert transport.sent[0][1]["include_metrics"] is True


@pytest.mark.parametrize("bad", [{"queue_time_ms": "40", "time_to_first_token_ms": 1.0},
                                 {"queue_time_ms": -1.0, "time_to_first_token_ms": 1.0},
                                 {"queue_time_ms": True, "time_to_first_token_ms": 1.0},
                                 {"time_to_first_token_ms": 1.0}])
async def test_a_figure_that_is_no_duration_is_dropped_and_the_request_kept(bad):
    result, _ = await run([*COMPLETION[:4], (10.61, final_usage(metrics=bad)), (10.62, DONE)])
    assert result.success
    assert result.server["queue_time_ms"] is None and "ttft_parts" not in result.server


async def test_metrics_that_are_no_object_are_ignored():
    result, _ = await run([*COMPLETION[:4], (10.61, final_usage(metrics=[1, 2])), (10.62, DONE)])
    assert result.success and result.server is None


def test_the_checked_path_keeps_them_too():
    fast = decode_data('{"choices": [], "usage": {"completion_tokens": 4}, "metrics": {"queue_time_ms": 1.5}}')
    checked = decode_data(' {"choices": [], "usage": {"completion_tokens": 4}, "metrics": {"queue_time_ms": 1.5}}')
    assert fast.server_metrics == checked.server_metrics == {"queue_time_ms": 1.5}
    assert checked.usage_only and checked.completion_tokens == 4


def vllm_server(version="0.32.0", owned_by="vllm", server_info=False):
    answers = {("GET", "/v1/models"): (200, {"data": [{"id": "tiny", "owned_by": owned_by}]}),
               ("GET", "/version"): (200, {"version": version})}
    if server_info:
        answers[("GET", "/server_info")] = (200, {"vllm_config": "..."})
    return JsonTransport(answers)


@pytest.mark.parametrize("transport, asks", [
    (vllm_server(), True),
    (vllm_server("0.33.1rc1.dev5+g1234"), True),
    (vllm_server(server_info=True), True),  # /version read beside /server_info
    (vllm_server("0.31.2"), False),
    (vllm_server(owned_by="sglang"), False),  # SGLang's /version answers too: the model card tells them apart
    (vllm_server(version=None), False),
])
async def test_auto_asks_a_vllm_that_has_them_and_no_one_else(transport, asks):
    target = HttpTarget("http://h", "completions", "tiny", transport)
    await target.preflight()
    assert target.asks_server_metrics is asks
    assert ("include_metrics" in target.body(RequestSpec(0, "hi", 4))) is asks
    assert target.reads_server_metrics
    assert target.describe()["server_metrics"] == {"mode": "auto", "asked": asks}


def test_a_mode_that_is_none_of_the_three_is_refused():
    with pytest.raises(ValueError, match="server_metrics must be one of auto, on, off"):
        BenchConfig(server_metrics="maybe")
    result = CliRunner().invoke(main, ["bench", "--server-metrics", "maybe"])
    assert result.exit_code == 2 and "'maybe' is not one of 'auto', 'on', 'off'" in result.output


def vllm_run(n: int = 100) -> list[RequestResult]:
    """Requests of 20 ms TTFT, mostly prefill; the slowest 5 waited 150-190 ms in vLLM's queue."""
    results = []
    for i in range(n):
        queued = i >= n - 5
        queue = 150.0 + 10 * (i - n + 5) if queued else 0.5
        ttft = queue + 15.0 + 3.0
        r = RequestResult(i, float(i), float(i), float(i) + 1, ttft=ttft / 1e3, request_id=f"r-{i}")
        r.server = response_metrics.server_view({"queue_time_ms": queue, "time_to_first_token_ms": 15.0}, r.ttft)
        results.append(r)
    return results


def test_the_tail_is_explained_from_vllms_figures():
    results = vllm_run()
    c = cohorts(results)
    assert set(c["p99"]["parts_ms"]) == set(response_metrics.TTFT_PARTS)
    assert c["p99"]["parts_ms"]["queue"] == pytest.approx(190.0)
    assert "queued_behind_prefills" not in c["p99"]  # a response does not say what ran while it waited
    (finding,) = tail_findings(results)
    assert finding.rule == "ttft_tail"
    assert finding.what.startswith("p99 TTFT is queueing: 91% of it")
    assert "queue 190.0, scheduled_to_first_token 15.0, network_and_api_server 3.0" in finding.evidence
    assert slowest(results)[0].index == 99


def test_the_result_file_and_the_report_take_the_same_path():
    results = vllm_run()
    summary = response_metrics.summary(results, required=True)
    assert summary == {"source": "vllm_response", "requests": 100, "matched": 100, "explained": 100, "warnings": []}
    out = tail_summary(results, summary)
    assert out["slowest"][0]["ttft_parts"]["queue"] == pytest.approx(190.0)
    data = requests_data(results, summary)
    html = requests_html(data, lambda fig, name: f"<div id='{name}'>{len(fig.data)} parts</div>")
    assert "100 of 100 requests explained from vLLM's per-request metrics" in html
    assert "<div id='ttft-cohorts'>3 parts</div>" in html


def test_a_server_that_sent_none_when_asked_is_told_how_to_start():
    results = vllm_run(4)
    for r in results:
        r.server = None
    assert response_metrics.summary(results, required=False) is None
    (warning,) = response_metrics.summary(results, required=True)["warnings"]
    assert "--enable-per-request-metrics" in warning


async def test_metrics_with_only_speculative_figures_are_no_match():
    """vLLM started with --per-request-spec-decode-metrics but not --enable-per-request-metrics sends `metrics`
    holding only speculative_decoding: nothing to split a TTFT with, and the run is told how to start the server."""
    spec = {"speculative_decoding": {"num_spec_steps": 2, "num_draft_tokens": 6, "num_accepted_draft_tokens": 4}}
    reads = [*COMPLETION[:4], (10.61, final_usage(metrics=spec)), (10.62, DONE)]
    result, _ = await run(reads)
    assert result.server["speculative_decoding"] == spec["speculative_decoding"] and "ttft_parts" not in result.server
    summary = response_metrics.summary([result], required=True)
    assert summary["matched"] == 0 and summary["explained"] == 0
    (warning,) = summary["warnings"]
    assert "--enable-per-request-metrics" in warning
    assert response_metrics.summary([result], required=False) is None


def test_a_workers_records_bring_their_server_view_back():
    r = vllm_run(1)[0]
    back = msgspec.msgpack.Decoder(Batch).decode(msgspec.msgpack.encode(Batch([r]))).results[0]
    assert back.server == r.server and back.to_json()["ttft_parts"] == r.to_json()["ttft_parts"]


async def test_workers_ask_as_the_preflight_decided():
    cfg = BenchConfig(base_url="http://h")
    target = HttpTarget("http://h", "completions", "tiny", vllm_server())
    await target.preflight()
    assert worker_config(cfg, target).server_metrics == "on"
    other = HttpTarget("http://h", "completions", "tiny", vllm_server(owned_by="sglang"))
    await other.preflight()
    assert worker_config(cfg, other) is cfg
    assert worker_config(BenchConfig(base_url="http://h", server_metrics="off"), target).server_metrics == "off"
