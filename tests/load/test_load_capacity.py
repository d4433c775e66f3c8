"""The SLO capacity search's decisions, against a fake point runner whose p99 is a known function of load."""

import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from infertrace.load.capacity import SaturationDetector, percentile_interval, samples_ms, saturated, search
from infertrace.load.command import bench
from infertrace.load.config import BenchConfig, parse_slo, percentile_slo
from infertrace.load.records import RequestResult

# 200 exponential TTFTs at evenly spaced probabilities, scaled so that their p99 is exactly 1
_RAW = -np.log(1 - (np.arange(200) + 0.5) / 200)
GRID = _RAW / np.percentile(_RAW, 99)


def fake_run(p99_of_load, noise=lambda: 1.0, saturating_from=math.inf):
    calls = []

    async def run(load):
        calls.append(load)
        if load >= saturating_from:
            return SimpleNamespace(results=[], interrupted=False, stopped_early=True)
        ttfts = GRID * p99_of_load(load) * noise() / 1000.0
        results = [RequestResult(i, 0.0, 0.0, 0.0, ttft=t, e2el=t) for i, t in enumerate(ttfts)]
        return SimpleNamespace(results=results, interrupted=False, stopped_early=False)

    return run, calls


def runs_at(calls, load):
    return sum(c == load for c in calls)


async def test_concurrency_boundary_is_found_exactly_with_a_noiseless_target():
    run, calls = fake_run(lambda c: 40.0 * c)  # p99 TTFT 40 ms per concurrent request: 500 ms holds up to 12
    cap = await search("concurrency", {"p99_ttft_ms": 500.0}, 1, 1024, 20, 3, run)
    assert (cap.max_load, cap.first_failing_load, cap.stopped) == (12, 13, "resolution")
    assert [t.load for t in cap.trials][:6] == [1, 2, 4, 8, 16, 12]  # doubling, then bisecting
    assert cap.best.passed and cap.best.estimates["p99_ttft_ms"].value_ms <= 500.0
    far = [t for t in cap.trials if t.load in (1, 2, 4)]
    assert all(len(t.records) == 1 and t.decided_by == "interval" for t in far)  # far from the bound: one run
    near = [t for t in cap.trials if t.load in (12, 13)]
    assert all(len(t.records) > 1 for t in near)  # near it: repeated


@pytest.mark.parametrize("seed", range(5))
async def test_request_rate_boundary_within_resolution_under_run_to_run_noise(seed):
    rng = random.Random(seed)
    run, calls = fake_run(lambda r: 25.0 * r, noise=lambda: rng.uniform(0.93, 1.07))  # true boundary: 20 req/s
    cap = await search("request_rate", {"p99_ttft_ms": 500.0}, 1.0, 1024.0, 20, 3, run)
    assert cap.stopped == "resolution"
    assert 20.0 / 1.1 <= cap.max_load <= 20.0 * 1.07  # within the noise and the 5% resolution of the truth
    assert cap.first_failing_load - cap.max_load <= 0.05 * cap.max_load


async def test_one_noisy_run_does_not_flip_a_passing_load():
    # true p99 at load 8 is 400 ms (20% under the bound); the first run there reads 30% high (520 ms)
    factors = iter([1.3, 1.0, 1.0])

    async def run(load):
        ttfts = GRID * 50.0 * load * next(factors) / 1000.0
        return SimpleNamespace(results=[RequestResult(i, 0.0, 0.0, 0.0, ttft=t, e2el=t) for i, t in enumerate(ttfts)],
                               interrupted=False, stopped_early=False)

    cap = await search("concurrency", {"p99_ttft_ms": 500.0}, 8, 8, 1, 3, run)
    trial = cap.trials[0]
    assert trial.passed and len(trial.records) > 1 and cap.max_load == 8
    # the same first run alone (no repeats allowed) would have failed the load
    factors = iter([1.3])
    alone = await search("concurrency", {"p99_ttft_ms": 500.0}, 8, 8, 1, 1, run)
    assert not alone.trials[0].passed


