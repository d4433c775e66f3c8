"""The run report's series and figures. Each `*_data` function returns the JSON-able series; each `*_figure`
function draws a plotly figure from exactly that dict, so the JSON and the HTML show the same numbers."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from infertrace.load.observe.observer import profiled_span
from infertrace.load.observe.scrape import ScrapeSeries
from infertrace.load.observe.telemetry import TelemetrySeries
from infertrace.load.records import RequestResult

COLORS = {"in_flight": "#4e79a7", "throughput": "#59a14f", "ttft": "#f28e2b", "itl": "#76b7b2",
          "running": "#4e79a7", "waiting": "#e15759", "kv_usage": "#b07aa1", "preemptions": "#9c755f",
          "sm_util": "#59a14f", "power": "#edc948", "sm_clock": "#e15759", "memory": "#4e79a7",
          "tpot": "#b07aa1", "e2el": "#4e79a7", "profile": "rgba(255,165,0,0.18)"}
BUCKET_S = 1.0  # output throughput is counted in one-second buckets, as `vllm bench serve` counts its peak
HIST_BINS = 50
LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency"))


def _clean(values):
    """JSON has no NaN: missing figures are None."""
    return [None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v for v in values]


def in_flight(results: list[RequestResult], origin: float) -> dict:
    """Requests in flight as a step series: the count after each send or completion."""
    events = sorted([(r.t0, 1) for r in results] + [(r.end, -1) for r in results], key=lambda e: (e[0], e[1]))
    t_s, n, count = [], [], 0
    for t, step in events:
        count += step
        t_s.append(t - origin)
        n.append(count)
    return {"t_s": t_s, "requests": n}


def output_throughput(results: list[RequestResult], origin: float) -> dict:
    """Output tokens per second, per one-second bucket of the run, counted when each text event arrived (tokens
    of an event as the target reported them, else the request's output tokens spread over its events)."""
    buckets: dict[int, float] = defaultdict(float)
    for r in results:
        if r.ttft is None:
            continue
        times = r.t0 + r.ttft + np.concatenate(([0.0], np.cumsum(r.itl)))
        spread = (r.output_tokens or 0) / len(times)
        known = r.chunk_tokens if len(r.chunk_tokens) == len(times) and None not in r.chunk_tokens else None
        for k, t in enumerate(times):
            buckets[int((t - origin) // BUCKET_S)] += known[k] if known else spread
    last = max(buckets, default=-1)
    return {"t_s": [b * BUCKET_S for b in range(last + 1)],
            "output_tok_s": [buckets.get(b, 0.0) / BUCKET_S for b in range(last + 1)]}


def per_request(results: list[RequestResult], origin: float) -> dict:
    """Each successful request's TTFT and mean ITL, at the time it completed."""
    done = sorted((r for r in results if r.success and r.ttft is not None), key=lambda r: r.end)
    return {"end_s": [r.end - origin for r in done], "index": [r.index for r in done],
            "ttft_ms": [r.ttft * 1000 for r in done],
            "itl_mean_ms": [float(np.mean(r.itl)) * 1000 if r.itl else None for r in done]}


def timeline_data(results: list[RequestResult], origin: float, scrape: ScrapeSeries | None = None,
                  telemetry: TelemetrySeries | None = None, profile_window: tuple[float, float] | None = None,
                  trace_span_s: float | None = None) -> dict:
    """Every series of the run on one axis, seconds after `origin` (the run's start on the records' clock).
    `profile_window` is when the profiler's start and stop calls were made on that clock; `trace_span_s` how long
    its trace covers (`profiled_span`)."""
    return {
        "in_flight": in_flight(results, origin),
        "throughput": output_throughput(results, origin),
        "requests": per_request(results, origin),
        "server": scrape.to_json(origin) if scrape is not None else None,
        "gpu": telemetry.to_json(origin) if telemetry is not None else None,
        "profile_window": None if profile_window is None else profiled_span(profile_window, origin, trace_span_s),
    }


def timeline_figure(data: dict) -> go.Figure:
    """Stacked panels sharing the time axis: load, throughput, per-request latency, then the server's and the
    GPU's panels when their series exist; the profiler window shaded across all of them."""
    server = data.get("server") or {}
    gpu = data.get("gpu") or {}
    has_server = bool(server.get("times_s"))
    gpus = gpu.get("gpus") or []
    panels = ["requests in flight", "output tok/s (1 s buckets)", "per request at completion (ms)"]
    if has_server:
        panels += ["server: running and waiting requests", "server: KV cache usage (%) and preemptions/s"]
    if gpus:
        panels += ["GPU: SM utilisation (%) and power (W)", "GPU: SM clock (MHz) and memory used (GiB)"]
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.045,
                        subplot_titles=panels, specs=[[{"secondary_y": True}] for _ in panels])

    flight, tput, req = data["in_flight"], data["throughput"], data["requests"]
    fig.add_trace(go.Scatter(x=flight["t_s"], y=flight["requests"], name="in flight", line_shape="hv",
                             line_color=COLORS["in_flight"]), row=1, col=1)
    fig.add_trace(go.Bar(x=tput["t_s"], y=tput["output_tok_s"], name="output tok/s", offset=0, width=BUCKET_S,
                         marker_color=COLORS["throughput"]), row=2, col=1)
    hover = [f"request {i}" for i in req["index"]]
    fig.add_trace(go.Scatter(x=req["end_s"], y=req["ttft_ms"], name="TTFT (ms)", mode="markers", text=hover,
                             marker=dict(size=4, color=COLORS["ttft"])), row=3, col=1)
    fig.add_trace(go.Scatter(x=req["end_s"], y=req["itl_mean_ms"], name="mean ITL (ms)", mode="markers",
                             text=hover, marker=dict(size=4, color=COLORS["itl"])), row=3, col=1)
    fig.update_yaxes(type="log", row=3, col=1)

    row = 4
    if has_server:
        t, gauges, rates = server["times_s"], server["gauges"], server["counter_rates_per_s"]
        for key in ("running", "waiting"):
            if key in gauges:
                fig.add_trace(go.Scatter(x=t, y=gauges[key], name=key, line_color=COLORS[key]), row=row, col=1)
        if "kv_usage" in gauges:
            fig.add_trace(go.Scatter(x=t, y=[None if u is None else 100 * u for u in gauges["kv_usage"]],
                                     name="KV usage (%)", line_color=COLORS["kv_usage"]), row=row + 1, col=1)
        if "preemptions" in rates:
            fig.add_trace(go.Bar(x=t, y=rates["preemptions"], name="preemptions/s",
                                 width=server["interval_s"] / 2, marker_color=COLORS["preemptions"]),
                          row=row + 1, col=1, secondary_y=True)
        row += 2
    if gpus:
        t = gpu["times_s"]
        for g in gpus:
            tag = f"GPU {g['index']}" if len(gpus) > 1 else "GPU"
            reasons = [", ".join(r) if r else "" for r in (g["throttle"] or [])]
            fig.add_trace(go.Scatter(x=t, y=g["sm_util_pct"], name=f"{tag} SM util (%)",
                                     line_color=COLORS["sm_util"]), row=row, col=1)
            fig.add_trace(go.Scatter(x=t, y=g["power_w"], name=f"{tag} power (W)", line_color=COLORS["power"]),
                          row=row, col=1, secondary_y=True)
            fig.add_trace(go.Scatter(x=t, y=g["sm_clock_mhz"], name=f"{tag} SM clock (MHz)", text=reasons,
                                     hovertemplate="%{y:.0f} MHz %{text}", line_color=COLORS["sm_clock"]),
                          row=row + 1, col=1)
            fig.add_trace(go.Scatter(x=t, y=g["mem_used_gib"], name=f"{tag} memory (GiB)",
                                     line_color=COLORS["memory"]), row=row + 1, col=1, secondary_y=True)

    profiled = data.get("profile_window")
    if profiled:
        x0, x1 = profiled["window_s"]
        fig.add_vrect(x0=x0, x1=x1, fillcolor=COLORS["profile"], line_width=0, layer="below", row="all", col=1)
        fig.add_annotation(x=(x0 + x1) / 2, y=1.0, yref="paper", text=profiled["label"], showarrow=False,
                           font=dict(size=11, color="#b06000"), yanchor="bottom")
    fig.update_yaxes(showgrid=False, rangemode="tozero", secondary_y=True)
    fig.update_xaxes(title_text="seconds since the run's start", row=len(panels), col=1)
    fig.update_layout(height=230 * len(panels) + 80, margin=dict(l=60, r=60, t=60, b=50), hovermode="x unified",
                      legend=dict(orientation="h", y=-0.04 if len(panels) > 4 else -0.1), template="plotly_white",
                      bargap=0)
    return fig


def latency_data(results: list[RequestResult]) -> dict:
    """Every successful request's TTFT, TPOT and E2E latency, and every ITL gap, in milliseconds."""
    ok = [r for r in results if r.success]
    return {
        "ttft_ms": [r.ttft * 1000 for r in ok if r.ttft is not None],
        "tpot_ms": [r.tpot * 1000 for r in ok if r.tpot is not None],
        "itl_ms": [g * 1000 for r in ok for g in r.itl],
        "e2el_ms": [r.e2el * 1000 for r in ok if r.e2el is not None],
    }


def latency_figure(data: dict) -> go.Figure:
    """Per latency: its histogram (top) and its empirical CDF (bottom), with the p50 and p99 marked."""
    fig = make_subplots(rows=2, cols=4, subplot_titles=[f"{label} (ms)" for _, label in LATENCIES] * 2,
                        vertical_spacing=0.14)
    color = {"ttft_ms": COLORS["ttft"], "tpot_ms": COLORS["tpot"], "itl_ms": COLORS["itl"],
             "e2el_ms": COLORS["e2el"]}
    for col, (key, label) in enumerate(LATENCIES, start=1):
        values = np.sort(np.asarray(data.get(key) or [], dtype=np.float64))
        if values.size:  # binned here: a page carries 50 bars, not every ITL gap
            counts, edges = np.histogram(values, bins=HIST_BINS)
            fig.add_trace(go.Bar(x=(edges[:-1] + edges[1:]) / 2, y=counts, width=np.diff(edges), name=label,
                                 marker_color=color[key], showlegend=False), row=1, col=col)
            cdf = np.arange(1, values.size + 1) / values.size
            step = max(1, values.size // 2000)  # thousands of ITL gaps: a readable curve, a small file
            fig.add_trace(go.Scatter(x=values[::step], y=cdf[::step], name=label, line_color=color[key],
                                     showlegend=False), row=2, col=col)
            # p50's label to the left of its line and p99's to the right: however close the two lines, the
            # labels never overlap
            for q, side in ((50, "top left"), (99, "top right")):
                v = float(np.percentile(values, q))
                fig.add_vline(x=v, line_dash="dot", line_color="#555", row=2, col=col,
                              annotation_text=f"p{q} {v:.1f}", annotation_font_size=10,
                              annotation_position=side)
        fig.update_yaxes(title_text="requests" if key != "itl_ms" else "gaps", row=1, col=col)
        fig.update_yaxes(title_text="share", range=[0, 1.02], row=2, col=col)
    fig.update_layout(height=560, margin=dict(l=60, r=30, t=50, b=40), template="plotly_white")
    return fig
