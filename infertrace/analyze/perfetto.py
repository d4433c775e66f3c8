"""`analyze --perfetto`: the capture in Chrome trace format (JSON, as Perfetto and chrome://tracing open it), with
infertrace's findings as extra tracks.

Every complete event of every rank is written as it was read (timestamps to the nanosecond, as `ts` microseconds
with three decimals), each rank's processes renamed `rank R: ...` and moved apart (pid R * 10^8 + pid), a rank at a
time so that memory holds one rank's events. Then, per rank, a process "infertrace, rank R" with a track of its
steps (one slice per step, from its start to its end or its last kernel's end, with its type, batch, tokens,
kernels, GPU busy and host-wait time) and a track of its phases (runs of steps of one type); and, when the report
has a critical path, a process "infertrace critical path" with one slice per step (the gating rank, gate and
what-if) and one per segment of the path (the rank that was slowest there and its longest kernel), on the clock of
the segment's rank.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from infertrace import output
from infertrace.analyze.report import Report

RANK_PID = 10**8  # a rank's processes keep their pid, offset by rank * RANK_PID
OURS_PID = 10**12  # infertrace's own tracks
CHUNK = 100_000  # events formatted at once


def _us(ns: int) -> str:
    """Exact microseconds with three decimals, as text (a float would round large epoch times)."""
    sign = "-" if ns < 0 else ""
    ns = abs(int(ns))
    return f"{sign}{ns // 1000}.{ns % 1000:03d}"


def write_perfetto(report: Report, path: Path, cache_root: Path | None = None) -> Path:
    """Write the trace to `path` whole or not at all, as output.write_text writes (a regular file only, a FIFO or
    directory refused; a failed write leaves the file there was), but streamed: the events of every rank are
    never held as one text."""

    def pieces():
        yield '{"displayTimeUnit": "ns", "traceEvents": [\n'
        first = True
        for piece in _all_pieces(report, cache_root):
            if piece:
                yield ("" if first else ",\n") + piece
                first = False
        yield "\n]}\n"

    output.write_pieces(path, pieces())
    return Path(path)


def _all_pieces(report: Report, cache_root):
    from infertrace.analyze.column_cache import ColumnCache
    from infertrace.analyze.fleet import read_unit

    cache = ColumnCache(Path(cache_root)) if cache_root is not None else None
    for rank, files in sorted(report.files.items()):
        for cols, _ in read_unit([Path(f) for f in files], False, cache):
            if cols is not None:
                yield from _events(rank, cols)
    yield from _step_tracks(report)
    yield from _critical_tracks(report)


def _events(rank: int, cols):
    names = [json.dumps(n) for n in cols.names]
    cats = [json.dumps(c) for c in cols.cats]
    pid = rank * RANK_PID + np.abs(cols.pid.astype(np.int64)) % RANK_PID  # pids come as int32 where they fit
    seen = sorted(set(pid.tolist()))
    yield ",\n".join(_meta(p, f"rank {rank}: pid {p - rank * RANK_PID}") for p in seen)
    for lo in range(0, len(cols), CHUNK):
        hi = min(lo + CHUNK, len(cols))
        yield ",\n".join(
            f'{{"ph": "X", "name": {names[n]}, "cat": {cats[c]}, "pid": {p}, "tid": {t}, "ts": {_us(ts)}, '
            f'"dur": {_us(d)}}}'
            for n, c, p, t, ts, d in zip(cols.name[lo:hi].tolist(), cols.cat[lo:hi].tolist(), pid[lo:hi].tolist(),
                                         cols.tid[lo:hi].tolist(), cols.ts_ns[lo:hi].tolist(),
                                         cols.dur_ns[lo:hi].tolist()))


def _meta(pid: int, name: str, tid: int | None = None, thread: str | None = None) -> str:
    if tid is None:
        return json.dumps({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
    return json.dumps({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}})


def _slice(name: str, pid: int, tid: int, start_ns: int, dur_ns: int, args: dict) -> str:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in args.items()}
    return (f'{{"ph": "X", "name": {json.dumps(name)}, "cat": "infertrace", "pid": {pid}, "tid": {tid}, '
            f'"ts": {_us(start_ns)}, "dur": {_us(max(int(dur_ns), 0))}, "args": {json.dumps(clean, default=str)}}}')


def step_slices(steps: pd.DataFrame) -> pd.DataFrame:
    """Each step's slice: start and end in ns (the end is the later of the step's range and its last kernel)."""
    start = steps["ts_ns"].to_numpy().astype(np.int64)
    return pd.DataFrame({"rank": steps["rank"].to_numpy(), "start_ns": start,
                         "end_ns": start + np.rint(steps["step_ms"].to_numpy() * 1e6).astype(np.int64)})


def _step_tracks(report: Report):
    steps = report.tables.get("steps")
    if steps is None or steps.empty:
        return
    slices = step_slices(steps)
    for rank, idx in steps.groupby("rank", sort=True).indices.items():
        pid = OURS_PID + int(rank)
        g = steps.iloc[idx].sort_values("ts_ns", kind="stable")
        sl = slices.loc[g.index]
        out = [_meta(pid, f"infertrace, rank {rank}"), _meta(pid, "", 1, "steps"), _meta(pid, "", 2, "phases")]
        for (_, r), start, end in zip(g.iterrows(), sl["start_ns"], sl["end_ns"]):
            args = {"type": r["type"], "label": r.get("label"), "bs": _plain(r.get("bs")), "toks": _plain(r.get("toks")),
                    "kernels": _plain(r.get("kernels")), "gpu busy (ms)": _plain(r.get("busy_ms")),
                    "host wait (ms)": _plain(r.get("host_wait_ms"))}
            out.append(_slice(f"{r['type']} step", pid, 1, int(start), int(end - start), args))
        # phases: runs of consecutive steps of one type
        types = g["type"].to_numpy()
        starts, ends = sl["start_ns"].to_numpy(), sl["end_ns"].to_numpy()
        run_start = 0
        for i in range(1, len(types) + 1):
            if i == len(types) or types[i] != types[run_start]:
                out.append(_slice(str(types[run_start]), pid, 2, int(starts[run_start]),
                                  int(ends[run_start:i].max() - starts[run_start]), {"steps": i - run_start}))
                run_start = i
        yield ",\n".join(out)


def _critical_tracks(report: Report):
    path = report.tables.get("critical_path")
    segments = report.tables.get("critical_segments")
    steps = report.tables.get("steps")
    if path is None or path.empty or steps is None:
        return
    pid = OURS_PID + 10**6
    out = [_meta(pid, "infertrace critical path"), _meta(pid, "", 1, "steps"), _meta(pid, "", 2, "path")]
    first_rank = int(steps["rank"].min())
    mine = steps[steps["rank"] == first_rank].sort_values("ts_ns", kind="stable").reset_index(drop=True)
    sl = step_slices(mine)
    for r in path.to_dict("records"):
        k = int(r["step"])
        if k >= len(sl):
            continue
        args = {key: _plain(v) for key, v in r.items()}
        out.append(_slice(f"step {k}: gated by rank {r['gating rank']}", pid, 1, int(sl["start_ns"][k]),
                          int(sl["end_ns"][k] - sl["start_ns"][k]), args))
    if segments is not None and not segments.empty:
        for s in segments.to_dict("records"):
            label = s["kernel"] or "(no kernel)"
            out.append(_slice(f"rank {s['rank']}: {label}", pid, 2, int(s["start_ns"]),
                              int(s["arrive_ns"] - s["start_ns"]),
                              {"step": int(s["step"]), "segment": int(s["segment"]), "rank": int(s["rank"]),
                               "then": s["collective"]}))
    yield ",\n".join(out)


def _plain(value):
    if value is None or value is pd.NA:
        return None
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        return None if math.isnan(value) else float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value
