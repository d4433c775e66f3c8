from __future__ import annotations

import pytest

from infertrace.gate.bounds import Bound, Kind, higher_is_better, metric_unit, parse_bounds


def test_relative_and_absolute_limits():
    assert parse_bounds(Kind.MAX_DROP, ("output_throughput=5%",)) == [
        Bound("output_throughput", Kind.MAX_DROP, 0.05, relative=True)
    ]
    assert parse_bounds(Kind.MAX_RISE, ("p99_ttft_ms=+20ms",)) == [Bound("p99_ttft_ms", Kind.MAX_RISE, 20.0)]
    assert parse_bounds(Kind.MIN, ("output_throughput=100",)) == [Bound("output_throughput", Kind.MIN, 100.0)]
    assert parse_bounds(Kind.MAX, ("failed=0",)) == [Bound("failed", Kind.MAX, 0.0)]


def test_time_units_convert_to_the_metric_unit():
    assert parse_bounds(Kind.MAX_RISE, ("p99_ttft_ms=0.25s",))[0].limit == pytest.approx(250.0)
    assert parse_bounds(Kind.MAX_RISE, ("p99_ttft_ms=500us",))[0].limit == pytest.approx(0.5)
    assert parse_bounds(Kind.MAX, ("duration=1500ms",))[0].limit == pytest.approx(1.5)
    assert parse_bounds(Kind.MAX_DROP, ("output_throughput=20tok/s",))[0].limit == 20.0


def test_commas_and_repeats_give_several_bounds():
    bounds = parse_bounds(Kind.MAX_RISE, ("p99_ttft_ms=10%, median_tpot_ms=5%", "p99_itl_ms=+3ms"))
    assert [(b.metric, b.limit, b.relative) for b in bounds] == [
        ("p99_ttft_ms", 0.10, True), ("median_tpot_ms", 0.05, True), ("p99_itl_ms", 3.0, False),
    ]


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        (Kind.MAX_DROP, "output_throughput", "is not METRIC=LIMIT"),
        (Kind.MAX_DROP, "=5%", "is not METRIC=LIMIT"),
        (Kind.MAX_DROP, "output_throughput=fast", "is not a number"),
        (Kind.MAX_DROP, "output_throughput=-5%", "cannot be negative"),
        (Kind.MIN, "output_throughput=5%", "takes a value, not a percentage"),
        (Kind.MAX_RISE, "p99_ttft_ms=20tok/s", "unit 'tok/s' does not fit p99_ttft_ms, which is in ms"),
        (Kind.MAX_DROP, "request_throughput=3tok/s", "which is in req/s"),
        (Kind.MAX, "failed=1ms", "which has no unit"),
        (Kind.MAX_DROP, "output_throughput=inf%", "is not a number"),
        (Kind.MAX_DROP, "output_throughput=1e400%", "1e400 is out of range; give a finite number"),
        (Kind.MAX_RISE, "p99_ttft_ms=+1e400ms", "out of range"),
        (Kind.MIN, "output_throughput=-1e999", "out of range"),
    ],
)
def test_bad_specs_say_why(kind, spec, message):
    with pytest.raises(ValueError, match=message):
        parse_bounds(kind, (spec,))


def test_thresholds_and_sides():
    drop = Bound("output_throughput", Kind.MAX_DROP, 0.05, relative=True)
    rise = Bound("p99_ttft_ms", Kind.MAX_RISE, 20.0)
    assert (drop.threshold, drop.is_floor, drop.needs_baseline) == (-0.05, True, True)
    assert (rise.threshold, rise.is_floor, rise.needs_baseline) == (20.0, False, True)
    assert not Bound("failed", Kind.MAX, 0.0).needs_baseline


def test_allowed_region_and_units():
    assert Bound("output_throughput", Kind.MAX_DROP, 0.05, relative=True).allowed() == "≥ -5%"
    assert Bound("p99_ttft_ms", Kind.MAX_RISE, 20.0).allowed() == "≤ +20 ms"
    assert Bound("output_throughput", Kind.MIN, 100.0).allowed() == "≥ 100 tok/s"
    assert Bound("failed", Kind.MAX, 0.0).allowed() == "≤ 0"
    assert [metric_unit(m) for m in ("mean_itl_ms", "duration", "goodput", "total_token_throughput", "failed")] == [
        "ms", "s", "req/s", "tok/s", "",
    ]
    assert higher_is_better("output_throughput") is True
    assert higher_is_better("p99_e2el_ms") is False
    assert higher_is_better("total_input_tokens") is None
