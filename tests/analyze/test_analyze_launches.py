"""Launch statistics count every launch API, graph launches included."""

from __future__ import annotations

import pytest

from infertrace.analyze.capture import load_capture
from infertrace.analyze.launches import launch_summary, launches


def test_graph_and_driver_launches(engine_trace):
    table = launches(load_capture(engine_trace).ranks[0].events)
    by_api = launch_summary({0: table}).set_index("api")
    assert by_api.loc["cudaLaunchKernel", "launches"] == 7
    graph = by_api.loc["cudaGraphLaunch"]
    assert (graph["launches"], graph["gpu_ops"], graph["kernels"]) == (1, 4, 3)
    assert graph["delay_mean (us)"] == pytest.approx(2.0)  # call ends at 3018 us, first kernel at 3020 us
    assert by_api.loc["cuLaunchKernel", "launches"] == 1  # a driver call
    row = table[table["api"] == "cudaGraphLaunch"].iloc[0]
    assert row["gpu_duration"] == pytest.approx(170.0)


def test_hip_launches(traces):
    table = launches(load_capture(traces / "tracelens" / "sglang_prefill_decode_mi300x").ranks[0].events)
    apis = set(table["api"])
    assert {"hipLaunchKernel", "hipExtModuleLaunchKernel", "hipModuleLaunchKernel"} <= apis
    assert table["gpu_ops"].sum() == 534  # every kernel and copy of the trace has its launch
