"""HTA's standard breakdowns: temporal, GPU kernel (by type and top kernels), and communication overlap.

Each function returns the figures HTA's `TraceAnalysis` returns for the same trace (the tests compare them),
computed over integer nanoseconds and with each kernel name classified once, where HTA classifies each kernel
row in a Python loop, rounds nanosecond timestamps, and stops on an assertion when the rounding makes a kernel
end before it starts. Differences from HTA, on purpose:
- communication also counts collectives not named `nccl*` (see `kernels.COMM_RE`);
- top kernels carry their real max/min/mean; HTA, once it groups kernels into "others", reports a kept
  kernel's total as its max, min and mean.
The idle-time breakdown is computed the same way in `hta_bridge`, which also builds HTA's own `Trace` from these
tables for any of HTA's functions.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from infertrace.analyze.events import GPU_WORK
from infertrace.analyze.intervals import covered, overlap_by_mask, union
from infertrace.analyze.kernels import (
    COMMUNICATION,
    COMPUTATION,
    MEMORY,
    add_classes,
    short_name,
)

KERNEL_TYPES = (COMPUTATION, COMMUNICATION, MEMORY)  # the types HTA's kernel breakdown reports, in its order


def profiler_step_names(capture_events: list[pd.DataFrame]) -> set[str]:
    """The distinct `ProfilerStep#N` names of a capture (HTA trims the last step when there are two or more)."""
    found: set[str] = set()
    for events in capture_events:
        found.update(n for n in events["name"].cat.categories if "ProfilerStep" in n)
    return found


def hta_window(events: pd.DataFrame, trim_last_step: bool) -> pd.DataFrame:
    """The events HTA analyses. With `trim_last_step` (two or more ProfilerStep names in the capture), HTA drops
    the CPU events from the start of the last step on (a step the profiler usually cuts short) and every GPU
    event not launched before it."""
    if not trim_last_step:
        return events
    gpu = events["kind"].isin(GPU_WORK + ("sync", "gpu_annotation")).to_numpy()
    names = events["name"]
    step_names = [n for n in names.cat.categories if "ProfilerStep" in n]
    is_step = ~gpu & names.isin(step_names).to_numpy()
    if not is_step.any():
        return events
    ts = events["ts_ns"].to_numpy()
    corr = events["correlation"].to_numpy()
    keep_cpu = ~gpu & (ts < ts[is_step].max())
    launched = np.unique(corr[keep_cpu & (corr >= 0)])
    keep_gpu = gpu & (corr >= 0) & np.isin(corr, launched)
    return events[keep_cpu | keep_gpu]


def classified_gpu_work(events: pd.DataFrame, trim_last_step: bool = False) -> pd.DataFrame:
    """The kernels, memcpys and memsets HTA would analyse, with `kernel_type`, `category` and `end_ns`."""
    window = hta_window(events, trim_last_step)
    gpu = add_classes(window[window["kind"].isin(GPU_WORK).to_numpy()])
    gpu["end_ns"] = gpu["ts_ns"] + gpu["dur_ns"]
    return gpu


def _union_of(gpu: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    return union(gpu["ts_ns"].to_numpy(), gpu["end_ns"].to_numpy())


def temporal_breakdown(gpu_by_rank: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """Per rank: idle, compute and non-compute time over the span from the first kernel to the last."""
    rows = []
    for rank, gpu in gpu_by_rank.items():
        if gpu.empty:
            continue
        starts, ends = _union_of(gpu)
        span = int(ends[-1] - starts[0])
        idle = span - covered(starts, ends)
        compute = covered(*_union_of(gpu[gpu["kernel_type"] == COMPUTATION]))
        rows.append((rank, idle, compute, span - compute - idle, span))
    frame = pd.DataFrame(rows, columns=["rank", "idle_time(us)", "compute_time(us)", "non_compute_time(us)",
                                        "kernel_time(us)"])
    for col in ("idle", "compute", "non_compute"):
        frame[f"{col}_time_pctg"] = (100 * frame[f"{col}_time(us)"] / frame["kernel_time(us)"]).round(2)
    for col in ("idle_time(us)", "compute_time(us)", "non_compute_time(us)", "kernel_time(us)"):
        frame[col] = frame[col] / 1000.0
    return frame


def kernel_type_breakdown(gpu_by_rank: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """Time by kernel type over all ranks, overlaps between types shown as their own rows (as HTA does)."""
    totals: dict[str, int] = {}
    for gpu in gpu_by_rank.values():
        for label, ns in kernel_type_totals(gpu).items():
            totals[label] = totals.get(label, 0) + ns
    return kernel_type_table(totals)


def kernel_type_totals(gpu: pd.DataFrame) -> dict[str, int]:
    """One rank's nanoseconds per kernel type and per overlap of types (`kernel_type_breakdown` adds ranks up)."""
    unions = [_union_of(gpu[gpu["kernel_type"] == t]) for t in KERNEL_TYPES]
    totals: dict[str, int] = {}
    for mask, ns in overlap_by_mask(unions).items():
        label = " overlapping ".join(t for bit, t in enumerate(KERNEL_TYPES) if mask & (1 << bit))
        totals[label] = totals.get(label, 0) + ns
    return totals


