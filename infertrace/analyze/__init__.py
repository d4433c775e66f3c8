"""Trace analysis: HTA's breakdowns plus inference phases, over Kineto traces and nsys exports.

    from infertrace.analyze import analyze_path
    report = analyze_path("traces/")   # a Report: report.tables["phases"], ["temporal"], ["top_kernels"], ...

Names are imported on first use, so that `infertrace --help` does not load pandas.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AnalyzeConfig": "infertrace.analyze.report",
    "Report": "infertrace.analyze.report",
    "analyze_path": "infertrace.analyze.report",
    "build_report": "infertrace.analyze.report",
    "Capture": "infertrace.analyze.capture",
    "CaptureError": "infertrace.analyze.capture",
    "load_capture": "infertrace.analyze.capture",
}

__all__ = ["AnalyzeConfig", "Capture", "CaptureError", "Report", "analyze_path", "build_report", "load_capture"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
