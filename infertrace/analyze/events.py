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


def event_frame(cols: TraceColumns, origin_ns: int) -> pd.DataFrame:
    """One rank's events as a DataFrame; `origin_ns` (the capture's first event) becomes `ts == 0`. The frame holds
    the columns' own arrays (not copies): they must not be changed afterwards."""
    kind_codes = np.array([KINDS.index(kind_of_category(c)) for c in cols.cats], dtype=np.int8)
    kind = kind_codes[cols.cat] if cols.cat.size else np.empty(0, dtype=np.int8)
    on_gpu = np.isin(kind, [KINDS.index(k) for k in GPU_KINDS])
    rel_ns = cols.ts_ns - origin_ns
    ts = rel_ns / 1000.0
    end = np.add(rel_ns, cols.dur_ns, out=rel_ns) / 1000.0
    del rel_ns
    dur = cols.dur_ns / 1000.0
    frame = pd.DataFrame({
        "index": np.arange(len(cols), dtype=np.int64),
        "name": pd.Categorical.from_codes(cols.name, categories=cols.names, validate=False),
        "cat": pd.Categorical.from_codes(cols.cat, categories=cols.cats, validate=False),
        "kind": pd.Categorical.from_codes(kind, categories=list(KINDS), validate=False),
        "pid": cols.pid,
        "tid": cols.tid,
        "ts_ns": cols.ts_ns,
        "dur_ns": cols.dur_ns,
        "ts": ts,
        "dur": dur,
        "end": end,
        "stream": np.where(on_gpu, cols.stream, -1),
        "correlation": cols.correlation,
        "external_id": cols.external_id,
    }, copy=False)  # one block per column: pandas would otherwise copy every column into blocks by type
    return frame


GPU_COLUMNS = ("name", "kind", "pid", "stream", "ts_ns", "dur_ns", "correlation")  # what the step analyses read
LAUNCH_COLUMNS = ("pid", "tid", "ts_ns", "correlation")


def rows_of(events: pd.DataFrame, mask: np.ndarray, columns) -> pd.DataFrame:
    """The rows of `events` where `mask` holds, only `columns` of them: a copy of what is read, not of every
    column (a rank's event table is hundreds of MB)."""
    return events[list(columns)][mask]


def gpu_work(events: pd.DataFrame) -> pd.DataFrame:
    """Kernels, memcpys and memsets."""
    return events[events["kind"].isin(GPU_WORK)]
