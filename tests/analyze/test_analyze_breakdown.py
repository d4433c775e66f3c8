"""HTA's breakdowns: the figures equal HTA's own calls on HTA's sample traces, and go further where HTA fails."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from infertrace.analyze import breakdown
from infertrace.analyze.capture import load_capture
from infertrace.analyze.hta_bridge import hta_trace, idle_time_breakdown
from infertrace.analyze.kernels import COMMUNICATION
from infertrace.analyze.launches import launches

TEMPORAL = ["rank", "idle_time(us)", "compute_time(us)", "non_compute_time(us)", "kernel_time(us)",
            "idle_time_pctg", "compute_time_pctg", "non_compute_time_pctg"]


def hta_analysis(path):
    from hta.trace_analysis import TraceAnalysis

    return TraceAnalysis(trace_dir=str(path))


def ours(events_by_rank: dict[int, pd.DataFrame]):
    trim = len(breakdown.profiler_step_names(list(events_by_rank.values()))) >= 2
    gpu = {rank: breakdown.classified_gpu_work(e, trim) for rank, e in events_by_rank.items()}
    windows = {rank: breakdown.hta_window(e, trim) for rank, e in events_by_rank.items()}
    return gpu, windows


@pytest.fixture(scope="module")
def two_rank(traces):
    path = traces / "hta-samples" / "two_rank_nccl"
    capture = load_capture(path)
    gpu, windows = ours({r.rank: r.events for r in capture.ranks})
    return hta_analysis(path), capture, gpu, windows


def test_temporal_equals_hta(two_rank):
    hta, _, gpu, _ = two_rank
    expected = hta.get_temporal_breakdown(visualize=False)
    pd.testing.assert_frame_equal(breakdown.temporal_breakdown(gpu)[TEMPORAL], expected[TEMPORAL],
                                  check_dtype=False)


def test_kernel_types_equal_hta(two_rank):
    hta, _, gpu, _ = two_rank
    expected, _ = hta.get_gpu_kernel_breakdown(visualize=False)
    expected = expected[expected["sum"] > 0].rename(columns={"sum": "sum (us)"})
    got = breakdown.kernel_type_breakdown(gpu)
    pd.testing.assert_frame_equal(got.reset_index(drop=True), expected.reset_index(drop=True), check_dtype=False)


def test_top_kernels_select_and_sum_like_hta(two_rank):
    hta, _, gpu, _ = two_rank
    _, expected = hta.get_gpu_kernel_breakdown(visualize=False)
    got = breakdown.top_kernels(gpu)
    key = ["kernel_type", "rank", "name"]
    merged = got.merge(expected, on=key, how="outer", suffixes=("", " hta"), indicator=True)
    assert (merged["_merge"] == "both").all(), merged.loc[merged["_merge"] != "both", key]
    assert np.allclose(merged["sum (us)"], merged["sum (us) hta"])
    # where HTA did not fold kernels into "others", every statistic is HTA's
    comm = merged[merged["kernel_type"] == COMMUNICATION]
    for col in ("max (us)", "min (us)", "mean (us)", "stddev"):
        assert np.allclose(comm[col], comm[f"{col} hta"])


def test_overlap_equals_hta(two_rank):
    hta, _, gpu, _ = two_rank
    expected = hta.get_comm_comp_overlap(visualize=False)
    got = breakdown.comm_comp_overlap(gpu)
    assert got["comp_comm_overlap_pctg"].tolist() == expected["comp_comm_overlap_pctg"].tolist() == [11.81, 20.05]


def test_idle_equals_hta(two_rank):
    hta, capture, _, windows = two_rank
    expected, _ = hta.get_idle_time_breakdown(ranks=[0, 1], visualize=False)
    got = idle_time_breakdown(capture, windows)
    pd.testing.assert_frame_equal(got.rename(columns={"idle_time (us)": "idle_time"}),
                                  expected.reset_index(drop=True), check_dtype=False)


def test_hta_functions_on_our_tables_equal_hta_on_the_files(two_rank):
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis
    from hta.analyzers.communication_analysis import CommunicationAnalysis

    hta, capture, _, windows = two_rank
    bridged = hta_trace(capture, windows)
    pd.testing.assert_frame_equal(BreakdownAnalysis.get_temporal_breakdown(bridged, visualize=False),
                                  hta.get_temporal_breakdown(visualize=False), check_dtype=False)
    pd.testing.assert_frame_equal(CommunicationAnalysis.get_comm_comp_overlap(bridged, visualize=False),
                                  hta.get_comm_comp_overlap(visualize=False), check_dtype=False)


def test_launch_delays_equal_hta_for_the_calls_hta_counts(two_rank):
    hta, _, _, windows = two_rank
    expected = hta.get_cuda_kernel_launch_stats(ranks=[0, 1], visualize=False)
    for rank, events in windows.items():
        got = launches(events)
        got = got[got["api"].isin(["cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync",
                                   "cudaMemsetAsync"])]
        cols = ["correlation", "cpu_duration", "gpu_duration", "launch_delay"]
        pd.testing.assert_frame_equal(got[cols].sort_values("correlation").reset_index(drop=True),
                                      expected[rank][cols].sort_values("correlation").reset_index(drop=True),
                                      check_dtype=False)


def _hta_rounding(events: pd.DataFrame) -> pd.DataFrame:
    """What HTA's parser does to float timestamps: float64 microseconds, start rounded up, end rounded down."""
    ts_us = np.array([float(f"{ns // 1000}.{ns % 1000:03d}") for ns in events["ts_ns"].tolist()])
    end_us = ts_us + events["dur_ns"].to_numpy() / 1000.0
    start, end = np.ceil(ts_us).astype(np.int64), np.floor(end_us).astype(np.int64)
    out = events.copy()
    out["ts_ns"], out["dur_ns"] = start * 1000, (end - start) * 1000
    origin = out["ts_ns"].min()
    out["ts"] = (out["ts_ns"] - origin) / 1000.0
    out["dur"] = out["dur_ns"] / 1000.0
    out["end"] = out["ts"] + out["dur"]
    return out


