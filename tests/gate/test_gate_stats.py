from __future__ import annotations

import pytest

from infertrace.gate.stats import bootstrap_interval


def ratio(now, before):
    return now / before - 1


def test_same_seed_same_interval_around_the_point():
    current, baseline = [95.0, 99.0, 101.0, 97.0, 104.0], [100.0, 98.0, 103.0]
    kwargs = {"confidence": 0.95, "resamples": 500}
    first = bootstrap_interval(ratio, current, baseline, seed=7, **kwargs)
    assert bootstrap_interval(ratio, current, baseline, seed=7, **kwargs) == first
    assert first[0] < ratio(99.0, 100.0) < first[1]


def test_single_runs_give_a_point():
    assert bootstrap_interval(ratio, [90.0], [100.0], confidence=0.95, resamples=200, seed=0) == pytest.approx(
        (-0.1, -0.1)
    )


def test_interval_spans_the_spread_of_three_repeats():
    low, high = bootstrap_interval(lambda now, _: now, [10.0, 20.0, 30.0], None, confidence=0.95, resamples=2000,
                                   seed=0)
    # a median of three resampled values lands on the smallest or largest value about a quarter of the time each
    assert (low, high) == (10.0, 30.0)


def test_lower_confidence_gives_a_narrower_interval():
    values = [float(v) for v in range(1, 31)]
    wide = bootstrap_interval(lambda now, _: now, values, None, confidence=0.99, resamples=2000, seed=0)
    narrow = bootstrap_interval(lambda now, _: now, values, None, confidence=0.6, resamples=2000, seed=0)
    assert wide[0] < narrow[0] < 15.5 < narrow[1] < wide[1]



def test_the_change_interval_is_the_point_with_one_run_a_side_and_narrows_with_runs():
    from infertrace.gate.stats import change_interval

    kwargs = {"confidence": 0.95, "resamples": 2000, "seed": 0}
    assert change_interval([90.0], [100.0], relative=True, **kwargs) == pytest.approx((-0.1, -0.1))
    assert change_interval([110.0], [100.0], relative=False, **kwargs) == pytest.approx((10.0, 10.0))
    slow, noisy = [50.0, 46.0, 58.0, 49.0, 53.0, 51.0, 47.0, 55.0, 48.0], [100.0, 60.0, 95.0]
    one = change_interval(slow[:1], noisy, relative=True, **kwargs)
    assert one[0] < one[1]  # one run borrows the baseline runs' scatter: not a point
    widths = [high - low for low, high in (change_interval(slow[:n], noisy, relative=True, **kwargs)
                                           for n in (3, 9))]
    assert widths[0] > widths[1]
    assert change_interval(slow, noisy, relative=True, **kwargs) == change_interval(slow, noisy, relative=True,
                                                                                   **kwargs)
