"""compute_metrics against figures worked out by hand from three requests."""

import pytest

from infertrace.load.records import RequestResult, TokenSource
from infertrace.load.results.metrics import compute_metrics, token_count_checks, vllm_keys
from infertrace.load.results.point import PointRecord
from infertrace.load.stats import Stats


def results():
    r1 = RequestResult(0, scheduled=0.0, t0=0.0, end=0.6, ttft=0.1, e2el=0.5, itl=[0.2, 0.2],
                       chunk_tokens=[1, 1, 2], output_tokens=4, output_source=TokenSource.USAGE, prompt_tokens=10,
                       expected_prompt_tokens=10)
    r2 = RequestResult(1, scheduled=0.19, t0=0.2, end=0.55, ttft=0.3, e2el=0.3, chunk_tokens=[1], output_tokens=1,
                       output_source=TokenSource.TOKENIZER, expected_prompt_tokens=20)
    r3 = RequestResult(2, scheduled=0.3, t0=0.3, end=1.0, error="HTTP 500: overloaded", prompt_tokens=99,
                       output_tokens=7)
    return [r1, r2, r3]


def test_counts_duration_and_throughputs():
    m = compute_metrics(results())
    assert (m.completed, m.failed) == (2, 1)
    assert m.duration == pytest.approx(1.0)  # first send (0.0) to last completion (the failure at 1.0)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 5)  # failed requests' tokens are not counted
    assert m.request_throughput == pytest.approx(2.0)
    assert m.output_throughput == pytest.approx(5.0)
    assert m.total_token_throughput == pytest.approx(35.0)
    assert m.failures == {"HTTP 500": 1}
    assert m.output_token_sources == {"usage": 1, "tokenizer": 1}


def test_latency_statistics():
    m = compute_metrics(results())
    assert (m.ttft.mean, m.ttft.median, m.ttft.std) == (pytest.approx(200), pytest.approx(200), pytest.approx(100))
    assert m.ttft.p99 == pytest.approx(100 + 0.99 * 200)  # linear interpolation between 100 and 300
    assert m.ttft.p90 == pytest.approx(280)
    assert m.tpot.count == 1  # one-token responses have no TPOT
    assert m.tpot.mean == pytest.approx((500 - 100) / 3)
    assert m.itl.mean == pytest.approx(200) and m.itl.count == 2
    assert m.itl_per_token.count == 3  # 0.2/1, then 0.2/2 for each of two tokens
    assert m.itl_per_token.mean == pytest.approx(400 / 3)
    assert m.e2el.mean == pytest.approx(400) and m.e2el.median == pytest.approx(400)
    assert (m.schedule_lag.median, m.schedule_lag.p99) == (pytest.approx(0), pytest.approx(9.8))  # lags 0, 10, 0 ms


def test_goodput_counts_failures_as_misses():
    assert compute_metrics(results()).goodput is None
    m = compute_metrics(results(), {"ttft_ms": 200})
    assert m.good_requests == 1 and m.goodput == pytest.approx(1.0)
    m = compute_metrics(results(), {"ttft_ms": 1000, "tpot_ms": 100})
    assert m.good_requests == 1  # r1's TPOT of 133 ms misses; r2 has no TPOT; r3 failed
    m = compute_metrics(results(), {"e2el_ms": 1000})
    assert m.good_requests == 2


def test_vllm_keys_and_empty_runs():
    keys = vllm_keys(compute_metrics(results()))
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p95", "p99"):
            assert f"{stat}_{name}_ms" in keys
    assert keys["completed"] == 2 and keys["goodput"] is None and keys["request_goodput"] is None
    keys = vllm_keys(compute_metrics(results(), {"ttft_ms": 200}))
    assert keys["request_goodput"] == keys["goodput"] == pytest.approx(1.0)  # one good request over 1.0 s
    empty = compute_metrics([])
    assert (empty.completed, empty.duration, empty.request_throughput, empty.ttft.mean) == (0, 0.0, None, None)


def test_token_count_checks():
    rs = results()
    rs[0].tokenizer_output_tokens = 5
    rs[1].prompt_tokens = 21
    assert token_count_checks(rs, compare_prompts=True) == {
        "output_token_disagreements": 1, "output_tokens_compared": 1,
        "input_token_mismatches": 1, "input_tokens_compared": 2, "output_texts_cut": 0}
    assert token_count_checks(rs, compare_prompts=False)["input_token_mismatches"] == 0