def kernel_type_table(totals: dict[str, int]) -> pd.DataFrame:
    frame = pd.DataFrame({"kernel_type": list(totals), "sum (us)": [v / 1000.0 for v in totals.values()]})
    frame = frame.sort_values("sum (us)", ascending=False, ignore_index=True, kind="stable")
    frame["percentage"] = (100 * frame["sum (us)"] / frame["sum (us)"].sum()).round(1)
    return frame


def top_kernels(gpu_by_rank: dict[int, pd.DataFrame], num_kernels: int = 10,
                duration_ratio: float = 0.8) -> pd.DataFrame:
    """Per rank and kernel type, the kernels HTA would name (the top `num_kernels` by total time, cut at the
    `duration_ratio` quantile of the running total); the rest are summed into "others"."""
    parts = []
    for rank, gpu in gpu_by_rank.items():
        for kernel_type in KERNEL_TYPES:
            of_type = gpu[gpu["kernel_type"] == kernel_type]
            if of_type.empty:
                continue
            frame = _type_table(of_type, num_kernels, duration_ratio)
            frame["kernel_type"] = kernel_type
            frame["rank"] = rank
            parts.append(frame)
    if not parts:
        return pd.DataFrame(columns=["name", "short_name", "count", "sum (us)", "max (us)", "min (us)", "stddev",
                                     "mean (us)", "kernel_type", "category", "rank"])
    out = pd.concat(parts, ignore_index=True)
    # whole: a terminal table caps the column itself, a CI log and the HTML show every character
    out["short_name"] = [n if n == "others" else short_name(n, width=None) for n in out["name"]]
    out = out.sort_values(["kernel_type", "name", "rank"], ignore_index=True)
    return out[["name", "short_name", "count", "sum (us)", "max (us)", "min (us)", "stddev", "mean (us)",
                "kernel_type", "category", "rank"]]


def _type_table(of_type: pd.DataFrame, num_kernels: int, duration_ratio: float) -> pd.DataFrame:
    """One kernel type's rows of `top_kernels`, without kernel_type and rank: per name kept (else "others") the
    duration statistics and the category of its first kernel. Grouped by integer keys that sort as the names do,
    rather than by the names (hashing long kernel names was most of the time), so every group and figure is the
    one grouping by name gives."""
    if isinstance(of_type["name"].dtype, pd.CategoricalDtype):
        codes = of_type["name"].cat.codes.to_numpy()
        texts = np.asarray(of_type["name"].cat.categories.astype(str), dtype=object)
    else:
        codes, uniques = pd.factorize(of_type["name"].astype(str).to_numpy())
        texts = np.asarray(uniques, dtype=object)
    present, row_name = np.unique(codes, return_inverse=True)
    names = texts[present]  # per distinct name of this type; row_name: each row's index into it
    dur_ns = of_type["dur_ns"].to_numpy()
    totals_ns = np.zeros(names.size, dtype=np.int64)
    np.add.at(totals_ns, row_name, dur_ns)
    dropped = _dropped(pd.Series(totals_ns, index=pd.Index(names)).sort_index(), num_kernels, duration_ratio)
    label_of_name = np.array(["others" if n in dropped else n for n in names.tolist()], dtype=object)
    labels, row_label = np.unique(label_of_name, return_inverse=True)  # in the order the names sort in
    us = pd.Series(dur_ns / 1000.0)
    frame = us.groupby(row_label[row_name]).agg(["count", "sum", "max", "min", "std", "mean"])
    frame.insert(0, "name", labels[frame.index.to_numpy()])
    frame = frame.reset_index(drop=True)
    frame["std"] = frame["std"].fillna(0.0)
    first_row = np.unique(row_name, return_index=True)[1]
    category_of = dict(zip(names.tolist(), of_type["category"].to_numpy()[first_row].tolist()))
    frame["category"] = [category_of.get(n, "") for n in frame["name"]]
    return frame.rename(columns={"sum": "sum (us)", "max": "max (us)", "min": "min (us)", "std": "stddev",
                                 "mean": "mean (us)"})


def _dropped(totals: pd.Series, num_kernels: int, duration_ratio: float) -> set:
    """The names HTA sums into "others": past the top `num_kernels` by total, or past the `duration_ratio`
    quantile of the running total (`totals` by name, in name order)."""
    if len(totals) <= num_kernels:
        return set()
    totals = totals.sort_values(ascending=False)
    running = totals.cumsum()
    others = (running > running.quantile(duration_ratio)).to_numpy() | (np.arange(len(totals)) >= num_kernels)
    return set(totals.index[others])


def comm_comp_overlap(gpu_by_rank: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """Per rank, the share of communication time during which computation also runs."""
    rows = []
    for rank, gpu in gpu_by_rank.items():
        comm = _union_of(gpu[gpu["kernel_type"] == COMMUNICATION])
        comp = _union_of(gpu[gpu["kernel_type"] == COMPUTATION])
        comm_ns = covered(*comm)
        both = overlap_by_mask([comm, comp]).get(3, 0)
        rows.append((rank, comm_ns / 1000.0, both / 1000.0,
                     round(100 * both / comm_ns, 2) if comm_ns else float("nan")))
    return pd.DataFrame(rows, columns=["rank", "comm_time(us)", "overlapped_time(us)", "comp_comm_overlap_pctg"])
