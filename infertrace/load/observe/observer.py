"""What the server and the GPU said while a run was measured: the server's /metrics scraped on the run's clock and
NVML samples of a local GPU, started around the measured window and kept with its figures; and the profiled
window's traces as `infertrace analyze` reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from infertrace.load.clock import Clock
from infertrace.load.observe.scrape import Scraper, ScrapeSeries, metrics_url
from infertrace.load.observe.telemetry import GpuSampler, TelemetrySeries

if TYPE_CHECKING:
    import pandas as pd


@dataclass(slots=True)
class ProfiledWindow:
    """The profiled window's traces, analysed: the phase summary and per-step table of `infertrace analyze`, how
    long the trace covers (its ranks' first event's start to last event's end), or why there are none."""

    phases: pd.DataFrame | None = None
    steps: pd.DataFrame | None = None
    trace_span_s: float | None = None
    note: str | None = None


@dataclass(slots=True)
class Observed:
    origin: float  # the measured window's start on the records' clock: every series time counts from here
    scrape: ScrapeSeries | None = None
    telemetry: TelemetrySeries | None = None
    profile_window: tuple[float, float] | None = None  # clock seconds of the profiler's start and stop calls
    notes: list[str] = field(default_factory=list)
    profiled: ProfiledWindow | None = None  # the profiled window's traces once analysed (`profiled_window`)

    def to_json(self, start: float | None = None, end: float | None = None) -> dict:
        return {
            "server_metrics": self.scrape.to_json(self.origin, start, end) if self.scrape is not None else None,
            "gpu_telemetry": self.telemetry.to_json(self.origin) if self.telemetry is not None else None,
            # the report's band: the start call plus the trace's span once the traces were read (with --report)
            "profile_window": None if self.profile_window is None else profiled_span(
                self.profile_window, self.origin, self.profiled.trace_span_s if self.profiled else None),
            "notes": self.notes + (self.scrape.notes if self.scrape else []) +
            (self.telemetry.notes if self.telemetry else []),
        }


def profiled_span(calls: tuple[float, float], origin: float, trace_span_s: float | None) -> dict:
    """The span the profiler's trace covers, in seconds after `origin`. The start and stop calls are timed on the
    client's clock, the trace on the server's, and only the trace's length carries over: the band starts at the
    start call and lasts the trace's span (first event's start to last event's end), so a capture that stopped by
    itself (`--profile-steps`) ends where its trace ends, not at bench's stop call. It can start early by the
    start call's round trip. A span longer than start to stop (clocks that disagree) is cut at the stop call; with
    no span known the band is start to stop, and its label says so."""
    start, stop = calls[0] - origin, calls[1] - origin
    window = {"window_s": [start, stop], "calls_s": [start, stop], "trace_span_s": trace_span_s}
    if trace_span_s is None:
        return {**window, "label": "profiler start to stop (the trace's span is unknown)"}
    if start + trace_span_s > stop:
        return {**window, "label": f"profiled window ({trace_span_s:.2f} s traced, cut at the stop call)"}
    return {**window, "window_s": [start, start + trace_span_s],
            "label": f"profiled window ({trace_span_s:.2f} s traced, from the start call)"}


class Observer:
    """`async with Observer(...) as observed:` (or start()/stop()) around a measured window."""

    def __init__(self, scrape_interval_s: float, metrics_at: str | None, base_url: str | None, headers: dict,
                 clock: Clock, telemetry: bool = True) -> None:
        self.clock = clock
        self.observed = Observed(origin=clock.now())
        self._scraper = None
        if base_url is None:
            self.observed.notes.append("the bundled engine runs in-process: no /metrics to scrape")
        elif scrape_interval_s > 0:
            self._scraper = Scraper(metrics_at or metrics_url(base_url), scrape_interval_s, clock.now, headers)
        self._sampler = GpuSampler(clock=clock.now) if telemetry else None

    async def start(self) -> Observed:
        if self._scraper is not None:
            await self._scraper.start()
        if self._sampler is not None:
            self._sampler.start()
        return self.observed

    async def stop(self) -> Observed:
        if self._scraper is not None:
            self.observed.scrape, self._scraper = await self._scraper.stop(), None
        if self._sampler is not None:
            self.observed.telemetry, self._sampler = self._sampler.stop(), None
        return self.observed

    async def __aenter__(self) -> Observed:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()


def profiled_window(record) -> ProfiledWindow | None:
    """The run's profiled window read by `infertrace analyze`, once per run (kept on `record.observed`); None
    when no trace files were written. Traces on another host leave a note instead."""
    observed, files = record.observed, (record.profile or {}).get("trace_files")
    if observed is None or not files:
        return None
    if observed.profiled is None:
        observed.profiled = _analyze(files)
    return observed.profiled


def _analyze(trace_files: list[str]) -> ProfiledWindow:
    local = [Path(f) for f in trace_files if Path(f).is_file()]
    if not local:
        return ProfiledWindow(note="the profiled window's traces are not on this host: no phases in the report")
    from infertrace.analyze.capture import CaptureError, load_capture
    from infertrace.analyze.report import build_report

    try:
        capture = load_capture(local[0] if len(local) == 1 else local[0].parent)
    except CaptureError as e:
        return ProfiledWindow(note=f"the profiled window's traces could not be analysed: {e}")
    report = build_report(capture)
    return ProfiledWindow(report.table("phases"), report.table("steps"), _trace_span_s(capture))


def _trace_span_s(capture) -> float | None:
    """From the first event's start to the last event's end over the capture's ranks (the frontend's own trace,
    where there is one, is not the engine's window)."""
    events = [r.events for r in capture.ranks if not r.events.empty]
    spans = [(int(e["ts_ns"].min()), int((e["ts_ns"] + e["dur_ns"]).max())) for e in events]
    if not spans:
        return None
    return (max(end for _, end in spans) - min(start for start, _ in spans)) / 1e9


def run_findings(record) -> list:
    """What a measured run shows (docs/report.md's rules), from its records and what was observed beside them.
    For a run with `--report`, the profiled window is analysed here (once) so that the findings printed, saved in
    the result and shown in the report are the same."""
    from infertrace.load.observe.findings import find_all

    observed = record.observed
    if observed is None:
        return []
    window = profiled_window(record) if record.config is not None and record.config.report else observed.profiled
    return find_all(record.results, observed.origin, observed.scrape, observed.telemetry, record.client_cpu,
                    record.client_lag.p99, phases=window.phases if window else None,
                    profile_window=observed.profile_window)
