"""HTA's idle-time breakdown over the event tables loaded here, and HTA's own `Trace` built from those tables, so
that any of HTA's analysis functions can run on them without HTA parsing the files again.

HTA's analyzers take a `hta.common.trace.Trace` whose per-rank DataFrames hold symbol ids in `name` and `cat`,
an `index` column equal to the row label, and `index_correlation` linking each GPU event to the CPU event that
launched it. `hta_trace` builds exactly that from a capture's events (the layout of traceinsight 0.6.1, as of HolisticTraceAnalysis 0.5.0).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from infertrace.analyze.capture import Capture
from infertrace.analyze.events import GPU_KINDS, GPU_WORK

CONSECUTIVE_KERNEL_DELAY_US = 30  # HTA's default: a gap shorter than this between kernels is "kernel wait"


def hta_trace(capture: Capture, events_by_rank: dict[int, pd.DataFrame]):
    """An HTA `Trace` over `events_by_rank` (event tables of `capture`, e.g. trimmed like HTA's loader)."""
    from hta.common.trace import Trace
    from hta.common.trace_symbol_table import TraceSymbolTable
    from hta.configs.parser_config import ParserConfig

    symbols = TraceSymbolTable()
    for events in events_by_rank.values():
        symbols.add_symbols(events["name"].cat.categories)
        symbols.add_symbols(events["cat"].cat.categories)
    ids = symbols.get_sym_id_map()
    trace = Trace.__new__(Trace)  # the public constructor re-reads the files; everything is loaded already
    trace.trace_path = str(capture.source)
    trace.trace_files = {r.rank: str(r.path) for r in capture.ranks if r.rank in events_by_rank}
    trace.parser_config = ParserConfig.get_default_cfg()
    trace.meta_data = {r.rank: r.metadata for r in capture.ranks if r.rank in events_by_rank}
    trace.symbol_table = symbols
    trace.min_ts = 0
    trace.traces = {rank: _hta_frame(events, ids) for rank, events in events_by_rank.items()}
    trace.is_parsed = True
    return trace


def _hta_frame(events: pd.DataFrame, ids: dict[str, int]) -> pd.DataFrame:
    # 1-based row labels: HTA links a GPU event whose launch is not in the trace to row 0, which must not exist
    index = events["index"].to_numpy() + 1
    name = np.array([ids[n] for n in events["name"].cat.categories], dtype=np.int64)[events["name"].cat.codes]
    cat = np.array([ids[c] for c in events["cat"].cat.categories], dtype=np.int64)[events["cat"].cat.codes]
    frame = pd.DataFrame({
        "index": index, "name": name, "cat": cat, "pid": events["pid"].to_numpy(),
        "tid": events["tid"].to_numpy(), "ts": events["ts"].to_numpy(), "dur": events["dur"].to_numpy(),
        "end": events["end"].to_numpy(), "stream": events["stream"].to_numpy(),
        "correlation": events["correlation"].to_numpy(),
        "index_correlation": _index_correlation(events, index),
    }, index=index)
    return frame


def _index_correlation(events: pd.DataFrame, index: np.ndarray) -> np.ndarray:
    """HTA's link column: for a GPU event the row label of its launch, 0 when the launch is missing, -1 when
    the event has no correlation id; for a launch, the label of (the last of) its GPU events."""
    corr = events["correlation"].to_numpy()
    out = np.minimum(corr, 0)
    gpu = events["kind"].isin(GPU_KINDS).to_numpy() & (corr >= 0)
    cpu = ~events["kind"].isin(GPU_KINDS).to_numpy() & (corr >= 0)
    launches = pd.Series(index[cpu], index=corr[cpu])
    launches = launches[~launches.index.duplicated(keep="last")]
    gpu_rows = pd.Series(index[gpu], index=corr[gpu])
    matched = gpu_rows.index.isin(launches.index)
    out[np.flatnonzero(gpu)[matched]] = launches.reindex(gpu_rows.index[matched]).to_numpy()
    last_gpu = gpu_rows[~gpu_rows.index.duplicated(keep="last")]
    cpu_positions = np.flatnonzero(cpu)
    has_gpu = pd.Index(corr[cpu]).isin(last_gpu.index)
    out[cpu_positions[has_gpu]] = last_gpu.reindex(corr[cpu][has_gpu]).to_numpy()
    return out


def idle_time_breakdown(capture: Capture | None, events_by_rank: dict[int, pd.DataFrame],
                        consecutive_kernel_delay_us: int = CONSECUTIVE_KERNEL_DELAY_US) -> pd.DataFrame:
    """HTA's idle-time breakdown for every rank (`BreakdownAnalysis.get_idle_time_breakdown`, computed here on
    integer nanoseconds; the tests compare it with HTA's own): per stream, each GPU op's gap after the op before it
    (by start time) is host wait when the op's launch call began after that op ended, else kernel wait when the
    gap is under 30 us, else other. Gaps are summed signed, as HTA sums them. `capture` is not read (kept for
    callers of the HTA-backed version)."""
    frames = []
    for rank, events in events_by_rank.items():
        frame = _idle_of_rank(events, consecutive_kernel_delay_us * 1000)
        if frame is not None:
            frames.append(frame.assign(rank=rank))
    if not frames:
        return pd.DataFrame(columns=["rank", "stream", "idle_category", "idle_time (us)", "idle_time_ratio"])
    out = pd.concat(frames, ignore_index=True)
    out["idle_time (us)"] = (out["idle_ns"] / 1000.0).round(2)
    return out[["rank", "stream", "idle_category", "idle_time (us)", "idle_time_ratio"]]


_IDLE_CATEGORIES = ("host_wait", "kernel_wait", "other")


def _idle_of_rank(events: pd.DataFrame, delay_ns: int) -> pd.DataFrame | None:
    kind = events["kind"]
    stream = events["stream"].to_numpy()
    gpu = kind.isin(GPU_WORK).to_numpy() & (stream != -1)
    if not gpu.any():
        return None
    corr = events["correlation"].to_numpy()
    ts = events["ts_ns"].to_numpy()
    cpu = ~kind.isin(GPU_KINDS).to_numpy() & (corr >= 0)
    launches = pd.Series(ts[cpu], index=corr[cpu])
    launches = launches[~launches.index.duplicated(keep="last")]  # HTA links an op to the last such CPU event
    none = np.iinfo(np.int64).min
    g_corr, g_ts, g_stream = corr[gpu], ts[gpu], stream[gpu]
    g_end = g_ts + events["dur_ns"].to_numpy()[gpu]
    launched = launches.reindex(g_corr, fill_value=none).to_numpy() if len(launches) else np.full(g_ts.size, none)
    launched = np.where(g_corr >= 0, launched, none)
    rows = []
    for s in pd.unique(g_stream):
        pick = np.flatnonzero(g_stream == s)
        pick = pick[np.argsort(g_ts[pick], kind="stable")]
        start, end, at = g_ts[pick], g_end[pick], launched[pick]
        gap = start[1:] - end[:-1]
        host = at[1:] > end[:-1]
        kernel_wait = ~host & (gap < delay_ns)
        category = np.where(host, 0, np.where(kernel_wait, 1, 2))
        sums = np.zeros(3, dtype=np.int64)
        np.add.at(sums, category, gap)
        present = np.bincount(category, minlength=3) > 0
        present[2] = True  # HTA counts a stream's first op as "other", with no gap
        total = int(sums.sum())
        for c in np.flatnonzero(present):
            rows.append((int(s), _IDLE_CATEGORIES[c], int(sums[c]),
                         round(sums[c] / total, 2) if total else float("nan")))
    return pd.DataFrame(rows, columns=["stream", "idle_category", "idle_ns", "idle_time_ratio"])
