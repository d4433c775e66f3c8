"""The report's series: computed from the records, JSON-able, and drawn from exactly those dicts."""

import json

import numpy as np
import pandas as pd

from infertrace.analyze.timeline import phases_data, phases_figure
from infertrace.load.records import RequestResult
from infertrace.load.report.figures import (
    latency_data,
    latency_figure,
    output_throughput,
    timeline_data,
    timeline_figure,
)


def _r(i, t0, ttft, itl, chunk_tokens=None, output_tokens=None, error=None):
    return RequestResult(index=i, scheduled=t0, t0=t0, end=t0 + ttft + sum(itl), ttft=ttft,
                         e2el=ttft + sum(itl), itl=itl, chunk_tokens=chunk_tokens or [1] * (len(itl) + 1),
                         output_tokens=output_tokens if output_tokens is not None else len(itl) + 1, error=error)


def test_in_flight_and_per_second_throughput():
    results = [_r(0, 10.0, 0.5, [0.4, 0.4, 0.4]), _r(1, 10.2, 0.3, [1.0], chunk_tokens=[1, 3], output_tokens=4)]
    data = timeline_data(results, origin=10.0)
    assert data["in_flight"]["requests"] == [1, 2, 1, 0]  # two sends, then two completions
    # request 0: events at 0.5, 0.9, 1.3, 1.7 s; request 1: 1 token at 0.5 s, 3 tokens at 1.5 s
    assert data["throughput"] == {"t_s": [0.0, 1.0], "output_tok_s": [3.0, 5.0]}
    assert data["requests"]["index"] == [1, 0] and data["requests"]["ttft_ms"] == [300.0, 500.0]  # by completion
    assert data["server"] is None and data["gpu"] is None and data["profile_window"] is None
    json.dumps(data, allow_nan=False)


def test_unknown_chunk_tokens_spread_the_usage_count():
    r = _r(0, 0.0, 0.5, [1.0], chunk_tokens=[None, None], output_tokens=10)
    assert output_throughput([r], 0.0)["output_tok_s"] == [5.0, 5.0]


def test_timeline_panels_follow_the_data(run):
    full = timeline_data(run["results"], run["origin"], run["scrape"], run["telemetry"], run["profile_window"])
    assert full["profile_window"]["window_s"] == [30.0, 40.0]  # no trace span given: start to stop
    json.dumps(full, allow_nan=False)
    fig = timeline_figure(full)
    titles = [a.text for a in fig.layout.annotations]
    assert "server: running and waiting requests" in titles and "GPU: SM clock (MHz) and memory used (GiB)" in titles
    assert any(s.type == "rect" and s.x0 == 30.0 and s.x1 == 40.0 for s in fig.layout.shapes)
    bare = timeline_figure(timeline_data(run["results"], run["origin"]))
    assert not any(a.text.startswith(("server", "GPU")) for a in bare.layout.annotations)
    assert not bare.layout.shapes


def test_the_band_lasts_the_trace_span_from_the_start_call(run):
    # --profile-steps: the server stopped by itself after 2.5 s of trace; bench's stop call came at 40 s
    data = timeline_data(run["results"], run["origin"], profile_window=run["profile_window"], trace_span_s=2.5)
    assert data["profile_window"] == {"window_s": [30.0, 32.5], "calls_s": [30.0, 40.0], "trace_span_s": 2.5,
                                      "label": "profiled window (2.50 s traced, from the start call)"}
    fig = timeline_figure(data)
    assert any(s.type == "rect" and s.x0 == 30.0 and s.x1 == 32.5 for s in fig.layout.shapes)
    assert any(a.text == data["profile_window"]["label"] for a in fig.layout.annotations)
    # a span longer than start to stop (clocks that disagree) is cut at the stop call, and says so
    long = timeline_data(run["results"], run["origin"], profile_window=run["profile_window"], trace_span_s=12.0)
    assert long["profile_window"]["window_s"] == [30.0, 40.0] and "cut at the stop call" in \
        long["profile_window"]["label"]
    unknown = timeline_data(run["results"], run["origin"], profile_window=run["profile_window"])
    assert unknown["profile_window"]["label"] == "profiler start to stop (the trace's span is unknown)"
    assert any(a.text == unknown["profile_window"]["label"] for a in timeline_figure(unknown).layout.annotations)


def test_latency_data_and_figure(run):
    data = latency_data(run["results"] + [_r(99, 0.0, 0.1, [0.1], error="boom")])
    assert len(data["ttft_ms"]) == len(run["results"])  # the failed request is left out
    assert len(data["itl_ms"]) == sum(len(r.itl) for r in run["results"])
    fig = latency_figure(data)
    bars = [t for t in fig.data if t.type == "bar"]
    assert len(bars) == 4 and all(sum(b.y) == len(data[k]) for b, k in
                                   zip(bars, ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")))
    # the CDF never carries more than ~2000 points, even over every ITL gap
    assert all(len(t.x) <= 4000 for t in fig.data if t.type == "scatter")


def test_the_cdf_s_p50_and_p99_labels_never_overlap():
    # p50 and p99 a hair apart (and equal): each label stands on its own side of its line
    fig = latency_figure({"ttft_ms": [10.0, 10.1, 10.2, 10.3], "tpot_ms": [2.0] * 5, "itl_ms": [1.0],
                          "e2el_ms": [5.0, 5.01]})
    labels = [a for a in fig.layout.annotations if a.text[:3] in ("p50", "p99")]
    assert len(labels) == 8
    for p50, p99 in zip(labels[::2], labels[1::2]):
        assert p50.text.startswith("p50") and p99.text.startswith("p99") and p50.x <= p99.x
        assert (p50.xanchor, p99.xanchor) == ("right", "left")


def test_phases_from_the_per_step_table():
    steps = pd.DataFrame({"type": ["PREFILL", "DECODE", "DECODE"], "ts_ns": np.array([1_000_000, 3_000_000,
                                                                                         5_000_000]),
                          "step_ms": [2.0, 1.5, 1.4], "busy_ms": [1.8, 1.0, 1.3], "host_wait_ms": [0.1, 0.4, np.nan]})
    data = phases_data(steps)
    assert data["start_ms"] == [0.0, 2.0, 4.0] and data["host_wait_ms"] == [0.1, 0.4, None]
    json.dumps(data, allow_nan=False)
    fig = phases_figure(data)
    assert {t.name for t in fig.data} == {"PREFILL", "DECODE", "GPU busy", "host wait"}
    assert phases_data(steps.iloc[:0])["step_ms"] == []