async def test_a_saturating_load_fails_after_one_run_and_the_search_goes_below_it():
    run, calls = fake_run(lambda r: 10.0 * r, saturating_from=32.0)  # bound 500 ms would allow 50 req/s
    cap = await search("request_rate", {"p99_ttft_ms": 500.0}, 1.0, 1024.0, 20, 3, run)
    assert runs_at(calls, 32.0) == 1
    saturated_trials = [t for t in cap.trials if t.decided_by == "saturated"]
    assert saturated_trials and all(not t.passed and len(t.records) == 1 for t in saturated_trials)
    assert 16.0 <= cap.max_load < 32.0 and cap.first_failing_load <= 32.0


async def test_limits_start_failure_and_point_cap():
    run, _ = fake_run(lambda c: 1.0)
    cap = await search("concurrency", {"p99_ttft_ms": 500.0}, 1, 6, 20, 3, run)
    assert ([t.load for t in cap.trials], cap.max_load, cap.first_failing_load, cap.stopped) == \
        ([1, 2, 4, 6], 6, None, "limit")
    run, _ = fake_run(lambda c: 1000.0)
    cap = await search("concurrency", {"p99_ttft_ms": 500.0}, 1, 64, 20, 3, run)
    assert (cap.max_load, cap.stopped, len(cap.trials)) == (None, "start failed", 1)
    run, _ = fake_run(lambda c: 1.0)
    cap = await search("concurrency", {"p99_ttft_ms": 500.0}, 1, 1024, 3, 3, run)
    assert (len(cap.trials), cap.stopped, cap.max_load) == (3, "points", 4)


async def test_every_bound_must_hold_and_failed_requests_are_misses():
    async def run(load):
        ok = [RequestResult(i, 0.0, 0.0, 0.0, ttft=0.01, e2el=0.01 * load) for i in range(100)]
        failed = [RequestResult(100 + i, 0.0, 0.0, 0.0, error="http 500") for i in range(int(load))]
        return SimpleNamespace(results=ok + failed, interrupted=False, stopped_early=False)

    cap = await search("concurrency", {"p99_ttft_ms": 100.0, "median_e2el_ms": 1e9}, 1, 64, 20, 3, run)
    assert (cap.max_load, cap.first_failing_load) == (1, 2)  # 2 failures in 102 requests: the p99 is a miss


def test_percentile_interval_is_seeded_and_covers_the_estimate():
    x = np.random.default_rng(0).exponential(100.0, 500)
    e = percentile_interval(x, 99)
    assert e.low_ms <= e.value_ms <= e.high_ms and e.value_ms == pytest.approx(np.percentile(x, 99))
    assert percentile_interval(x, 99) == e
    wide, narrow = percentile_interval(x[:100], 50), percentile_interval(np.tile(x[:100], 20), 50)
    assert narrow.high_ms - narrow.low_ms < (wide.high_ms - wide.low_ms) / 2
    assert percentile_interval(np.array([1.0, math.inf]), 99).value_ms == math.inf


def test_samples_per_metric():
    ok = RequestResult(0, 0.0, 0.0, 1.0, ttft=0.1, e2el=0.5, itl=[0.2, 0.2], output_tokens=3)
    bad = RequestResult(1, 0.0, 0.0, 1.0, error="timeout")
    assert samples_ms([ok, bad], "ttft").tolist() == [100.0, math.inf]
    assert samples_ms([ok, bad], "tpot").tolist() == [200.0, math.inf]
    assert samples_ms([ok], "itl").tolist() == [200.0, 200.0]


def test_saturation_is_a_rising_line_of_ttft_against_send_time():
    sends = [i * 0.1 for i in range(40)]
    assert saturated(sends, [0.05 + 0.5 * t for t in sends])  # the queue adds half a second every second
    assert not saturated(sends, [0.05 + 0.01 * (i % 5) for i in range(40)])  # flat: the target keeps up
    assert not saturated(sends[:20], [0.5 * t for t in sends[:20]])  # too few requests to tell
    assert not saturated([0.0] * 40, [0.1 * i for i in range(40)])  # all sent at once: a burst, not a queue
    fired = []
    detector = SaturationDetector(lambda: fired.append(True))
    for t in sends:
        detector.add(RequestResult(0, t, t, t + 1, ttft=0.05 + 0.5 * t))
    assert fired == [True]


