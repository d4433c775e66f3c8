"""One analysis report: every table `infertrace analyze` shows, computed from a capture.

Each analysis runs on its own: one that cannot run on this capture (no GPU work, no step annotations, HTA not
importable) leaves a one-line reason in `skipped` and the others still run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from infertrace.analyze import breakdown, critical, hta_bridge, launches, phases, ranks, requests
from infertrace.analyze.capture import Capture, load_capture
from infertrace.analyze.events import GPU_WORK

SCHEMA = "infertrace.analyze/1"
# Table names in display order.
TABLES = ("temporal", "idle", "kernel_types", "top_kernels", "overlap", "launches", "categories", "phases",
          "phase_categories", "steps", "frontend", "rank_communication", "step_skew", "step_requests",
          "critical_summary", "critical_path", "critical_segments", "cpu_ops", "cpu_steps")


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
    files: dict[int, list[str]] = field(default_factory=dict)  # each rank's trace files (for --perfetto)
    run_notes: list[str] = field(default_factory=list)  # how this run went (processes, the cache): printed with the
    # notes, not part of the report's document (a cached report was made by another run)
    capture: str | None = None  # the capture read, of those at the source (catalog.select)

    def table(self, name: str) -> pd.DataFrame | None:
        return self.tables.get(name)


GPU_TABLES = ("temporal", "idle", "kernel_types", "top_kernels", "overlap", "launches", "categories")
NO_GPU = "no GPU kernels in the capture (a CPU-only trace)"
NO_STEPS = "no step annotations (step[...], vLLM execute_context_.., ProfilerStep#..) in the capture"


@dataclass(slots=True)
class RankPart:
    """What one rank contributes to a report, computed from its events alone (in a worker process, or on another
    host under Ray), small enough to send back: every per-rank table, and the sums that add up across ranks."""

    row: dict  # the rank table's row, without `rank`
    step_names: set[str]  # ProfilerStep names, to decide HTA's last-step trim over the whole capture
    trimmed: bool  # whether the HTA breakdowns left out the last ProfilerStep
    has_gpu: bool
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)  # each with a `rank` column to fill in
    kernel_types: dict[str, int] = field(default_factory=dict)  # ns per kernel type and overlap
    categories: pd.DataFrame | None = None  # category, ops, total_ns
    skipped: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def rank_part(events: pd.DataFrame, row: dict, trim: bool | None = None,
              config: AnalyzeConfig | None = None) -> RankPart:
    """Every analysis of one rank. `trim`: leave the last ProfilerStep out of the HTA breakdowns (None: when this
    rank alone has two ProfilerStep names or more)."""
    config = config or AnalyzeConfig()
    names = breakdown.profiler_step_names([events])
    trim = len(names) >= 2 if trim is None else trim
    has_gpu = bool(events["kind"].isin(GPU_WORK).any())
    part = RankPart(row, names, trim, has_gpu)

    def run(name: str, fn) -> None:
        try:
            part.tables[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one analysis failing must not take the others down
            part.skipped[name] = _failure(exc)

    if has_gpu:
        try:
            gpu = breakdown.classified_gpu_work(events, trim)
        except Exception as exc:  # noqa: BLE001 - e.g. HTA's classifier cannot be imported
            gpu = None
            for name in ("temporal", "kernel_types", "top_kernels", "overlap"):
                part.skipped[name] = _failure(exc)
        if gpu is not None and not gpu.empty:
            run("temporal", lambda: breakdown.temporal_breakdown({0: gpu}))
            try:
                part.kernel_types = breakdown.kernel_type_totals(gpu)
            except Exception as exc:  # noqa: BLE001
                part.skipped["kernel_types"] = _failure(exc)
            run("top_kernels", lambda: breakdown.top_kernels({0: gpu}, config.top_kernels, config.duration_ratio))
            run("overlap", lambda: breakdown.comm_comp_overlap({0: gpu}))
        gpu = None  # a copy of the GPU ops: not kept while the step analyses make their own
        run("idle", lambda: hta_bridge.idle_time_breakdown(None, {0: breakdown.hta_window(events, trim)}))
        run("launches", lambda: launches.launch_summary({0: launches.launches(events)}))
        try:
            part.categories = phases.rank_categories(events[events["kind"].isin(GPU_WORK).to_numpy()])
        except Exception as exc:  # noqa: BLE001
            part.skipped["categories"] = _failure(exc)
    run("steps", lambda: _steps({0: events}))
    steps = part.tables.get("steps")
    if not has_gpu:  # a CPU-only capture: where its CPU time went, instead of empty GPU tables
        try:
            ops = phases.self_times(events)
            part.tables["cpu_ops"] = phases.cpu_operators(ops)
            if steps is not None and not steps.empty:
                part.tables["cpu_in_steps"] = phases.cpu_in_steps(ops, steps)
        except Exception as exc:  # noqa: BLE001
            part.skipped["cpu_ops"] = _failure(exc)
    if steps is not None and not steps.empty:
        try:
            ordered = steps.sort_values("ts_ns", kind="stable").reset_index(drop=True)
            part.tables["step_communication"] = ranks.step_communication(events, ordered)
        except Exception as exc:  # noqa: BLE001
            part.skipped["rank_communication"] = _failure(exc)
        run("step_path", lambda: critical.step_path(events, steps))
    return part


def build_report(capture: Capture, config: AnalyzeConfig | None = None) -> Report:
    config = config or AnalyzeConfig()
    events = {r.rank: r.events for r in capture.ranks}
    trim = len(breakdown.profiler_step_names(list(events.values()))) >= 2
    parts = {r.rank: rank_part(r.events, _rank_row(r), trim, config) for r in capture.ranks}
    report = combine(str(capture.source), parts, config, list(capture.problems), list(capture.notes))
    report.files = {r.rank: [str(r.path)] for r in capture.ranks}
    report.capture = capture.name
    if capture.frontend:
        report.tables["frontend"] = frontend_ops(capture.frontend)
    add_step_requests(report, capture)
    return report


def add_step_requests(report: Report, capture) -> None:
    """Each numbered step's requests, where `infertrace serve` wrote its request log beside the capture."""
    steps = report.tables.get("steps")
    if steps is None or steps.empty:
        return
    try:
        if (log := requests.find_request_log(capture)) is not None:  # `infertrace serve` wrote it at the stop
            report.tables["step_requests"] = requests.step_requests(steps, log)
    except Exception as exc:  # noqa: BLE001 - one analysis failing must not take the others down
        report.skipped["step_requests"] = _failure(exc)


