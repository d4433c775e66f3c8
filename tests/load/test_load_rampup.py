"""Ramp-up schedules (vLLM 0.33's meaning) and the steady-state window, on hand-built results and a scripted clock."""

import numpy as np
import pytest

from infertrace.load.benchmark import Hooks, Interrupter, run_point
from infertrace.load.client.target import Target
from infertrace.load.clock import ScriptedClock
from infertrace.load.config import BenchConfig
from infertrace.load.records import RequestResult, RequestSpec, StreamEvent
from infertrace.load.results.result import point_result
from infertrace.load.results.steady import median_in_flight, steady_state
from infertrace.load.workloads.dataset import seeded_rng
from infertrace.load.workloads.schedule import ramp_rate, ramp_up_offsets


@pytest.mark.parametrize(("strategy", "rates"), [
    ("linear", (2.0, 5.0, 8.0)),
    ("exponential", (2.0, 4.0, 8.0)),  # 2 * 4**0.5: the geometric middle
])
def test_rate_at_progress_zero_half_one(strategy, rates):
    assert [ramp_rate(strategy, 2.0, 8.0, p) for p in (0.0, 0.5, 1.0)] == pytest.approx(rates)


def test_ramp_schedule_counts_first_at_zero_and_gaps_follow_the_rate():
    offsets = ramp_up_offsets("linear", 1.0, 100.0, 1.0, seeded_rng(0, "arrivals"), 4001)
    assert len(offsets) == 4001 and offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = np.diff(offsets)
    # gap i (before request i + 1) has mean 1 / rate(progress (i + 1) / 4000)
    rates = np.array([ramp_rate("linear", 1.0, 100.0, (i + 1) / 4000) for i in range(4000)])
    assert (gaps * rates).mean() == pytest.approx(1.0, rel=0.05)
    first, last = gaps[:400].mean(), gaps[-400:].mean()
    assert first > 5 * last  # the rate rose about tenfold from the first tenth to the last
    assert len(ramp_up_offsets("exponential", 1.0, 4.0, 1.0, seeded_rng(0, "arrivals"), 1)) == 1
    assert ramp_up_offsets("exponential", 1.0, 4.0, 1.0, seeded_rng(0, "arrivals"), 0) == []


def test_ramp_burstiness_is_the_gamma_shape_at_a_flat_ramp():
    offsets = ramp_up_offsets("linear", 10.0, 10.0, 4.0, seeded_rng(0, "arrivals"), 20001)
    gaps = np.diff(offsets)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(0.5, rel=0.05)  # gamma shape 4: CV 1/sqrt(4)


def test_ramp_is_repeatable_by_seed():
    a = ramp_up_offsets("exponential", 1.0, 8.0, 0.5, seeded_rng(3, "arrivals"), 50)
    assert a == ramp_up_offsets("exponential", 1.0, 8.0, 0.5, seeded_rng(3, "arrivals"), 50)


def done(t0, ttft, itl, end=None, tokens=None):
    e2el = ttft + sum(itl)
    return RequestResult(0, scheduled=t0, t0=t0, end=end if end is not None else t0 + e2el, ttft=ttft, e2el=e2el,
                         itl=list(itl), chunk_tokens=tokens or [1] * (len(itl) + 1),
                         output_tokens=sum(tokens) if tokens else len(itl) + 1)


def test_closed_loop_window_from_reaching_concurrency_to_the_last_moment_there():
    # concurrency 2: A [0, 4], B sent at 1 (the level is reached), C replaces A at 4, B ends at 6 (drain)
    a = done(0.0, 0.5, [1.0, 1.0, 1.0, 0.5])  # events at 0.5, 1.5, 2.5, 3.5, 4.0
    b = done(1.0, 0.5, [1.0, 1.0, 1.0, 1.0])  # events at 1.5, 2.5, ..., 5.5; ends at 6.0
    b.end = 6.0
    c = done(4.0, 0.5, [1.0, 1.0, 1.0])  # events at 4.5, 5.5, 6.5, 7.5
    s = steady_state([a, b, c], target=2)
    assert (s.start, s.end, s.in_flight) == (1.0, 6.0, 2)
    # a: 1.5, 2.5, 3.5, 4.0 (4); b: 1.5 .. 5.5 (5); c: 4.5, 5.5 (2)
    assert s.output_tokens == 11
    assert s.output_throughput == pytest.approx(11 / 5)


def test_a_level_never_reached_has_no_window():
    # concurrency 2 split over two workers whose requests never overlapped: A [0, 1.5], B [2, 3.5]
    a, b = done(0.0, 0.5, [1.0]), done(2.0, 0.5, [1.0])
    assert steady_state([a, b], target=2) is None


def test_chunk_token_counts_weight_the_events_and_unknown_counts_spread_evenly():
    a = done(0.0, 1.0, [1.0], tokens=[3, 5])  # 3 tokens at 1.0, 5 at 2.0
    b = done(0.0, 1.0, [1.0])
    b.chunk_tokens, b.output_tokens = [None, None], 6  # 3 tokens per event
    s = steady_state([a, b], target=2)
    assert (s.start, s.end) == (0.0, 2.0) and s.output_tokens == 3 + 5 + 6


