"""Reports as one self-contained HTML page: inline CSS and SVG, and the run report's interactive per-step timeline
(plotly, its script inlined once); nothing is fetched, the page opens offline."""

from __future__ import annotations

import math
from html import escape
from pathlib import Path

import pandas as pd

from infertrace.analyze.categories import CATEGORIES
from infertrace.analyze.render import LABELS, TITLES
from infertrace.analyze.report import Report
from infertrace.analyze.timeline import phases_data, phases_figure
from infertrace.output import write_text

_COLORS = {
    "attention": "#4e79a7", "GEMM": "#f28e2b", "norm": "#76b7b2", "activation": "#59a14f",
    "elementwise": "#edc948", "communication": "#e15759", "memcpy/memset": "#b07aa1", "other": "#9c9c9c",
    "busy": "#59a14f", "host wait": "#e15759", "other idle": "#bab0ac",
    "compute": "#4e79a7", "non-compute": "#f28e2b", "idle": "#bab0ac",
}
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1200px;color:#222;
padding:0 1rem}
h1{font-size:1.4rem}h2{font-size:1.1rem;margin-top:2rem;border-bottom:1px solid #ddd;padding-bottom:.2rem}
table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0}
th,td{padding:.2rem .6rem;border-bottom:1px solid #eee;text-align:right}
th{background:#f6f6f6}td.t,th.t{text-align:left}
.note{color:#555;font-size:.85rem}.warn{color:#a15c00}
.legend span{display:inline-block;margin-right:1rem;font-size:.8rem}
.legend i{display:inline-block;width:.8rem;height:.8rem;margin-right:.3rem;vertical-align:middle}
"""


def write_html(report: Report, path: Path) -> Path:
    return write_text(path, html_report(report))


def html_report(report: Report) -> str:
    parts = [f"<h1>infertrace analyze: {escape(report.source)}</h1>", html_table(report.ranks)]
    if report.problems:
        parts.append("<ul class='warn'>" + "".join(f"<li>{escape(p)}</li>" for p in report.problems) + "</ul>")
    if report.notes:
        parts.append("<ul class='note'>" + "".join(f"<li>{escape(n)}</li>" for n in report.notes) + "</ul>")
    for name in ("phases", "phase_categories", "categories", "temporal", "idle", "kernel_types", "top_kernels",
                 "overlap", "launches", "rank_communication", "step_skew", "critical_summary", "critical_path",
                 "cpu_ops", "cpu_steps", "frontend"):
        table = report.tables.get(name)
        if table is None or table.empty:
            continue
        parts.append(f"<h2>{escape(TITLES[name])}</h2>")
        chart = _CHARTS.get(name)
        if chart is not None:
            parts.append(chart(table))
        parts.append(html_table(display(name, table)))
    steps = report.tables.get("steps")
    if steps is not None and not steps.empty:
        parts.insert(2, "<h2>Each step over the capture</h2>" + _steps_timeline(steps))
    if report.skipped:
        parts.append("<h2>Not shown</h2><ul class='note'>" + "".join(
            f"<li>{escape(n)}: {escape(w)}</li>" for n, w in report.skipped.items()) + "</ul>")
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>infertrace analyze: {escape(Path(report.source).name)}</title><style>{_CSS}</style>"
            f"{_plotly_script(steps)}</head>"
            f"<body>{''.join(parts)}</body></html>\n")


def display(name: str, table: pd.DataFrame) -> pd.DataFrame:
    """The table as a person reads it: shares as percentages, the kernel's readable name, names in words with
    their units (the terminal's header where it has one, `render.LABELS`)."""
    if name == "top_kernels":
        table = table.drop(columns=["name"]).rename(columns={"short_name": "kernel"})
    labels = LABELS.get(name, {})
    out = table.copy()
    for column in out.columns:
        text = str(column)
        if pd.api.types.is_numeric_dtype(out[column]) and ("share" in text or text.endswith("_pctg")):
            scale = 1.0 if text.endswith("_pctg") else 100.0
            out[column] = [None if v is None or pd.isna(v) else f"{scale * v:.1f}%" for v in out[column]]
            if column not in labels:
                labels = {**labels, column: text.replace("_pctg", "").replace("_", " ") + " (%)"}
    # words, not identifiers: "cpu mean (ms)"
    return out.rename(columns=lambda c: labels.get(c, str(c).replace("_", " ")))


def _steps_timeline(steps: pd.DataFrame) -> str:
    """Each step's time by step type, and its GPU busy and host-wait time, over the capture (rank 0)."""
    first = steps[steps["rank"] == steps["rank"].min()] if "rank" in steps else steps
    figure = phases_figure(phases_data(first.sort_values("ts_ns")))
    return figure.to_html(full_html=False, include_plotlyjs=False, div_id="steps",
                          config={"displaylogo": False, "responsive": True})


def _plotly_script(steps: pd.DataFrame | None) -> str:
    if steps is None or steps.empty:
        return ""
    from plotly.offline import get_plotlyjs

    return f"<script>{get_plotlyjs()}</script>"


def html_table(df: pd.DataFrame) -> str:
    head = "".join(f"<th class='{_align(df[c])}'>{escape(str(c))}</th>" for c in df.columns)
    rows = []
    for record in df.itertuples(index=False):
        cells = "".join(f"<td class='{_align(df[c])}'>{escape(_cell(v))}</td>" for c, v in zip(df.columns, record))
        rows.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _align(column: pd.Series) -> str:
    return "n" if pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column) else "t"


def _cell(value) -> str:
    if value is None or value is pd.NA:
        return "–"
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.1f}"
    return str(value)


def _bars(rows: list[tuple[str, list[tuple[str, float]]]], unit: str = "%") -> str:
    """Horizontal stacked bars, one per row; each segment is (label, value), values scaled to the largest row."""
    if not rows:
        return ""
    largest = max(sum(v for _, v in segs) for _, segs in rows) or 1.0
    width, label_w, bar_h = 760, 160, 18
    height = len(rows) * (bar_h + 8) + 4
    svg = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img'>"]
    legend: dict[str, str] = {}
    for i, (label, segs) in enumerate(rows):
        y = 4 + i * (bar_h + 8)
        svg.append(f"<text x='0' y='{y + 13}' font-size='12'>{escape(label)}</text>")
        x = float(label_w)
        for seg, value in segs:
            w = (width - label_w - 70) * value / largest
            color = _COLORS.get(seg, "#888")
            legend[seg] = color
            if w > 0:
                svg.append(f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='{bar_h}' fill='{color}'>"
                           f"<title>{escape(seg)}: {value:,.2f}{unit}</title></rect>")
            x += w
        total = sum(v for _, v in segs)
        svg.append(f"<text x='{x + 4:.1f}' y='{y + 13}' font-size='11'>{total:,.1f}{unit}</text>")
    svg.append("</svg>")
    keys = "".join(f"<span><i style='background:{c}'></i>{escape(k)}</span>" for k, c in legend.items())
    return f"<div class='legend'>{keys}</div>{''.join(svg)}"


def _temporal_chart(df: pd.DataFrame) -> str:
    return _bars([(f"rank {r['rank']}", [("compute", r["compute_time_pctg"]),
                                         ("non-compute", r["non_compute_time_pctg"]), ("idle", r["idle_time_pctg"])])
                  for r in df.to_dict("records")])


def _phases_chart(df: pd.DataFrame) -> str:
    if "gpu_busy_share" not in df.columns:
        return ""  # a CPU-only capture: no GPU time to share out
    rows = []
    for r in df.to_dict("records"):
        busy, host = 100 * r["gpu_busy_share"], 100 * r["host_wait_share"]
        rows.append((str(r["type"]), [("busy", busy), ("host wait", host),
                                      ("other idle", max(0.0, 100 - busy - host))]))
    return _bars(rows)


def _phase_categories_chart(df: pd.DataFrame) -> str:
    rows = []
    for kind, group in df.groupby("type", sort=False):
        by_cat = dict(zip(group["category"], group["per_step (ms)"]))
        rows.append((str(kind), [(c, by_cat[c]) for c in CATEGORIES if c in by_cat]))
    return _bars(rows, unit=" ms")


def _categories_chart(df: pd.DataFrame) -> str:
    return _bars([(r["category"], [(r["category"], 100 * r["share"])]) for r in df.to_dict("records")])


_CHARTS = {"temporal": _temporal_chart, "phases": _phases_chart, "phase_categories": _phase_categories_chart,
           "categories": _categories_chart}