@pytest.fixture(scope="module")
def single_rank(traces):
    path = traces / "hta-samples" / "single_rank_ns"
    return hta_analysis(path), load_capture(path)


def test_nanosecond_trace_equals_hta_given_hta_rounding(single_rank):
    hta, capture = single_rank
    rounded = {0: _hta_rounding(capture.rank(0).events)}
    gpu, windows = ours(rounded)
    pd.testing.assert_frame_equal(breakdown.temporal_breakdown(gpu)[TEMPORAL],
                                  hta.get_temporal_breakdown(visualize=False)[TEMPORAL], check_dtype=False)
    expected_types, _ = hta.get_gpu_kernel_breakdown(visualize=False)
    assert breakdown.kernel_type_breakdown(gpu)["sum (us)"].tolist() == expected_types["sum"].tolist()
    expected_idle, _ = hta.get_idle_time_breakdown(visualize=False)
    got_idle = idle_time_breakdown(capture, windows)
    assert got_idle["idle_time (us)"].tolist() == expected_idle["idle_time"].tolist()


def test_nanosecond_trace_exact_figures(single_rank):
    hta, capture = single_rank
    gpu, _ = ours({0: capture.rank(0).events})
    exact = breakdown.temporal_breakdown(gpu).iloc[0]
    rounded = hta.get_temporal_breakdown(visualize=False).iloc[0]
    # rounding every kernel inwards to whole microseconds inflates idle time by more than half
    assert exact["idle_time(us)"] == pytest.approx(6452.701)
    assert rounded["idle_time(us)"] == 10113
    assert abs(exact["kernel_time(us)"] - rounded["kernel_time(us)"]) < 1
    assert exact["idle_time_pctg"] + exact["compute_time_pctg"] + exact["non_compute_time_pctg"] == \
        pytest.approx(100, abs=0.02)