def combine(source: str, parts: dict[int, RankPart], config: AnalyzeConfig | None = None,
            problems: list[str] | None = None, notes: list[str] | None = None) -> Report:
    """One report from the ranks' parts (`rank_part`), keyed by rank."""
    config = config or AnalyzeConfig()
    rows = [{"rank": rank, **part.row} for rank, part in sorted(parts.items())]
    report = Report(source, pd.DataFrame(rows), list(problems or []), list(notes or []))
    for rank, part in sorted(parts.items()):
        report.problems.extend(part.problems)
    if any(part.trimmed and len(part.step_names) >= 1 for part in parts.values()) and \
            len(set().union(*(p.step_names for p in parts.values()))) >= 2:
        report.notes.append("the last ProfilerStep is left out of the HTA breakdowns, as HTA does")
    ordered = sorted(parts.items())
    for name, part in ((n, p) for _, p in ordered for n in p.skipped):
        report.skipped.setdefault(name, part.skipped[name])
    has_gpu = any(part.has_gpu for part in parts.values())
    if has_gpu:
        for name in ("temporal", "idle", "top_kernels", "overlap", "launches"):
            if name not in report.skipped:
                _concat_into(report, name, ordered)
        if "kernel_types" not in report.skipped:
            totals: dict[str, int] = {}
            for _, part in ordered:
                for label, ns in part.kernel_types.items():
                    totals[label] = totals.get(label, 0) + ns
            if totals:
                report.tables["kernel_types"] = breakdown.kernel_type_table(totals)
        if "categories" not in report.skipped:
            report.tables["categories"] = phases.combine_categories(
                [p.categories for _, p in ordered if p.categories is not None])
        if "top_kernels" in report.tables:
            report.tables["top_kernels"] = report.tables["top_kernels"].sort_values(
                ["kernel_type", "name", "rank"], ignore_index=True)
    else:
        for name in GPU_TABLES:
            report.skipped[name] = NO_GPU
        if "cpu_ops" not in report.skipped:
            _concat_into(report, "cpu_ops", ordered)
            if "cpu_ops" in report.tables:
                cpu = report.tables["cpu_ops"]
                report.tables["cpu_ops"] = cpu[["rank"] + [c for c in cpu.columns if c != "rank"]]
    if "steps" in report.skipped:
        return report
    _concat_into(report, "steps", ordered)
    steps = report.tables.get("steps")
    if steps is None or steps.empty:
        report.tables.pop("steps", None)
        for name in ("steps", "phases", "phase_categories"):
            report.skipped[name] = NO_STEPS
        return report

    def run(name: str, fn) -> None:
        try:
            report.tables[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one analysis failing must not take the others down
            report.skipped[name] = _failure(exc)

    run("phases", lambda: phases.phase_summary(steps, has_gpu))
    per_rank = {rank: p.tables["step_communication"] for rank, p in ordered if "step_communication" in p.tables}
    if len(parts) >= 2 and (note := _unmatched_steps(steps, sorted(parts))) is not None:
        report.notes.append(note)
    if len(per_rank) >= 2 and "rank_communication" not in report.skipped:
        try:
            report.tables.update(ranks.tables_of(per_rank))
        except Exception as exc:  # noqa: BLE001
            report.skipped["rank_communication"] = _failure(exc)
    paths = {rank: p.tables["step_path"] for rank, p in ordered if "step_path" in p.tables}
    if len(paths) >= 2 or any((p["collective"] != "").any() for p in paths.values()):
        run("critical_path", lambda: critical.critical_path(paths))
        if "critical_path" in report.tables:
            report.tables["critical_segments"] = report.tables["critical_path"].attrs.pop("segments", pd.DataFrame())
        if "critical_path" in report.tables and not report.tables["critical_path"].empty:
            run("critical_summary", lambda: critical.summary(report.tables["critical_path"]))
    if has_gpu:
        run("phase_categories", lambda: phases.phase_categories(steps))
    else:
        report.skipped["phase_categories"] = NO_GPU
        in_steps = [p.tables["cpu_in_steps"] for _, p in ordered if "cpu_in_steps" in p.tables]
        run("cpu_steps", lambda: phases.cpu_steps_table(in_steps, steps))
        if "phases" in report.tables:
            run("phases", lambda: phases.cpu_phase_summary(report.tables["phases"], in_steps))
    return report


def _unmatched_steps(steps: pd.DataFrame, ranks: list[int]) -> str | None:
    """A note where the ranks have different numbers of steps: the cross-rank tables match steps by order, so they
    compare only the steps every rank has, and a rank without steps is not in them."""
    counts = steps.groupby("rank").size().reindex(ranks, fill_value=0)
    if counts.nunique() <= 1:
        return None
    n = int(counts.min())
    listed = ", ".join(f"rank {r}: {int(c):,}" for r, c in counts.items())
    text = f"the ranks have different numbers of steps ({listed}): "
    if n == 0:
        none = ", ".join(str(r) for r, c in counts.items() if c == 0)
        return text + f"rank {none} has none and is left out of the cross-rank tables (step skew, critical path)"
    return text + (f"the cross-rank tables (step skew, critical path) compare the first {n:,} steps of each rank; "
                   "the later steps are left out of them")


def _concat_into(report: Report, name: str, ordered: list[tuple[int, RankPart]]) -> None:
    frames = [p.tables[name].assign(rank=rank) for rank, p in ordered
              if name in p.tables and p.tables[name] is not None and not p.tables[name].empty]
    if frames:
        report.tables[name] = pd.concat(frames, ignore_index=True)
    elif any(name in p.tables for _, p in ordered):
        report.tables[name] = next(p.tables[name] for _, p in ordered if name in p.tables)


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


def _rank_row(r) -> dict:
    return rank_row(r.path, r.events, r.claimed_rank, r.device, r.exact_times)


def rank_row(path, events: pd.DataFrame, claimed, device, exact_times: bool) -> dict:
    kinds = events["kind"].value_counts()
    return {
        "file": path.name, "claimed_rank": claimed if claimed is not None else "", "device": device or "",
        "events": len(events), "kernels": int(kinds.get("kernel", 0)),
        "gpu_ops": int(sum(kinds.get(k, 0) for k in GPU_WORK)), "exact_ns": exact_times,
    }
