"""The waterfall's changes: against the nearest earlier phase with a figure, and against the first one."""

import types

import pytest

from infertrace.ablate.run import PhaseResult, PhaseStatus
from infertrace.ablate.waterfall import waterfall
from infertrace.load.stats import Stats


def _result(i, tput, status=PhaseStatus.OK, error=None, profile=None):
    record = None
    if tput is not None:
        metrics = types.SimpleNamespace(completed=4, output_throughput=tput, ttft=Stats(median=10.0 + i),
                                        itl=Stats(median=2.0), itl_per_token=Stats(median=2.0))
        record = types.SimpleNamespace(metrics=metrics)
    return PhaseResult(i, f"p{i}", {}, {}, status, error=error, record=record, profile=profile)


def test_changes_skip_failed_phases():
    rows = waterfall([_result(0, 100.0), _result(1, None, PhaseStatus.FAILED, "OutOfMemoryError: CUDA"),
                      _result(2, 150.0), _result(3, 120.0)])
    assert [r.status for r in rows] == ["ok", "failed", "ok", "ok"]
    assert rows[0].change_vs_previous is None and rows[0].change_vs_first is None
    assert rows[1].output_throughput is None and rows[1].detail == "OutOfMemoryError: CUDA"
    assert rows[2].change_vs_previous == pytest.approx(0.5) and rows[2].change_vs_first == pytest.approx(0.5)
    assert rows[3].change_vs_previous == pytest.approx(-0.2) and rows[3].change_vs_first == pytest.approx(0.2)
    assert rows[2].median_ttft_ms == 12.0 and rows[2].median_itl_ms == 2.0


def test_first_phase_failing_makes_the_next_the_baseline():
    rows = waterfall([_result(0, None, PhaseStatus.FAILED, "bad"), _result(1, 80.0), _result(2, 100.0)])
    assert rows[1].change_vs_first is None and rows[2].change_vs_first == pytest.approx(0.25)


def test_profile_columns_come_from_the_profile():
    profile = types.SimpleNamespace(kernels_per_decode_step=504.0, launches_per_decode_step=1.0,
                                    attention_kernels_per_decode_step=72.0, cpu_ops_per_decode_step=None,
                                    gpu_idle_share=0.05)
    row = waterfall([_result(0, 700.0, profile=profile)])[0]
    assert (row.kernels_per_decode_step, row.launches_per_decode_step, row.attention_kernels_per_decode_step,
            row.gpu_idle_share) == (504.0, 1.0, 72.0, 0.05)


def test_a_phase_that_ran_without_its_profile_says_why():
    result = _result(0, 50.0)
    result.note, result.profile_error = "1 of 4 requests failed: timeout", "no capture: no decode step ran"
    assert waterfall([result])[0].detail == "1 of 4 requests failed: timeout; no profile: no capture: no decode step ran"