def test_open_loop_window_uses_the_time_weighted_median_of_in_flight():
    # one request sent each second for 10 s, each lasting 3 s: in flight 1, 2, then 3 from t=2 until the last
    # send at 9; the median level over [0, 9] is 3
    results = [done(float(i), 1.0, [1.0, 1.0]) for i in range(10)]
    assert median_in_flight(results) == 3
    s = steady_state(results, target=None)
    # the level 3 is first reached at 2 and last held until 10 (the request sent at 8 ends)
    assert (s.start, s.end, s.in_flight) == (2.0, 10.0, 3)
    # events at t0+1, t0+2, t0+3 of each request, counted inside [2, 10]
    times = [t0 + k for t0 in range(10) for k in (1, 2, 3)]
    assert s.output_tokens == sum(2 <= t <= 10 for t in times)


def test_failed_requests_hold_a_slot_but_emit_no_tokens():
    ok = done(0.0, 1.0, [1.0])
    bad = RequestResult(1, scheduled=0.0, t0=0.0, end=2.0, error="http 500")
    s = steady_state([ok, bad], target=2)
    assert (s.start, s.end, s.output_tokens) == (0.0, 2.0, 2)
    assert steady_state([], target=2) is None


class TickTarget(Target):
    """Each request streams 4 one-token events, `step` scripted seconds apart."""

    kind = "embedded"
    tokenizer = None

    def __init__(self, clock, step=0.5):
        self.clock, self.step = clock, step

    async def stream(self, spec):
        for k in range(4):
            await self.clock.sleep_until(self.clock.now() + self.step)
            yield [StreamEvent(text="x", num_tokens=1, completion_tokens=k + 1, output=True,
                               finish_reason="length" if k == 3 else None)]


async def test_run_point_ramps_and_reports_steady_throughput(monkeypatch):
    import infertrace.load.workloads.prompts as prompts

    monkeypatch.setattr(prompts, "build_specs", lambda cfg, tok, n, stream, point=0, max_model_len=None: [
        RequestSpec(i, "p", 4) for i in range(n)])
    clock = ScriptedClock()
    cfg = BenchConfig(ramp_up_strategy="linear", ramp_up_start_rps=1.0, ramp_up_end_rps=4.0, num_prompts=12,
                      warmup=0)
    record = await run_point(cfg, TickTarget(clock), clock, Interrupter(), Hooks())
    sends = sorted(r.scheduled for r in record.results)
    expected = ramp_up_offsets("linear", 1.0, 4.0, 1.0, seeded_rng(0, "arrivals", 0), 12)
    assert [t - sends[0] for t in sends] == pytest.approx(expected)
    assert record.steady is not None and record.steady.output_throughput is not None
    out = point_result(record)
    assert out["request_rate"] == "inf" and out["ramp_up_strategy"] == "linear"
    assert out["ramp_up_start_rps"] == 1.0 and out["ramp_up_end_rps"] == 4.0
    assert out["steady_output_throughput"] == pytest.approx(record.steady.output_throughput)
    start_s, end_s = out["steady_state_window_s"]
    assert 0.0 <= start_s < end_s <= record.metrics.duration


def test_cli_ramp_run_writes_vllm_ramp_keys_and_steady_state(standin, prompts_jsonl, tmp_path):
    import json

    from click.testing import CliRunner

    from infertrace.load.command import bench

    out, reqs = tmp_path / "r.json", tmp_path / "r.jsonl"
    res = CliRunner().invoke(bench, [str(a) for a in (
        "--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl, "--num-prompts", 10,
        "--ramp-up-strategy", "exponential", "--ramp-up-start-rps", 10, "--ramp-up-end-rps", 80, "--seed", 2,
        "--warmup", 0, "--result-json", out, "--requests-jsonl", reqs)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "exponential ramp 10 -> 80 req/s" in res.stdout and "steady output throughput" in res.stdout
    doc = json.loads(out.read_text())
    assert (doc["request_rate"], doc["ramp_up_strategy"], doc["ramp_up_start_rps"], doc["ramp_up_end_rps"]) == \
        ("inf", "exponential", 10.0, 80.0)
    assert doc["steady_output_throughput"] > 0 and len(doc["steady_state_window_s"]) == 2
    lines = sorted(map(json.loads, reqs.read_text().splitlines()), key=lambda line: line["index"])
    expected = ramp_up_offsets("exponential", 10.0, 80.0, 1.0, seeded_rng(2, "arrivals", 0), 10)
    assert [line["scheduled_s"] - lines[0]["scheduled_s"] for line in lines] == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("args, message", [
    (["--ramp-up-start-rps", "1"], "--ramp-up-start-rps needs --ramp-up-strategy linear|exponential"),
    (["--ramp-up-end-rps", "4"], "--ramp-up-end-rps needs --ramp-up-strategy"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"], "needs both --ramp-up-start-rps and"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "-2"],
     "ramp_up_end_rps must be a positive finite number of requests per second, got -2.0"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "0", "--ramp-up-end-rps", "2"],
     "ramp_up_start_rps must be a positive finite number"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "inf"],
     "ramp_up_end_rps must be a positive finite number"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "5", "--ramp-up-end-rps", "2"], "ramp-up goes up"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "2", "--request-rate", "3"],
     "drop --request-rate"),
    (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps", "2", "--duration", "3"],
     "cannot be combined with --duration"),
])
def test_bad_ramp_options_are_one_line_and_exit_2(args, message):
    from click.testing import CliRunner

    from infertrace.load.command import bench

    res = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert res.exit_code == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1
