"""CI regression gates: benchmark results checked against a baseline, noise-aware, with exit codes."""

from infertrace.gate.bounds import Bound, Kind, parse_bounds
from infertrace.gate.check import Check, GateConfig, GateReport, Verdict, evaluate
from infertrace.gate.results import ResultError, Run, load_runs, write_baseline

__all__ = [
    "Bound", "Check", "GateConfig", "GateReport", "Kind", "ResultError", "Run", "Verdict",
    "evaluate", "load_runs", "parse_bounds", "write_baseline",
]
