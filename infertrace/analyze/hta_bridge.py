"""Runs HTA's own analysis functions on event tables loaded here, without HTA parsing the files again.

HTA's analyzers take a `hta.common.trace.Trace` whose per-rank DataFrames hold symbol ids in `name` and `cat`,
an `index` column equal to the row label, and `index_correlation` linking each GPU event to the CPU event that
launched it. `hta_trace` builds exactly that from a capture's events (the layout of traceinsight 0.6.1, as of HolisticTraceAnalysis 0.5.0).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from infertrace.analyze.capture import Capture
from infertrace.analyze.events import GPU_KINDS

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


def idle_time_breakdown(capture: Capture, events_by_rank: dict[int, pd.DataFrame]) -> pd.DataFrame:
    """HTA's idle-time breakdown for every rank: per stream, GPU idle time split into host wait (the next kernel
    was launched after the GPU went idle), kernel wait (gaps under 30 us) and other."""
    from hta.analyzers.breakdown_analysis import BreakdownAnalysis

    trace = hta_trace(capture, events_by_rank)
    frames = []
    for rank, events in events_by_rank.items():
        if not events["kind"].isin(("kernel", "memcpy", "memset")).any():
            continue
        frame, _ = BreakdownAnalysis.get_idle_time_breakdown(
            trace, CONSECUTIVE_KERNEL_DELAY_US, rank=rank, streams=None, visualize=False)
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=["rank", "stream", "idle_category", "idle_time (us)", "idle_time_ratio"])
    out = pd.concat(frames, ignore_index=True)
    return out.rename(columns={"idle_time": "idle_time (us)"})
