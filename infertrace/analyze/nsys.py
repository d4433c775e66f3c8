"""Nsight Systems exports read into the same columns as a Kineto trace.

A `.sqlite` written by `nsys export --type sqlite` holds kernels, memcpys and memsets (CUPTI_ACTIVITY_KIND_*),
CUDA API calls (CUPTI_ACTIVITY_KIND_RUNTIME, linked to GPU work by `correlationId`) and NVTX ranges
(NVTX_EVENTS), all in integer nanoseconds. A `.nsys-rep` is exported to SQLite first when `nsys` is on PATH.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from infertrace.analyze.kineto import TraceColumns, TraceError

_NVTX_RANGES = (59, 60)  # NvtxPushPopRange, NvtxStartEndRange
_API_VERSION = re.compile(r"_v\d+$")  # nsys names API calls like cudaLaunchKernel_v7000
_COPY_KINDS = {1: "HtoD", 2: "DtoH", 8: "DtoD", 9: "HtoH", 10: "PtoP", 11: "HtoD", 12: "DtoH", 13: "DtoD"}
NSYS_EXPORT_TIMEOUT_S = 600


def read_nsys_report(path: str | Path) -> TraceColumns:
    """Export a `.nsys-rep` to SQLite with the `nsys` on PATH, then read it."""
    nsys = shutil.which("nsys")
    if nsys is None:
        raise TraceError("nsys is not on PATH, so this .nsys-rep cannot be read; export it on a machine with "
                         "Nsight Systems (`nsys export --type sqlite FILE.nsys-rep`) and analyze the .sqlite")
    with tempfile.TemporaryDirectory(prefix="infertrace-nsys-") as tmp:
        out = Path(tmp) / (Path(path).stem + ".sqlite")
        cmd = [nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "--output", str(out), str(path)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=NSYS_EXPORT_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise TraceError(f"`nsys export` did not finish within {NSYS_EXPORT_TIMEOUT_S} s") from None
        if done.returncode != 0 or not out.exists():
            last = (done.stderr or done.stdout).strip().splitlines()
            raise TraceError(f"`nsys export` failed: {last[-1] if last else f'exit {done.returncode}'}")
        return read_nsys_sqlite(out)


def read_nsys_sqlite(path: str | Path) -> TraceColumns:
    """Read an `nsys export --type sqlite` file. Raises TraceError when it holds no CUDA or NVTX data."""
    try:
        con = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as exc:
        raise TraceError(f"not an SQLite database ({exc})") from None
    try:
        if not tables & {"CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME", "NVTX_EVENTS"}:
            raise TraceError("not an nsys export (no CUPTI_ACTIVITY_KIND_KERNEL, _RUNTIME or NVTX_EVENTS table)")
        strings = dict(con.execute("SELECT id, value FROM StringIds")) if "StringIds" in tables else {}
        rows = _Rows()
        if "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
            name_col = "demangledName" if "demangledName" in _columns(con, "CUPTI_ACTIVITY_KIND_KERNEL") \
                else "shortName"
            for start, end, device, stream, corr, name in con.execute(
                    f"SELECT start, end, deviceId, streamId, correlationId, {name_col} "
                    "FROM CUPTI_ACTIVITY_KIND_KERNEL"):
                rows.add(strings.get(name, str(name)), "kernel", device, stream, start, end, stream, corr)
        if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
            for start, end, device, stream, corr, kind in con.execute(
                    "SELECT start, end, deviceId, streamId, correlationId, copyKind FROM CUPTI_ACTIVITY_KIND_MEMCPY"):
                rows.add(f"Memcpy {_COPY_KINDS.get(kind, 'Unknown')}", "gpu_memcpy", device, stream, start, end,
                         stream, corr)
        if "CUPTI_ACTIVITY_KIND_MEMSET" in tables:
            for start, end, device, stream, corr in con.execute(
                    "SELECT start, end, deviceId, streamId, correlationId FROM CUPTI_ACTIVITY_KIND_MEMSET"):
                rows.add("Memset (Device)", "gpu_memset", device, stream, start, end, stream, corr)
        if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
            for start, end, gtid, corr, name in con.execute(
                    "SELECT start, end, globalTid, correlationId, nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
                api = _API_VERSION.sub("", strings.get(name, str(name)))
                rows.add(api, "cuda_runtime", *_pid_tid(gtid), start, end, -1, corr)
        if "NVTX_EVENTS" in tables:
            for start, end, gtid, text, text_id in con.execute(
                    "SELECT start, end, globalTid, text, textId FROM NVTX_EVENTS "
                    f"WHERE eventType IN {_NVTX_RANGES} AND end IS NOT NULL"):
                label = text if text is not None else strings.get(text_id, "")
                rows.add(label, "user_annotation", *_pid_tid(gtid), start, end, -1, -1)
        metadata = {"source": "nsys", "tables": sorted(tables)}
        if "TARGET_INFO_GPU" in tables:
            metadata["deviceProperties"] = [{"id": i, "name": n}
                                            for i, n in con.execute("SELECT id, name FROM TARGET_INFO_GPU")]
    except sqlite3.DatabaseError as exc:
        raise TraceError(f"unreadable nsys export ({exc})") from None
    finally:
        con.close()
    return rows.columns(metadata)


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in con.execute(f"PRAGMA table_info({table})")}


def _pid_tid(global_tid: int | None) -> tuple[int, int]:
    # nsys packs the process id into bits 24..47 and the thread id into bits 0..23 of globalTid
    g = int(global_tid or 0)
    return (g >> 24) & 0xFFFFFF, g & 0xFFFFFF


class _Rows:
    def __init__(self):
        self.names: dict[str, int] = {}
        self.cats: dict[str, int] = {}
        self.data: list[tuple] = []

    def add(self, name, cat, pid, tid, start, end, stream, corr) -> None:
        if start is None or end is None:
            return
        self.data.append((self.names.setdefault(str(name), len(self.names)),
                          self.cats.setdefault(cat, len(self.cats)), int(pid or 0), int(tid or 0), int(start),
                          int(end) - int(start), -1 if stream is None else int(stream),
                          -1 if corr is None else int(corr)))

    def columns(self, metadata: dict) -> TraceColumns:
        self.data.sort(key=lambda r: r[4])
        arr = np.array(self.data, dtype=np.int64).reshape(-1, 8)
        return TraceColumns(
            names=list(self.names), name=arr[:, 0].astype(np.int32), cats=list(self.cats),
            cat=arr[:, 1].astype(np.int32), pid=arr[:, 2].copy(), tid=arr[:, 3].copy(), ts_ns=arr[:, 4].copy(),
            dur_ns=arr[:, 5].copy(), stream=arr[:, 6].copy(), correlation=arr[:, 7].copy(),
            external_id=np.full(len(arr), -1, dtype=np.int64), metadata=metadata)