def test_communication_includes_collectives_not_named_nccl(traces):
    from hta.utils.utils import get_kernel_type

    capture = load_capture(traces / "tracelens" / "vllm_tp8_b200_rank0")
    gpu, _ = ours({0: capture.rank(0).events})
    kernels = gpu[0][gpu[0]["kind"] == "kernel"]
    comm = kernels["kernel_type"] == COMMUNICATION
    share = kernels.loc[comm, "dur_ns"].sum() / kernels["dur_ns"].sum()
    assert share == pytest.approx(0.195, abs=0.01)  # the multimem all-reduce kernels plus one nccl all-gather
    assert set(kernels.loc[comm, "category"]) == {"communication"}
    hta_comm = kernels["name"].astype(str).map(get_kernel_type) == COMMUNICATION
    assert kernels.loc[hta_comm, "dur_ns"].sum() / kernels["dur_ns"].sum() < 0.005  # HTA: nccl names only
    types = breakdown.kernel_type_breakdown(gpu).set_index("kernel_type")["percentage"]
    assert types[COMMUNICATION] == pytest.approx(18.5, abs=0.2)  # HTA's table counts memcpy time too


def test_trace_that_breaks_hta_is_analysed(traces):
    path = traces / "tracelens" / "hf_eager_h100_qwen"
    capture = load_capture(path)
    gpu, _ = ours({0: capture.rank(0).events})
    row = breakdown.temporal_breakdown(gpu).iloc[0]
    assert row["idle_time(us)"] >= 0 and row["non_compute_time(us)"] >= 0
    assert row["idle_time_pctg"] + row["compute_time_pctg"] + row["non_compute_time_pctg"] == \
        pytest.approx(100, abs=0.02)
    with pytest.raises(AssertionError):  # HTA issue #317: rounding makes kernels end before they start
        hta_analysis(path).get_temporal_breakdown(visualize=False)


def _top_kernels_by_name(gpu: pd.DataFrame, num_kernels: int, duration_ratio: float) -> pd.DataFrame:
    """breakdown.top_kernels for one rank, grouping by the names themselves (how it was first written)."""
    parts = []
    for kernel_type in ("COMPUTATION", "COMMUNICATION", "MEMORY"):
        of_type = gpu[gpu["kernel_type"] == kernel_type]
        if of_type.empty:
            continue
        names = of_type["name"].astype(str)
        totals = of_type["dur_ns"].groupby(names.to_numpy()).sum().sort_values(ascending=False)
        label = names
        if len(totals) > num_kernels:
            running = totals.cumsum()
            others = (running > running.quantile(duration_ratio)).to_numpy() | (np.arange(len(totals)) >= num_kernels)
            label = names.where(~names.isin(set(totals.index[others])), "others")
        us = of_type["dur_ns"] / 1000.0
        frame = us.groupby(label.to_numpy()).agg(["count", "sum", "max", "min", "std", "mean"]).reset_index(
            names="name")
        frame["std"] = frame["std"].fillna(0.0)
        first = of_type.assign(name=names).drop_duplicates("name").set_index("name")
        frame["category"] = frame["name"].map(first["category"]).fillna("")
        frame["kernel_type"] = kernel_type
        parts.append(frame)
    out = pd.concat(parts, ignore_index=True).sort_values(["kernel_type", "name"], ignore_index=True)
    return out.rename(columns={"sum": "sum (us)", "max": "max (us)", "min": "min (us)", "std": "stddev",
                               "mean": "mean (us)"})


@pytest.mark.parametrize("categorical", [True, False])
def test_top_kernels_grouped_by_codes_equal_grouping_by_name(categorical):
    from infertrace.analyze.breakdown import top_kernels

    rng = np.random.default_rng(2)
    for _ in range(40):
        n = int(rng.integers(1, 400))
        pool = [f"kernel_{i:02d}" for i in range(int(rng.integers(1, 30)))] + ["others", "Zeta", "alpha"]
        names = rng.choice(pool, n)
        gpu = pd.DataFrame({
            "name": pd.Categorical(names, categories=list(dict.fromkeys(names))) if categorical else names,
            "kernel_type": rng.choice(["COMPUTATION", "COMMUNICATION", "MEMORY"], n),
            "category": rng.choice(["GEMM", "attention", "other"], n),
            "dur_ns": rng.choice([1000, 2000, 1500, 7], n) * rng.integers(1, 4, n),  # many equal totals
        })
        for num in (1, 3, 10):
            got = top_kernels({0: gpu}, num_kernels=num, duration_ratio=0.8)
            want = _top_kernels_by_name(gpu, num, 0.8)
            cols = ["name", "count", "sum (us)", "max (us)", "min (us)", "stddev", "mean (us)", "category",
                    "kernel_type"]
            pd.testing.assert_frame_equal(got[cols], want[cols], check_dtype=False)
