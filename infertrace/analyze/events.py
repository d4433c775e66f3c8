"""The per-rank event table every analysis reads.

It keeps HTA's column contract (`ts`, `dur`, `end` in microseconds from the start of the capture, `stream == -1`
for CPU events) and adds exact integer nanoseconds (`ts_ns`, `dur_ns`) and an event `kind` derived from the
Kineto category, so analyses never have to remember which category names mean "kernel".
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from infertrace.analyze.kineto import TraceColumns

KINDS = ("kernel", "memcpy", "memset", "sync", "gpu_annotation", "runtime", "annotation", "cpu_op", "python", "other")
GPU_WORK = ("kernel", "memcpy", "memset")  # what keeps a GPU busy; sync waits and GPU-side annotations do not
GPU_KINDS = GPU_WORK + ("sync", "gpu_annotation")

_KIND_OF_CAT = {
    "kernel": "kernel", "Kernel": "kernel", "mtia_ccp_events": "kernel",
    "gpu_memcpy": "memcpy", "Memcpy": "memcpy",
    "gpu_memset": "memset", "Memset": "memset",
    "cuda_sync": "sync",
    "gpu_user_annotation": "gpu_annotation",
    "cuda_runtime": "runtime", "cuda_driver": "runtime", "Runtime": "runtime", "Driver": "runtime",
    "mtia_runtime": "runtime",
    "user_annotation": "annotation",
    "cpu_op": "cpu_op", "Operator": "cpu_op",
    "python_function": "python",
}


def kind_of_category(cat: str) -> str:
    return _KIND_OF_CAT.get(cat, "other")


def event_frame(cols: TraceColumns, origin_ns: int, hta_times: bool = True) -> pd.DataFrame:
    """One rank's events as a DataFrame; `origin_ns` (the capture's first event) becomes `ts == 0`. The frame holds
    the columns' own arrays (not copies): they must not be changed afterwards. `hta_times=False` leaves out HTA's
    float `ts`, `dur` and `end` (a sixth of the table), which no per-rank analysis reads: they all use the integer
    nanoseconds."""
    kind_codes = np.array([KINDS.index(kind_of_category(c)) for c in cols.cats], dtype=np.int8)
    kind = kind_codes[cols.cat] if cols.cat.size else np.empty(0, dtype=np.int8)
    on_gpu = np.isin(kind, [KINDS.index(k) for k in GPU_KINDS])
    frame = pd.DataFrame({
        "index": np.arange(len(cols), dtype=np.int32 if len(cols) <= _INT32_MAX else np.int64),
        "name": pd.Categorical.from_codes(cols.name, categories=cols.names, validate=False),
        "cat": pd.Categorical.from_codes(cols.cat, categories=cols.cats, validate=False),
        "kind": pd.Categorical.from_codes(kind, categories=list(KINDS), validate=False),
        "pid": _narrow(cols.pid),
        "tid": _narrow(cols.tid),
        "ts_ns": cols.ts_ns,
        "dur_ns": cols.dur_ns,
        **(_hta_times(cols, origin_ns) if hta_times else {}),
        "stream": _narrow(np.where(on_gpu, cols.stream, -1)),
        "correlation": _narrow(cols.correlation),
        "external_id": _narrow(cols.external_id),
    }, copy=False)  # one block per column: pandas would otherwise copy every column into blocks by type
    return frame


GPU_COLUMNS = ("name", "kind", "pid", "stream", "ts_ns", "dur_ns", "correlation")  # what the step analyses read
LAUNCH_COLUMNS = ("pid", "tid", "ts_ns", "correlation")


def rows_of(events: pd.DataFrame, mask: np.ndarray, columns) -> pd.DataFrame:
    """The rows of `events` where `mask` holds, only `columns` of them: a copy of what is read, not of every
    column (a rank's event table is hundreds of MB)."""
    return events[list(columns)][mask]


_INT32_MAX = np.iinfo(np.int32).max


def _hta_times(cols: TraceColumns, origin_ns: int) -> dict[str, np.ndarray]:
    rel_ns = cols.ts_ns - origin_ns
    ts = rel_ns / 1000.0
    end = np.add(rel_ns, cols.dur_ns, out=rel_ns) / 1000.0
    return {"ts": ts, "dur": cols.dur_ns / 1000.0, "end": end}


def _narrow(ids: np.ndarray) -> np.ndarray:
    """Ids (pid, tid, stream, correlation) as int32 where they all fit, which they nearly always do: half the
    memory of a rank's table for these columns."""
    if ids.size and np.iinfo(np.int32).min <= ids.min() and ids.max() <= _INT32_MAX:
        return ids.astype(np.int32, copy=False)
    return ids


def gpu_work(events: pd.DataFrame) -> pd.DataFrame:
    """Kernels, memcpys and memsets."""
    return events[events["kind"].isin(GPU_WORK)]
