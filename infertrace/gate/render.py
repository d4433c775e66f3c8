"""A gate report as a rich table for the terminal and as Markdown for a CI step summary."""

from __future__ import annotations

from rich import box
from rich.table import Table

from infertrace.gate.bounds import metric_unit
from infertrace.gate.check import Check, GateReport, Verdict

_STYLES = {Verdict.OK: "green", Verdict.NOISE: "yellow", Verdict.REGRESSION: "bold red"}


def headline(report: GateReport) -> str:
    return "regression" if report.regressed else "pass"


def footnote(report: GateReport) -> str:
    config = report.config
    runs = f"{_count(report.current_runs, 'run')}"
    if report.baseline_runs:
        runs += f" against {_count(report.baseline_runs, 'baseline run')}"
    return (
        f"{runs}; medians with {config.confidence:.0%} bootstrap intervals ({config.resamples} resamples, "
        f"seed {config.seed}). A bound fails only when its whole interval lies beyond it."
    )


def columns(report: GateReport) -> tuple[str, ...]:
    interval = f"{report.config.confidence:.0%} interval"
    return "metric", "verdict", "change", interval, "allowed", "baseline", "current"


def rows(report: GateReport) -> list[tuple[str, ...]]:
    return [_row(check) for check in report.checks]


def table(report: GateReport) -> Table:
    grid = Table(
        title=f"infertrace gate: {headline(report)}", caption=footnote(report), caption_justify="left",
        box=box.SIMPLE_HEAD, title_justify="left", show_edge=False, pad_edge=False, collapse_padding=True,
    )
    # in a narrow terminal the numbers wrap, while metric names and verdicts stay whole
    whole = {
        "metric": max((len(check.bound.metric) for check in report.checks), default=0),
        "verdict": len(Verdict.NOISE.value),
    }
    for name in columns(report):
        grid.add_column(name, justify="left" if name in whole else "right", min_width=whole.get(name))
    for check, (metric, verdict, *rest) in zip(report.checks, rows(report)):
        grid.add_row(metric, f"[{_STYLES[check.verdict]}]{verdict}[/]", *rest)
    return grid


def markdown(report: GateReport) -> str:
    lines = [
        f"### infertrace gate: {headline(report)}",
        "",
        "| " + " | ".join(columns(report)) + " |",
        "| " + " | ".join("---" for _ in columns(report)) + " |",
    ]
    for check, cells in zip(report.checks, rows(report)):
        metric, verdict, *rest = cells
        verdict = f"**{verdict}**" if check.verdict is Verdict.REGRESSION else verdict
        lines.append("| " + " | ".join([f"`{metric}`", verdict, *rest]) + " |")
    return "\n".join([*lines, "", footnote(report), ""])


def failure_markdown(message: str) -> str:
    return f"### infertrace gate: unusable input\n\n{message}\n"


def _row(check: Check) -> tuple[str, ...]:
    metric, bound = check.bound.metric, check.bound
    unit = metric_unit(metric)
    if check.change is None:
        change = "-"
        interval = f"[{_number(check.interval[0])}, {_number(check.interval[1])}]{_suffix(unit)}"
    elif bound.relative:
        change = _percent(check.change)
        interval = f"[{_percent(check.interval[0])}, {_percent(check.interval[1])}]"
    else:
        change = f"{_number(check.change, signed=True)}{_suffix(unit)}"
        low, high = (_number(end, signed=True) for end in check.interval)
        interval = f"[{low}, {high}]{_suffix(unit)}"
    baseline = "-" if check.baseline is None else f"{_number(check.baseline)}{_suffix(unit)}"
    current = f"{_number(check.current)}{_suffix(unit)}"
    return metric, check.verdict.value, change, interval, bound.allowed(), baseline, current


def _number(value: float, signed: bool = False) -> str:
    sign = "+" if signed else ""
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:{sign},.0f}"
    if magnitude >= 100:
        return f"{value:{sign}.1f}"
    if magnitude >= 1 or value == 0:
        return f"{value:{sign}.2f}"
    return f"{value:{sign}.3g}"


def _percent(fraction: float) -> str:
    return f"{fraction * 100:+.1f}%"


def _suffix(unit: str) -> str:
    return f" {unit}" if unit else ""


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
