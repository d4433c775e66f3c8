"""The report's "Where the tail's time went": the p50 and p99 TTFT cohorts side by side, part by part, and the
slowest requests each as a bar of their parts with the steps they rode; from the requests joined to the server's
request log (load/results/join.py, tail.py)."""

from __future__ import annotations

from collections.abc import Callable
from html import escape

import plotly.graph_objects as go

from infertrace.load.records import RequestResult
from infertrace.load.results import response_metrics
from infertrace.load.results.tail import PART_LABELS, cohorts, slowest

PART_COLORS = {"network_and_frontend": "#8c8c8c", "tokenize": "#bcbd22", "queue": "#d62728",
               "prefill_steps": "#1f77b4", "between_prefill_waits": "#9467bd", "first_token_send": "#2ca02c",
               "scheduled_to_first_token": "#1f77b4", "network_and_api_server": "#8c8c8c",
               "frontend_and_handoff": "#bcbd22", "prefill_and_first_token_send": "#1f77b4"}
MAX_STEPS_SHOWN = 12  # steps listed per slow request (its TTFT's steps; a long chunked prefill has more)


def requests_data(results: list[RequestResult], join_summary: dict | None) -> dict | None:
    """JSON-able: the join's figures, the two cohorts, and the slowest requests with their parts and steps."""
    if not join_summary:
        return None
    slow = []
    for r in slowest(results):
        s = r.server
        slow.append({"request_id": r.request_id, "index": r.index, "ttft_ms": r.ttft * 1e3,
                     "parts_ms": s["ttft_parts"], "waiting_ahead": s.get("waiting_ahead"),
                     "queue_behind": s.get("queue_behind"), "preempted_at_steps": s.get("preempted_at_steps"),
                     "steps": s.get("ttft_steps") or []})
    keys = ("source", "requests", "matched", "explained", "offset_ms", "offset_error_ms", "offset_consistent")
    return {"join": {k: join_summary.get(k) for k in keys}, "cohorts": cohorts(results), "slowest": slow}


def cohorts_figure(data: dict) -> go.Figure:
    """One horizontal bar per cohort, stacked by part (ms)."""
    names = [n for n in ("p50", "p99") if n in data["cohorts"]]
    labels = [f"{n} ({data['cohorts'][n]['requests']} req)" for n in names]
    fig = go.Figure()
    for part in _parts(data):
        values = [data["cohorts"][n]["parts_ms"][part] for n in names]
        shares = [data["cohorts"][n]["shares"][part] or 0.0 for n in names]
        fig.add_bar(y=labels, x=values, name=PART_LABELS[part], orientation="h", marker_color=PART_COLORS[part],
                    customdata=shares, hovertemplate="%{x:.2f} ms (%{customdata:.0%} of TTFT)<extra>%{fullData.name}"
                                                     "</extra>")
    fig.update_layout(barmode="stack", height=220, margin=dict(l=10, r=10, t=30, b=40),
                      xaxis_title="mean TTFT part (ms)", legend=dict(orientation="h", y=1.25))
    return fig


def slowest_figure(data: dict) -> go.Figure:
    """The slowest requests, slowest on top, each a bar of its parts; hover lists the steps it rode."""
    rows = list(reversed(data["slowest"]))
    labels = [f"#{r['index']} {r['request_id']}" for r in rows]
    steps = [_steps_text(r) for r in rows]
    fig = go.Figure()
    for part in _parts(data):
        fig.add_bar(y=labels, x=[r["parts_ms"][part] for r in rows], name=PART_LABELS[part], orientation="h",
                    marker_color=PART_COLORS[part], customdata=steps, showlegend=True,
                    hovertemplate="%{x:.2f} ms<br>%{customdata}<extra>%{fullData.name}</extra>")
    fig.update_layout(barmode="stack", height=120 + 22 * len(rows), margin=dict(l=10, r=10, t=30, b=40),
                      xaxis_title="TTFT part (ms)", legend=dict(orientation="h", y=1.02, yanchor="bottom"))
    return fig


def _parts(data: dict) -> tuple[str, ...]:
    """The parts the join split TTFT into (infertrace serve's log or vLLM's per-request metrics)."""
    return tuple(next(iter(data["cohorts"].values()))["parts_ms"]) if data["cohorts"] else ()


def _steps_text(r: dict) -> str:
    shown = [_step_text(s) for s in r["steps"][:MAX_STEPS_SHOWN]]
    more = len(r["steps"]) - len(shown)
    return "<br>".join(shown + ([f"... {more} more"] if more > 0 else []))


def _step_text(s: dict) -> str:
    kind = (s.get("kind") or "?").upper()
    own = f"{s['tokens']} {'prefill' if s['prefill'] else 'decode'} tok"
    if "step_ms" not in s:
        return f"step #{s['step']}: {own}"
    return (f"step #{s['step']} {kind} bs={s['batch_size']} {s['step_tokens']} tok, {s['step_ms']:.1f} ms: {own}"
            + (f", beside {s['others_prefill_tokens']} prefill tok of others" if s["others_prefill_tokens"] else ""))


def requests_html(data: dict, figure_html: Callable[[go.Figure, str], str]) -> str:
    """The section: the join in a line, the two figures, and the slowest requests' steps as a table."""
    j = data["join"]
    offset = ("clocks joined with an offset of "
              f"{j['offset_ms']:.3f} ms ± {j['offset_error_ms']:.3f} ms" if j.get("offset_ms") is not None
              else "no clock offset could be measured")
    vllm = j.get("source") == response_metrics.SOURCE
    where = {response_metrics.SOURCE: "vLLM's per-request metrics in each response",
             "vllm_otlp": "the server's OTLP spans", "vllm": "vLLM's spans in --peer-log",
             "sglang": "SGLang's log in --peer-log"}.get(j.get("source"), "the server's request log")
    parts = ", ".join(PART_LABELS[p] for p in _parts(data)) if data["cohorts"] else ""
    head = (f"<h2>Where the tail's time went</h2><p class='note'>{j['explained']} of {j['requests']} requests "
            f"explained from {where} ({j['matched']} matched{'' if vllm else ' by request id'})"
            + ("" if vllm else f"; {offset}" + ("" if j.get("offset_consistent", True)
                                                   else " (the bounds crossed: clocks drifted)"))
            + (f". TTFT parts: {parts}.</p>" if parts else ".</p>"))
    if not data["cohorts"]:
        return head
    rows = "".join(
        f"<tr><td>#{r['index']} {escape(str(r['request_id']))}</td><td class='n'>{r['ttft_ms']:.1f}</td>"
        f"<td class='n'>{r['parts_ms']['queue']:.1f}</td>"
        f"<td class='n'>{(r.get('queue_behind') or {}).get('prefill_rows', '-')}</td>"
        f"<td>{escape(_steps_text(r).replace('<br>', '; '))}</td></tr>" for r in data["slowest"])
    table = ("<table class='slowest'><tr><th>request</th><th class='n'>TTFT (ms)</th><th class='n'>queue (ms)</th>"
             f"<th class='n'>prefills waited behind</th><th>steps it rode to its first token</th></tr>{rows}</table>")
    return (head + "<h3>p50 and p99 cohorts</h3>" + figure_html(cohorts_figure(data), "ttft-cohorts")
            + f"<h3>The {len(data['slowest'])} slowest requests</h3>"
            + figure_html(slowest_figure(data), "ttft-slowest") + table)
