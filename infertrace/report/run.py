"""`bench --report`: one measured run's report document, with the profiled window analysed when its traces are on
this host."""

from __future__ import annotations

from pathlib import Path

from infertrace.report.page import report_document


def profile_phases(trace_files: list[str]) -> tuple[object, object, str | None]:
    """(phase summary, per-step table, note) of the profiled window's traces, read by `infertrace analyze`."""
    local = [Path(f) for f in trace_files if Path(f).is_file()]
    if not local:
        return None, None, ("the profiled window's traces are not on this host: no phases in the report"
                            if trace_files else None)
    from infertrace.analyze.capture import CaptureError
    from infertrace.analyze.report import analyze_path

    try:
        report = analyze_path(local[0] if len(local) == 1 else local[0].parent)
    except CaptureError as e:
        return None, None, f"the profiled window's traces could not be analysed: {e}"
    return report.table("phases"), report.table("steps"), None


def run_report_document(record, result: dict) -> dict:
    """The report of one measured run (a PointRecord) whose `result` is what --result-json holds for it."""
    from infertrace.load.observe import run_findings

    observed = record.observed
    phases = steps = None
    notes = []
    if record.profile and record.profile.get("trace_files"):
        phases, steps, note = profile_phases(record.profile["trace_files"])
        notes += [note] if note else []
    doc = report_document(record.results, observed.origin, scrape=observed.scrape, telemetry=observed.telemetry,
                          findings=run_findings(record), profile_window=observed.profile_window, result=result,
                          phases=phases, steps=steps)
    doc["notes"] = observed.notes + notes + doc["notes"]
    return doc
