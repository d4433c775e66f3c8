"""Each engine step of a capture over time, as data (plain lists, JSON-ready) and as a plotly figure drawn from
exactly that data; the analyze report and the run report both show it."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots


def _clean(values):
    """JSON has no NaN: missing figures are None."""
    return [None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v for v in values]


def phases_data(steps: pd.DataFrame) -> dict:
    """The per-step table of `infertrace.analyze.phases.step_metrics` as series: each step's start (ms after
    the first step), type, time, GPU busy and host-wait time."""
    if steps.empty:
        return {"start_ms": [], "type": [], "step_ms": [], "busy_ms": [], "host_wait_ms": []}
    start = (steps["ts_ns"] - steps["ts_ns"].min()) / 1e6
    return {"start_ms": _clean(start.tolist()), "type": steps["type"].astype(str).tolist(),
            "step_ms": _clean(steps["step_ms"].astype(float).tolist()),
            "busy_ms": _clean(steps["busy_ms"].astype(float).tolist()),
            "host_wait_ms": _clean(steps["host_wait_ms"].astype(float).tolist())}


def phases_figure(data: dict) -> go.Figure:
    """Each engine step over the capture, by type (top), and the shares of its time the GPU was busy or waited
    for the host (bottom), where a GPU worked at all: a CPU-only capture has only the top chart."""
    gpu = any(v for v in data["busy_ms"] + data["host_wait_ms"])
    titles = ["step time (ms) by step type"] + (["GPU busy and host wait per step (ms)"] if gpu else [])
    fig = make_subplots(rows=len(titles), cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=titles)
    kinds = sorted(set(data["type"]))
    for kind in kinds:
        pick = [i for i, k in enumerate(data["type"]) if k == kind]
        fig.add_trace(go.Scatter(x=[data["start_ms"][i] for i in pick], y=[data["step_ms"][i] for i in pick],
                                 mode="markers", name=kind, marker=dict(size=5)), row=1, col=1)
    if gpu:
        fig.add_trace(go.Bar(x=data["start_ms"], y=data["busy_ms"], name="GPU busy", marker_color="#59a14f"),
                      row=2, col=1)
        fig.add_trace(go.Bar(x=data["start_ms"], y=data["host_wait_ms"], name="host wait", marker_color="#e15759"),
                      row=2, col=1)
    fig.update_layout(barmode="stack", height=520 if gpu else 300, template="plotly_white",
                      margin=dict(l=60, r=30, t=50, b=40))
    fig.update_xaxes(title_text="ms after the first step", row=len(titles), col=1)
    return fig