def test_flagged_token_counts_become_one_warning_each_that_says_the_cause_where_the_run_shows_it():
    from infertrace.load.results.metrics import sum_token_checks, token_count_warnings

    record = PointRecord(config=None, results=[], warmup_results=[], metrics=compute_metrics([]),
                         token_checks={"output_token_disagreements": 3, "output_tokens_compared": 4,
                                       "input_token_mismatches": 0, "input_tokens_compared": 4},
                         client_cpu=None, process_cpu=None, client_lag=Stats.of([]))
    # every prompt counted alike: the tokenizer is the server's, so the ids do not round-trip
    [line] = record.warnings
    assert "in 3 of 4 request(s) because the generated ids do not round-trip" in line
    assert "all 4 prompts counted alike" in line and "usage is right" in line
    # prompts counted differently too: the tokenizer may be another
    record.token_checks = {**record.token_checks, "input_token_mismatches": 2}
    [line] = record.warnings
    assert "or --tokenizer is not the server's (prompts: 2 of 4 counted differently)" in line
    # no prompt compared (chat): both causes named
    record.token_checks = {"output_token_disagreements": 3, "output_tokens_compared": 4}
    [line] = record.warnings
    assert "Either the generated ids do not round-trip (random weights), or --tokenizer" in line
    record.token_checks = {"output_token_disagreements": 0, "input_token_mismatches": 2, "input_tokens_compared": 3}
    assert record.warnings == ["input tokens: the server counted 2 of 3 prompt(s) differently from their built "
                               "length: --tokenizer may not be the server's (see --requests-jsonl)"]
    # several runs: one warning over all of them
    runs = [{"output_token_disagreements": 2, "output_tokens_compared": 2, "input_tokens_compared": 2}] * 3
    [line] = token_count_warnings(sum_token_checks(runs), chunk_counted=False)
    assert "in 6 of 6 request(s)" in line and "all 6 prompts" in line


def test_peak_per_second_buckets_as_vllm_bench_serve():
    from infertrace.load.results.metrics import peak_per_second

    a = RequestResult(0, scheduled=0.0, t0=0.0, end=2.5, ttft=0.5, e2el=2.5, itl=[0.4, 0.4, 1.2])  # 0.5 .9 1.3 2.5
    b = RequestResult(1, scheduled=0.0, t0=1.2, end=1.9, ttft=0.3, e2el=0.7, itl=[0.2, 0.2])  # 1.5 1.7 1.9
    failed = RequestResult(2, scheduled=0.0, t0=0.0, end=1.0, error="HTTP 500: x")
    # buckets [0,1): 2 events, [1,2): 1 + 3, [2,3): 1; a is active in 0..2, b in 1..1
    assert peak_per_second([a, b, failed]) == (4.0, 2)
    assert peak_per_second([failed]) == (0.0, 0)


async def test_a_response_longer_than_max_tokens_could_make_is_kept_cut_and_counted_as_a_lower_bound():
    """A server streaming 10 MB text events: the client keeps text_cap characters, counts tokens in those only, and
    says the count is a lower bound (ten such events took bench to 7-12 GB and a tokenizer panic)."""
    from infertrace.load.client.target import Target
    from infertrace.load.client.timing import measure, resolve_output_tokens
    from infertrace.load.clock import ScriptedClock
    from infertrace.load.records import RequestSpec, StreamEvent, text_cap
    from infertrace.load.results.metrics import token_count_warnings

    class Flood(Target):
        def __init__(self, usage: bool):
            self.usage = usage

        async def stream(self, spec):
            for k in range(10):
                yield [StreamEvent(text="word " * 2_000_000, output=True,
                                   completion_tokens=k + 1 if self.usage else None)]
            yield [StreamEvent(finish_reason="length")]

    class Words:
        def __init__(self):
            self.longest = 0

        def encode(self, text, add_special_tokens=False):
            self.longest = max(self.longest, len(text))
            return text.split()

    spec = RequestSpec(0, "p", 16)
    cap = text_cap(16)
    assert cap < 10_000_000
    found = []
    for usage in (False, True):
        r = await measure(RequestResult(0, 0.0, 0.0, 0.0), Flood(usage), spec, ScriptedClock())
        assert len(r.text) == cap and r.text_cut and r.success
        words = Words()
        resolve_output_tokens([r], words, check_usage=True)
        assert words.longest == cap
        found.append(r)
    no_usage, usage = found
    assert (no_usage.output_tokens, no_usage.output_source) == (-(-cap // 5), TokenSource.TOKENIZER)  # lower bound
    assert (usage.output_tokens, usage.tokenizer_output_tokens) == (10, None)  # not compared with usage
    assert no_usage.to_json()["text_cut"] is True and "text_cut" not in results()[0].to_json()
    checks = token_count_checks(found, compare_prompts=False)
    assert checks["output_texts_cut"] == 2 and checks["output_token_disagreements"] == 0
    assert any("2 response(s) streamed more text than their max_tokens could make" in w
               for w in token_count_warnings(checks, False))
