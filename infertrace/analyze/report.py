"""One analysis report: every table `infertrace analyze` shows, computed from a capture.

Each analysis runs on its own: one that cannot run on this capture (no GPU work, no step annotations, HTA not
importable) leaves a one-line reason in `skipped` and the others still run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from infertrace.analyze import breakdown, hta_bridge, launches, phases, ranks, requests
from infertrace.analyze.capture import Capture, load_capture
from infertrace.analyze.events import GPU_WORK

SCHEMA = "infertrace.analyze/1"
# Table names in display order.
TABLES = ("temporal", "idle", "kernel_types", "top_kernels", "overlap", "launches", "categories", "phases",
          "phase_categories", "steps", "frontend", "rank_communication", "step_skew", "step_requests")


@dataclass(slots=True)
class AnalyzeConfig:
    top_kernels: int = 10  # kernels named per rank and kernel type before the rest become "others" (HTA's 10)
    duration_ratio: float = 0.8  # HTA's cut: kernels past this quantile of the running total become "others"

    def __post_init__(self):
        if self.top_kernels < 1:
            raise ValueError(f"top_kernels must be at least 1, got {self.top_kernels}")
        if not 0 < self.duration_ratio <= 1:
            raise ValueError(f"duration_ratio must be in (0, 1], got {self.duration_ratio}")


@dataclass(slots=True)
class Report:
    source: str
    ranks: pd.DataFrame
    problems: list[str] = field(default_factory=list)  # inputs that could not be used as they are
    notes: list[str] = field(default_factory=list)  # how the figures were made, where it is not obvious
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def table(self, name: str) -> pd.DataFrame | None:
        return self.tables.get(name)


def build_report(capture: Capture, config: AnalyzeConfig | None = None) -> Report:
    config = config or AnalyzeConfig()
    report = Report(str(capture.source), _rank_table(capture), list(capture.problems), list(capture.notes))
    if capture.frontend:
        report.tables["frontend"] = frontend_ops(capture.frontend)
    events = {r.rank: r.events for r in capture.ranks}
    has_gpu = any(e["kind"].isin(GPU_WORK).any() for e in events.values())
    trim = len(breakdown.profiler_step_names(list(events.values()))) >= 2
    if trim:
        report.notes.append("the last ProfilerStep is left out of the HTA breakdowns, as HTA does")

    def run(name: str, fn) -> None:
        try:
            report.tables[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one analysis failing must not take the others down
            report.skipped[name] = _failure(exc)

    if has_gpu:
        try:
            gpu = {rank: breakdown.classified_gpu_work(e, trim) for rank, e in events.items()}
            gpu = {rank: g for rank, g in gpu.items() if not g.empty}
        except Exception as exc:  # noqa: BLE001 - e.g. HTA's classifier cannot be imported
            gpu = {}
            for name in ("temporal", "kernel_types", "top_kernels", "overlap"):
                report.skipped[name] = _failure(exc)
        if gpu:
            run("temporal", lambda: breakdown.temporal_breakdown(gpu))
        run("idle", lambda: hta_bridge.idle_time_breakdown(
            capture, {rank: breakdown.hta_window(e, trim) for rank, e in events.items()}))
        if gpu:
            run("kernel_types", lambda: breakdown.kernel_type_breakdown(gpu))
            run("top_kernels", lambda: breakdown.top_kernels(gpu, config.top_kernels, config.duration_ratio))
            run("overlap", lambda: breakdown.comm_comp_overlap(gpu))
        run("launches", lambda: launches.launch_summary({rank: launches.launches(e) for rank, e in events.items()}))
        run("categories", lambda: phases.capture_categories(
            {rank: e[e["kind"].isin(GPU_WORK).to_numpy()] for rank, e in events.items()}))
    else:
        for name in ("temporal", "idle", "kernel_types", "top_kernels", "overlap", "launches", "categories"):
            report.skipped[name] = "no GPU kernels in the capture (a CPU-only trace)"
    run("steps", lambda: _steps(events))
    steps = report.tables.get("steps")
    if steps is not None and steps.empty:
        del report.tables["steps"]
        for name in ("steps", "phases", "phase_categories"):
            report.skipped[name] = ("no step annotations (step[...], vLLM execute_context_.., "
                                    "ProfilerStep#..) in the capture")
    elif steps is not None:
        run("phases", lambda: phases.phase_summary(steps, has_gpu))
        try:
            report.tables.update(ranks.multi_rank_tables(events, steps))
        except Exception as exc:  # noqa: BLE001 - one analysis failing must not take the others down
            report.skipped["rank_communication"] = _failure(exc)
        if has_gpu:
            run("phase_categories", lambda: phases.phase_categories(steps))
        else:
            report.skipped["phase_categories"] = "no GPU kernels in the capture (a CPU-only trace)"
        if (log := requests.find_request_log(capture)) is not None:  # `infertrace serve` wrote it at the stop
            run("step_requests", lambda: requests.step_requests(steps, log))
    return report


def frontend_ops(fronts, top: int = 10) -> pd.DataFrame:
    """The API server's CPU trace (vLLM's frontend): its busiest CPU operations over the window."""
    frames = [f.events[(f.events["kind"] == "cpu_op").to_numpy()] for f in fronts]
    ops = pd.concat(frames, ignore_index=True)
    if ops.empty:
        return pd.DataFrame(columns=["name", "count", "sum (us)", "max (us)"])
    table = ops.assign(name=ops["name"].astype(str)).groupby("name")["dur"].agg(["count", "sum", "max"]).reset_index()
    table = table.rename(columns={"sum": "sum (us)", "max": "max (us)"})
    return table.sort_values("sum (us)", ascending=False).head(top).reset_index(drop=True)


def _failure(exc: Exception) -> str:
    return f"failed: {type(exc).__name__}: {exc}".splitlines()[0]


def analyze_path(path, config: AnalyzeConfig | None = None) -> Report:
    """Load the traces at `path` (a directory or one file) and run every analysis.
    Raises `capture.CaptureError` when no trace there is usable."""
    return build_report(load_capture(path), config)


def _steps(events: dict[int, pd.DataFrame]) -> pd.DataFrame:
    parts = []
    for rank, e in events.items():
        found = phases.find_steps(e)
        if not found.empty:
            parts.append(phases.step_metrics(e, found).assign(rank=rank))
    if not parts:
        return pd.DataFrame()
    steps = pd.concat(parts, ignore_index=True)
    return steps[["rank"] + [c for c in steps.columns if c != "rank"]]


def _rank_table(capture: Capture) -> pd.DataFrame:
    rows = []
    for r in capture.ranks:
        kinds = r.events["kind"].value_counts()
        rows.append({
            "rank": r.rank, "file": r.path.name,
            "claimed_rank": r.claimed_rank if r.claimed_rank is not None else "",
            "device": r.device or "", "events": len(r.events), "kernels": int(kinds.get("kernel", 0)),
            "gpu_ops": int(sum(kinds.get(k, 0) for k in GPU_WORK)),
            "exact_ns": r.exact_times,
        })
    return pd.DataFrame(rows)
