from __future__ import annotations

import pytest

from infertrace.gate.bounds import Bound, Kind
from infertrace.gate.check import GateConfig, Verdict, evaluate
from infertrace.gate.results import ResultError, Run

CONFIG = GateConfig()


def runs(metric: str, values: list[float]) -> list[Run]:
    return [Run(f"run{i}.json", {metric: value}) for i, value in enumerate(values)]


DROP_5 = Bound("output_throughput", Kind.MAX_DROP, 0.05, relative=True)
RISE_20MS = Bound("p99_ttft_ms", Kind.MAX_RISE, 20.0)


def verdict(bound: Bound, current: list[float], baseline: list[float] | None = None) -> Verdict:
    before = runs(bound.metric, baseline) if baseline is not None else []
    report = evaluate(runs(bound.metric, current), before, [bound], CONFIG)
    return report.checks[0].verdict


@pytest.mark.parametrize(
    ("current", "baseline", "expected"),
    [
        ([100.0, 99.0, 101.0], [100.0, 100.5, 99.5], Verdict.OK),
        ([95.0], [100.0], Verdict.OK),  # exactly the limit passes
        ([94.0], [100.0], Verdict.REGRESSION),  # one run each: no noise estimate, the point decides
        ([93.0, 99.0, 92.0], [100.0, 99.0, 101.0], Verdict.NOISE),  # median breaches, one repeat reaches back
        ([80.0, 82.0, 81.0], [100.0, 99.0, 101.0], Verdict.REGRESSION),
        ([120.0, 121.0, 119.0], [100.0, 99.0, 101.0], Verdict.OK),  # an improvement
    ],
)
def test_max_drop_verdicts(current, baseline, expected):
    assert verdict(DROP_5, current, baseline) is expected


@pytest.mark.parametrize(
    ("current", "baseline", "expected"),
    [
        ([210.0, 215.0, 219.0], [200.0, 201.0, 199.0], Verdict.OK),
        ([230.0, 240.0, 205.0], [200.0, 201.0, 199.0], Verdict.NOISE),
        ([230.0, 240.0, 235.0], [200.0, 201.0, 199.0], Verdict.REGRESSION),
        ([150.0], [200.0], Verdict.OK),
    ],
)
def test_max_rise_absolute_verdicts(current, baseline, expected):
    assert verdict(RISE_20MS, current, baseline) is expected


def test_min_and_max_need_no_baseline():
    floor = Bound("output_throughput", Kind.MIN, 100.0)
    assert verdict(floor, [120.0, 110.0, 130.0]) is Verdict.OK
    assert verdict(floor, [90.0, 110.0, 95.0]) is Verdict.NOISE
    assert verdict(floor, [90.0, 80.0, 95.0]) is Verdict.REGRESSION
    assert verdict(Bound("failed", Kind.MAX, 0.0), [0, 1, 0]) is Verdict.OK
    assert verdict(Bound("failed", Kind.MAX, 0.0), [2, 1, 3]) is Verdict.REGRESSION


def test_report_carries_medians_change_and_interval():
    report = evaluate(runs("output_throughput", [80.0, 82.0, 81.0]), runs("output_throughput", [100.0, 98.0, 102.0]),
                      [DROP_5], CONFIG)
    check = report.checks[0]
    assert (check.current, check.baseline) == (81.0, 100.0)
    assert check.change == pytest.approx(-0.19)
    low, high = check.interval
    assert low <= check.change <= high < -0.05
    assert report.regressed and (report.current_runs, report.baseline_runs) == (3, 3)


def test_the_verdict_is_deterministic():
    def once():
        return evaluate(runs("output_throughput", [93.0, 99.0, 92.0, 96.0]),
                        runs("output_throughput", [100.0, 97.0, 101.0]), [DROP_5], CONFIG).checks[0]

    assert once() == once()


def test_relative_bound_on_zero_baseline_is_unusable():
    with pytest.raises(ResultError, match="needs a positive baseline"):
        evaluate(runs("failed", [1]), runs("failed", [0]), [Bound("failed", Kind.MAX_RISE, 0.1, relative=True)],
                 CONFIG)


def test_missing_metric_is_unusable():
    with pytest.raises(ResultError, match="run0.json has no metric 'p99_ttft_ms'"):
        evaluate(runs("output_throughput", [1.0]), [], [Bound("p99_ttft_ms", Kind.MAX, 1.0)], CONFIG)


def test_config_is_validated():
    with pytest.raises(ValueError, match="confidence"):
        GateConfig(confidence=1.0)
    with pytest.raises(ValueError, match="resamples"):
        GateConfig(resamples=10)
    with pytest.raises(ValueError, match="resamples must be from 100 to 1,000,000, got 1,000,001"):
        GateConfig(resamples=1_000_001)


@pytest.mark.parametrize(
    "baseline",
    [
        [100.0, 60.0, 95.0],  # a shared CPU, where one run of three came out 40% slow
        [100.0, 99.0, 101.0],
        [100.0],
    ],
)
def test_more_runs_of_the_same_slowdown_never_turn_a_regression_into_a_pass(baseline):
    # the runs of one build at about half the baseline's throughput, taken in the order they came
    slow = [50.0, 46.0, 58.0, 49.0, 53.0, 51.0, 47.0, 55.0, 48.0]
    verdicts = [verdict(DROP_5, slow[:n], baseline) for n in range(1, len(slow) + 1)]
    first = verdicts.index(Verdict.REGRESSION)  # with enough runs it is found
    assert all(v is Verdict.REGRESSION for v in verdicts[first:]), verdicts


def test_one_run_and_three_runs_of_one_slowdown_get_the_same_verdict():
    # resampled from its own runs only, one run had no scatter and failed, and three such runs spread over their
    # range, reached the baseline's slow run (60) and passed as "within noise"
    assert verdict(DROP_5, [50.0], [100.0, 60.0, 95.0]) is Verdict.REGRESSION
    assert verdict(DROP_5, [50.0, 46.0, 58.0], [100.0, 60.0, 95.0]) is Verdict.REGRESSION


def test_a_run_at_zero_is_a_regression_not_a_crash():
    assert verdict(DROP_5, [0.0], [100.0, 99.0, 101.0]) is Verdict.REGRESSION
    assert verdict(DROP_5, [0.0, 0.0, 1.0], [100.0, 99.0, 101.0]) is Verdict.REGRESSION
