import math

import numpy as np
import pytest

from infertrace.load.workloads.dataset import seeded_rng
from infertrace.load.workloads.schedule import arrival_offsets


def gaps(rate, burstiness, n=20000):
    return np.diff(arrival_offsets(rate, burstiness, seeded_rng(0, "arrivals"), count=n))


def test_count_first_arrival_and_mean_rate():
    offsets = arrival_offsets(4.0, 1.0, seeded_rng(0, "arrivals"), count=10)
    assert len(offsets) == 10 and offsets[0] == 0.0 and offsets == sorted(offsets)
    assert gaps(4.0, 1.0).mean() == pytest.approx(0.25, rel=0.03)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_burstiness_is_the_gamma_shape(burstiness):
    g = gaps(10.0, burstiness)
    assert g.mean() == pytest.approx(0.1, rel=0.04)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)  # gamma: CV = 1/sqrt(k)


def test_duration_bound_and_infinite_rate():
    offsets = arrival_offsets(50.0, 1.0, seeded_rng(0, "arrivals"), duration_s=2.0)
    assert max(offsets) < 2.0 and 70 < len(offsets) < 130
    assert len(arrival_offsets(50.0, 1.0, seeded_rng(0, "arrivals"), count=5, duration_s=100.0)) == 5
    assert arrival_offsets(math.inf, 1.0, seeded_rng(0, "arrivals"), count=3) == [0.0, 0.0, 0.0]


def test_schedule_is_repeatable():
    a = arrival_offsets(3.0, 0.7, seeded_rng(5, "arrivals"), count=50)
    assert a == arrival_offsets(3.0, 0.7, seeded_rng(5, "arrivals"), count=50)
    assert a != arrival_offsets(3.0, 0.7, seeded_rng(6, "arrivals"), count=50)
