"""One self-contained HTML page for a run: plotly's JavaScript inlined once, so the file opens offline.

`report_document` gathers the run into one JSON-able dict; `render_html` draws the page from that dict alone,
so what `--report` shows and what the JSON holds cannot differ."""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from infertrace.analyze.html import display as analyze_display
from infertrace.analyze.html import html_table as analyze_table
from infertrace.analyze.timeline import phases_data, phases_figure
from infertrace.load.observe.findings import Finding
from infertrace.load.observe.scrape import ScrapeSeries
from infertrace.load.observe.telemetry import TelemetrySeries
from infertrace.load.records import RequestResult
from infertrace.load.report.figures import (
    latency_data,
    latency_figure,
    timeline_data,
    timeline_figure,
)
from infertrace.load.report.requests import requests_html
from infertrace.output import write_text

REPORT_VERSION = 2  # 2: the timeline's profile window is the span its trace covers, with its label
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:1.5rem auto;max-width:1320px;color:#222;
padding:0 1rem}
h1{font-size:1.4rem;margin-bottom:.2rem}h2{font-size:1.1rem;margin-top:1.8rem;border-bottom:1px solid #ddd;
padding-bottom:.2rem}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0}
th,td{padding:.25rem .6rem;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
th{background:#f6f6f6}td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
.findings td:first-child{font-weight:600}.rule{color:#666;font-family:monospace}
.note{color:#555;font-size:.85rem}.none{color:#2a7a2a}
"""


def report_document(results: list[RequestResult], origin: float, *, scrape: ScrapeSeries | None = None,
                    telemetry: TelemetrySeries | None = None, findings: list[Finding] = (),
                    profile_window: tuple[float, float] | None = None, trace_span_s: float | None = None,
                    result: dict | None = None, phases: pd.DataFrame | None = None,
                    steps: pd.DataFrame | None = None, title: str = "infertrace run report",
                    requests: dict | None = None) -> dict:
    """The report as JSON-able data. `origin` is the run's start on the records' clock; `profile_window` the
    profiler's start and stop calls on that clock and `trace_span_s` how long its trace covers (figures.
    profiled_span); `result` is the run's result (as `--result-json` writes it); `phases` is the profiled window's
    `analyze` phase summary, kept as numbers (shares as fractions) as `analyze --json` keeps it."""
    return {
        "report_version": REPORT_VERSION, "title": title,
        "findings": [f.to_json() for f in findings],
        "timeline": timeline_data(results, origin, scrape, telemetry, profile_window, trace_span_s),
        "latency": latency_data(results),
        "phases": None if phases is None else _records(phases),
        "steps": None if steps is None or steps.empty else phases_data(steps),
        "result": result,
        "requests": requests,  # the server's request log joined to the requests (report/requests.py)
        "notes": [*(scrape.notes if scrape else []), *(telemetry.notes if telemetry else [])],
    }


def _records(frame: pd.DataFrame) -> list[dict]:
    return [{k: _json_value(v) for k, v in row.items()} for row in frame.to_dict("records")]


def _json_value(v):
    if v is None or v is pd.NA:
        return None
    if hasattr(v, "item"):  # numpy scalars
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def render_html(doc: dict) -> str:
    """The page: findings, the timeline, the profiler window's phases, latency distributions, the result."""
    timeline = timeline_figure(doc["timeline"])
    latency = latency_figure(doc["latency"])
    parts = [f"<h1>{escape(doc['title'])}</h1>"]
    if doc.get("result"):
        parts.append(_summary_html(doc["result"]))
    if (spec := (doc.get("result") or {}).get("speculative_decoding")) is not None:
        parts.append("<h2>Speculative decoding</h2>" + _table_html(_speculative_rows(spec)))
    parts.extend(_workload_html(doc.get("result") or {}))
    parts.append("<h2>Findings</h2>" + _findings_html(doc["findings"]))
    if doc["notes"]:
        parts.append("".join(f'<p class="note">{escape(n)}</p>' for n in doc["notes"]))
    parts.append("<h2>Timeline</h2>" + _figure_html(timeline, "timeline"))
    if doc.get("requests"):
        parts.append(requests_html(doc["requests"], _figure_html))
    if doc.get("phases"):
        parts.append("<h2>Profiler window: inference phases</h2>" + _phases_html(doc["phases"]))
    if doc.get("steps"):
        parts.append("<h2>Profiler window: each step</h2>" + _figure_html(phases_figure(doc["steps"]), "steps"))
    parts.append("<h2>Latency distributions</h2>" + _figure_html(latency, "latency"))
    if doc.get("result"):
        rows = [{"figure": k, "value": v} for k, v in doc["result"].items() if _scalar(v)]
        parts.append("<h2>Result</h2>" + _table_html(rows))
    parts.append(f'<script type="application/json" id="findings-data">{_script_json(doc["findings"])}</script>')
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(doc["title"])}</title>'
            f"<style>{_CSS}</style><script>{get_plotlyjs()}</script></head><body>"
            + "\n".join(parts) + "</body></html>\n")


def write_report(path: str | Path, doc: dict) -> Path:
    """Writes the HTML page (creating its folder)."""
    return write_text(path, render_html(doc))


def _figure_html(fig: go.Figure, div_id: str) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


SUMMARY = (  # the run's headline figures, as (label, result key, unit, scale)
    ("output throughput", "output_throughput", "tok/s", 1.0),
    ("input throughput", "input_sequence_throughput", "inputs/s", 1.0),  # embeddings
    ("E2EL median / p99", ("median_e2el_ms", "p99_e2el_ms"), "ms", 1.0),
    ("TTFT median / p99", ("median_ttft_ms", "p99_ttft_ms"), "ms", 1.0),
    ("TTFCT median / p99 (to the answer, after reasoning)", ("median_ttfct_ms", "p99_ttfct_ms"), "ms", 1.0),
    ("TPOT median", "median_tpot_ms", "ms", 1.0),
    ("ITL median / p99", ("median_itl_ms", "p99_itl_ms"), "ms", 1.0),
    ("server prefix-cache hit rate / implied by the workload",
     ("server_prefix_cache_hit_rate", "implied_prefix_cache_hit_rate"), "%", 100.0),
    ("energy per output token", "energy_per_output_token_j", "J", 1.0),
)


def _summary_html(result: dict) -> str:
    """The headline figures and every warning the run's result holds, above the findings."""
    rows = []
    for label, keys, unit, scale in SUMMARY:
        keys = keys if isinstance(keys, tuple) else (keys,)
        values = [result.get(k) for k in keys]
        if values[0] is None or (keys[0] == "median_ttfct_ms" and values == [result.get("median_ttft_ms"),
                                                                               result.get("p99_ttft_ms")]):
            continue  # TTFCT only where reasoning came first; other figures only where measured
        text = " / ".join("-" if v is None else f"{v * scale:,.{3 if unit == 'J' else 1}f}" for v in values)
        rows.append({"figure": label, "value": f"{text} {unit}"})
    warnings = [w for key in ("headroom_warnings", "prefix_cache_warnings", "token_count_warnings")
                for w in result.get(key) or []]
    warnings += (result.get("request_log") or {}).get("warnings") or []  # what of the server's log was not joined
    return ("<h2>Summary</h2>" + _table_html(rows)
            + "".join(f'<p class="note">warning: {escape(w)}</p>' for w in warnings))


def _workload_html(result: dict) -> list[str]:
    """The figures of a load shape that has its own (per LoRA adapter, structured output, images): the tables the
    terminal prints after the summary, the same function drawing both."""
    from infertrace.load.results.adapters import adapter_table
    from infertrace.load.results.images import image_table
    from infertrace.load.results.structured import structured_table

    out = []
    for key, heading, table in (("per_adapter", "Per LoRA adapter", adapter_table),
                                ("structured", "Structured output", structured_table),
                                ("images", "Images", image_table)):
        if figures := result.get(key):
            out.append(f"<h2>{heading}</h2>" + _rich_table_html(table(figures)))
    return out


def _rich_table_html(table) -> str:
    """A rich Table as the page's table: its headers and cells as the terminal shows them."""
    columns = [str(c.header) for c in table.columns]
    cells = [list(c.cells) for c in table.columns]
    return _table_html([{name: str(col[i]) for name, col in zip(columns, cells)} for i in range(table.row_count)])


def _speculative_rows(spec: dict) -> list[dict]:
    """The table's rows (results/render.py speculative_rows: one function for both), as figure and value."""
    from infertrace.load.results.render import speculative_rows

    return [{"figure": label.strip(), "value": value} for label, value in speculative_rows(spec)]


def _findings_html(findings: list[dict]) -> str:
    if not findings:
        return ('<p class="none">No rule fired: no queueing, KV pressure, clock fall, client bottleneck or CPU-bound '
                "step type seen.</p>")
    rows = "".join(
        f"<tr><td>{escape(f['what'])}</td><td class='n'>{_when(f['when_s'])}</td>"
        f"<td>{escape(f['evidence'])}</td><td class='rule'>{escape(f['rule'])}</td></tr>" for f in findings)
    return ('<table class="findings"><tr><th>finding</th><th>from (s)</th><th>evidence</th><th>rule</th></tr>'
            f"{rows}</table>")


def _when(when_s: float | None) -> str:
    return "-" if when_s is None else f"{when_s:.1f}"


def _phases_html(rows: list[dict]) -> str:
    """The phase summary as `infertrace analyze --html` shows it: the same function, so the same percentages and
    column names."""
    return analyze_table(analyze_display("phases", pd.DataFrame(rows)))


def _table_html(rows: list[dict]) -> str:
    if not rows:
        return ""
    columns = list(rows[0])
    head = "".join(f"<th>{escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(_cell(r.get(c)) for c in columns) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(v) -> str:
    if isinstance(v, float):
        return f"<td class='n'>{v:.4g}</td>" if abs(v) < 1e4 else f"<td class='n'>{v:,.0f}</td>"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"<td class='n'>{v}</td>"
    return f"<td>{'-' if v is None else escape(str(v))}</td>"


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _script_json(doc) -> str:
    # inside <script>, "</" would end the element early
    return json.dumps(doc, allow_nan=False).replace("</", "<\\/")