def test_slo_keys_for_goodput_and_for_the_search():
    assert percentile_slo("p99_ttft_ms") == (99, "ttft") and percentile_slo("median_itl_ms") == (50, "itl")
    assert percentile_slo("ttft_ms") is None and percentile_slo("p98_ttft_ms") is None
    cfg = BenchConfig(find_max="concurrency", slo=parse_slo("p99_ttft_ms=500,tpot_ms=50"))
    assert cfg.run_slo == {"p99_ttft_ms": 500.0} and cfg.request_slo == {"tpot_ms": 50.0}
    assert BenchConfig(slo={"ttft_ms": 100.0}).request_slo == {"ttft_ms": 100.0}  # goodput as before


@pytest.mark.parametrize("args, message", [
    (["--find-max", "concurrency"], "--find-max needs --slo with run-level bounds"),
    (["--find-max", "concurrency", "--slo", "ttft_ms=100"], "--find-max needs --slo with run-level bounds"),
    (["--find-max", "concurrency", "--slo", "p99_ttft_ms=100", "--sweep", "concurrency=1,2"],
     "cannot be combined with --sweep"),
    (["--find-max", "request-rate", "--slo", "p99_ttft_ms=100", "--request-rate", "3"], "drop --request-rate"),
    (["--find-max", "concurrency", "--slo", "p99_ttft_ms=100", "--find-max-start", "1.5"], "whole numbers"),
    (["--find-max", "concurrency", "--slo", "p99_ttft_ms=100", "--find-max-start", "64", "--find-max-limit", "8"],
     "--find-max-start 64 is above --find-max-limit 8"),
    (["--find-max", "concurrency", "--slo", "p99_ttft_ms=100", "--find-max-limit", "nan"], "find_max_limit must be"),
    (["--find-max", "concurrency", "--slo", "p99_ttft_ms=100", "--find-max-points", "0"], "find_max_points must be"),
    (["--slo", "p99_ttft_ms=100"], "SLO p99_ttft_ms bounds a whole run and is used by --find-max"),
    (["--slo", "p98_ttft_ms=100"], "unknown SLO 'p98_ttft_ms'"),
    (["--find-max", "concurrency", "--slo", "p99_ttft_ms=-1"], "SLO p99_ttft_ms must be a positive number"),
])
def test_bad_find_max_options_are_one_line_and_exit_2(args, message):
    res = CliRunner().invoke(bench, args, catch_exceptions=False)
    assert res.exit_code == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_cli_find_max_runs_each_point_through_bench_and_writes_table_json_and_plot(standin, prompts_jsonl, tmp_path):
    import json

    out = tmp_path / "cap.json"
    res = CliRunner().invoke(bench, [str(a) for a in (
        "--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl, "--num-prompts", 6,
        "--warmup", 0, "--find-max", "concurrency", "--slo", "p99_ttft_ms=60000,median_e2el_ms=60000,ttft_ms=60000",
        "--find-max-limit", 4, "--result-json", out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    shown = " ".join(res.stdout.split())
    assert "max concurrency 4" in shown and "search ended: limit" in shown
    # the bounds as --slo takes them, not a Python dict; a warning every run gives is printed once
    assert "--find-max concurrency p99_ttft_ms<=60000, median_e2el_ms<=60000:" in shown
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    kinds = [w.split(":")[1] for w in warnings]
    assert len(kinds) == len(set(kinds)), warnings
    doc = json.loads(out.read_text())
    fm = doc["find_max"]
    assert (fm["param"], fm["max_load"], fm["first_failing_load"], fm["stopped"]) == ("concurrency", 4, None, "limit")
    assert [p["load"] for p in fm["points"]] == [1, 2, 4] and all(p["passed"] for p in fm["points"])
    runs = [r for p in fm["points"] for r in p["results"]]
    assert [r["max_concurrency"] for r in runs] == [1, 2, 4] and all(r["completed"] == 6 for r in runs)
    assert all(r["goodput"] is not None for r in runs)  # the per-request bound still gives goodput
    b = fm["points"][0]["bounds"]["p99_ttft_ms"]
    assert b["low_ms"] <= b["estimate_ms"] <= b["high_ms"] < 60000
    assert standin.count == 18 and out.with_suffix(".png").stat().st_size > 0


async def test_a_point_stopped_as_saturated_keeps_its_results_and_the_next_point_runs(monkeypatch):
    import asyncio

    import infertrace.load.workloads.prompts as prompts
    from infertrace.load.benchmark import Hooks, Interrupter, run_point
    from infertrace.load.client.target import Target
    from infertrace.load.clock import MonotonicClock
    from infertrace.load.records import RequestSpec, StreamEvent

    class SlowTarget(Target):
        kind, tokenizer = "embedded", None

        async def stream(self, spec):
            for k in range(3):
                await asyncio.sleep(0.01)
                yield [StreamEvent(text="x", num_tokens=1, completion_tokens=k + 1, output=True,
                                   finish_reason="length" if k == 2 else None)]

    monkeypatch.setattr(prompts, "build_specs", lambda cfg, tok, n, stream, point=0, max_model_len=None: [
        RequestSpec(i, "p", 3) for i in range(n)])
    interrupter = Interrupter()
    seen = []

    def on_result(r):
        seen.append(r)
        if len(seen) == 3:
            interrupter.stop_phase()

    cfg = BenchConfig(request_rate=200.0, num_prompts=400, warmup=0)
    stopped = await run_point(cfg, SlowTarget(), MonotonicClock(), interrupter, Hooks(on_result=on_result))
    assert stopped.stopped_early and not stopped.interrupted and 3 <= len(stopped.results) < 400
    after = await run_point(BenchConfig(request_rate=200.0, num_prompts=5, warmup=0), SlowTarget(), MonotonicClock(),
                            interrupter, Hooks())
    assert not after.stopped_early and after.metrics.completed == 5


def test_cli_find_max_concurrency_gives_each_load_a_pool_that_fits_it(standin, tmp_path):
    """A server that generates 11 streams at once (the rest queue inside it): the search finds 11, which a
    connection pool sized for the default 8 could never let it see."""
    import json

    standin.set_slots(11)
    standin.token_delay = 0.04
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p {i}", "max_tokens": 4}) + "\n" for i in range(24)))
    out = tmp_path / "cap.json"
    res = CliRunner().invoke(bench, [str(a) for a in (
        "--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts, "--num-prompts", 24,
        "--warmup", 0, "--find-max", "concurrency", "--find-max-start", 8, "--find-max-limit", 16,
        "--find-max-repeats", 1, "--slo", "p99_ttft_ms=100", "--result-json", out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    fm = json.loads(out.read_text())["find_max"]
    assert (fm["max_load"], fm["first_failing_load"]) == (11, 12), [(p["load"], p["passed"]) for p in fm["points"]]
    assert max(r["max_concurrency"] for p in fm["points"] for r in p["results"]) == 16


def test_the_open_file_check_covers_every_load_a_run_can_reach():
    """The pool has no cap of its own, so the open-file check must count the most requests a run can have in
    flight: a search's highest concurrency, an uncapped open loop's every request (None)."""
    assert BenchConfig(find_max="concurrency", slo={"p99_ttft_ms": 100}, find_max_limit=64).max_in_flight == 64
    assert BenchConfig(find_max="request_rate", slo={"p99_ttft_ms": 100}).max_in_flight is None
    assert BenchConfig(find_max="request_rate", slo={"p99_ttft_ms": 100}, concurrency=32).max_in_flight == 32
    assert BenchConfig(sweep_param="concurrency", sweep_values=(1, 4, 16)).max_in_flight == 16
    assert BenchConfig(dataset="trace", dataset_path="t.jsonl").max_in_flight is None
