"""`bench --report`: one measured run's report document, with the profiled window analysed when its traces are on
this host."""

from __future__ import annotations

from infertrace.load.report.page import report_document


def run_report_document(record, result: dict) -> dict:
    """The report of one measured run (a PointRecord) whose `result` is what --result-json holds for it."""
    from infertrace.load.observe.observer import profiled_window, run_findings
    from infertrace.load.report.requests import requests_data
    from infertrace.load.results.tail import tail_findings

    observed = record.observed
    window = profiled_window(record)
    doc = report_document(record.results, observed.origin, scrape=observed.scrape, telemetry=observed.telemetry,
                          findings=[*run_findings(record), *tail_findings(record.results)],
                          profile_window=observed.profile_window,
                          requests=requests_data(record.results, getattr(record, "request_log", None)),
                          trace_span_s=window.trace_span_s if window else None, result=result,
                          phases=window.phases if window else None, steps=window.steps if window else None)
    doc["notes"] = observed.notes + ([window.note] if window and window.note else []) + doc["notes"]
    return doc
