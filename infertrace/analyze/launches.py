"""Kernel launch statistics: how long each launch call took on the CPU and how long the GPU took to start it.

A launch is any CPU runtime or driver call whose correlation id reaches GPU work, so `cudaGraphLaunch`,
`cuLaunchKernel(Ex)`, `hipGraphLaunch`, `hipExtModuleLaunchKernel` and friends count, where HTA counts only
`cudaLaunchKernel`, `cudaLaunchKernelExC`, `cudaMemcpyAsync` and `cudaMemsetAsync`. A graph launch starts many
kernels: its GPU duration is their total and its delay runs to the first of them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from infertrace.analyze.events import GPU_WORK

RUNTIME_OUTLIER_US = 50  # HTA's runtime_cutoff
DELAY_OUTLIER_US = 100  # HTA's launch_delay_cutoff


def launches(events: pd.DataFrame) -> pd.DataFrame:
    """One row per launch call that reached the GPU: api, correlation, cpu/gpu duration, delay, GPU ops."""
    corr = events["correlation"]
    # only the columns used here are copied for the rows picked
    cpu = events[["correlation", "name", "ts_ns", "dur_ns"]][(events["kind"] == "runtime").to_numpy() &
                                                             (corr >= 0).to_numpy()]
    gpu = events[["correlation", "dur_ns", "ts_ns", "kind"]][events["kind"].isin(GPU_WORK).to_numpy() &
                                                             (corr >= 0).to_numpy()]
    if cpu.empty or gpu.empty:
        return _empty()
    cpu = cpu.drop_duplicates("correlation", keep="first")
    gpu = pd.DataFrame({"correlation": gpu["correlation"].to_numpy(), "dur_ns": gpu["dur_ns"].to_numpy(),
                        "ts_ns": gpu["ts_ns"].to_numpy(), "is_kernel": (gpu["kind"] == "kernel").to_numpy()})
    per_launch = gpu.groupby("correlation", sort=False).agg(
        gpu_ops=("dur_ns", "size"), kernels=("is_kernel", "sum"), gpu_dur_ns=("dur_ns", "sum"),
        first_gpu_ns=("ts_ns", "min"))
    joined = cpu[["correlation", "name", "ts_ns", "dur_ns"]].join(per_launch, on="correlation", how="inner")
    delay = joined["first_gpu_ns"] - (joined["ts_ns"] + joined["dur_ns"])
    return pd.DataFrame({
        "api": joined["name"].astype(str).to_numpy(),
        "correlation": joined["correlation"].to_numpy(),
        "ts_ns": joined["ts_ns"].to_numpy(),
        "cpu_duration": joined["dur_ns"].to_numpy() / 1000.0,
        "gpu_duration": joined["gpu_dur_ns"].to_numpy() / 1000.0,
        "launch_delay": np.clip(delay.to_numpy(), 0, None) / 1000.0,
        "gpu_ops": joined["gpu_ops"].to_numpy(),
        "kernels": joined["kernels"].to_numpy(),
    })


def _empty() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in (
        ("api", "object"), ("correlation", "int64"), ("ts_ns", "int64"), ("cpu_duration", "float64"),
        ("gpu_duration", "float64"), ("launch_delay", "float64"), ("gpu_ops", "int64"), ("kernels", "int64"))})


def launch_summary(by_rank: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """Per rank and launch API: counts, CPU time of the call and launch delay (mean, p50, p99, in us), and
    how many calls exceed HTA's outlier cutoffs."""
    rows = []
    for rank, table in by_rank.items():
        for api, group in table.groupby("api", sort=True):
            cpu, delay = group["cpu_duration"].to_numpy(), group["launch_delay"].to_numpy()
            rows.append({
                "rank": rank, "api": api, "launches": len(group), "gpu_ops": int(group["gpu_ops"].sum()),
                "kernels": int(group["kernels"].sum()),
                "cpu_mean (us)": cpu.mean(), "cpu_p50 (us)": np.percentile(cpu, 50),
                "cpu_p99 (us)": np.percentile(cpu, 99),
                "delay_mean (us)": delay.mean(), "delay_p50 (us)": np.percentile(delay, 50),
                "delay_p99 (us)": np.percentile(delay, 99),
                f"cpu > {RUNTIME_OUTLIER_US} us": int((cpu > RUNTIME_OUTLIER_US).sum()),
                f"delay > {DELAY_OUTLIER_US} us": int((delay > DELAY_OUTLIER_US).sum()),
            })
    return pd.DataFrame(rows)
