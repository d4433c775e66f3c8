"""`bench --report` over a run whose profiled window's traces are on this host: the band the trace covers, the
phases in analyze's format and the window's findings, the same in the console's table, the JSON and the page."""

from types import SimpleNamespace

import pytest

from infertrace.load.observe.observer import Observed, run_findings
from infertrace.load.records import RequestResult
from infertrace.load.report import render_html
from infertrace.load.report.figures import timeline_figure
from infertrace.load.report.run import run_report_document

ORIGIN = 5000.0


def _record(trace_files, report="run.html"):
    results = [RequestResult(index=i, scheduled=ORIGIN + i, t0=ORIGIN + i, end=ORIGIN + i + 1.0, ttft=0.1,
                             e2el=1.0, itl=[0.1] * 9, chunk_tokens=[1] * 10, output_tokens=10) for i in range(50)]
    # --profile-steps: the server stopped capturing long before bench's stop call at 40 s
    observed = Observed(origin=ORIGIN, profile_window=(ORIGIN + 30.0, ORIGIN + 40.0))
    return SimpleNamespace(results=results, observed=observed, profile={"trace_files": trace_files},
                           client_cpu=0.1, client_lag=SimpleNamespace(p99=0.5),
                           config=SimpleNamespace(report=report))


@pytest.fixture
def traced(tmp_path, profiled_trace):
    span = profiled_trace(tmp_path / "trace" / "infertrace.1.pt.trace.json")
    return _record([str(tmp_path / "trace" / "infertrace.1.pt.trace.json")]), span


def _band(doc):
    [band] = {(s.x0, s.x1) for s in timeline_figure(doc["timeline"]).layout.shapes if s.type == "rect"}
    return band  # one band, drawn across every panel


def test_the_band_is_the_span_the_trace_covers(traced):
    record, span = traced
    doc = run_report_document(record, {"completed": 50})
    assert _band(doc) == (30.0, pytest.approx(30.0 + span))  # not the 10 s from the start call to the stop call
    window = doc["timeline"]["profile_window"]
    assert window["calls_s"] == [30.0, 40.0] and window["trace_span_s"] == pytest.approx(span)
    assert "2.00 s traced" in window["label"]


def test_without_local_traces_the_band_is_start_to_stop_and_says_so():
    doc = run_report_document(_record(["/elsewhere/host-b/infertrace.1.pt.trace.json"]), {})
    assert _band(doc) == (30.0, 40.0)
    assert doc["timeline"]["profile_window"]["label"] == "profiler start to stop (the trace's span is unknown)"
    assert any("not on this host" in n for n in doc["notes"])


def test_cpu_bound_steps_are_found_the_same_everywhere(traced):
    record, _ = traced
    doc = run_report_document(record, {})
    [finding] = [f for f in doc["findings"] if f["rule"] == "cpu_bound"]
    assert finding["what"].startswith("DECODE steps were CPU-bound") and finding["when_s"] == 30.0
    assert [f.to_json() for f in run_findings(record)] == doc["findings"]  # the console's table and the JSON
    html = render_html(doc)
    assert finding["what"] in html and ">GPU busy</th>" in html and "gpu_busy_share" not in html


def test_the_window_is_analysed_once(traced, monkeypatch):
    record, _ = traced
    import infertrace.analyze.report as analyze_report

    calls = []
    build = analyze_report.build_report
    monkeypatch.setattr(analyze_report, "build_report", lambda *a, **k: calls.append(1) or build(*a, **k))
    run_findings(record)
    run_report_document(record, {})
    assert len(calls) == 1


def test_the_page_draws_in_headless_chromium(traced, tmp_path, browse):
    record, _ = traced
    path = tmp_path / "run.html"
    path.write_text(render_html(run_report_document(record, {"completed": 50})))
    result, done = browse(path)
    assert result["errors"] == [] and result["svgs"] >= 3  # timeline, each step, latency
    assert "profiled window (2.00 s traced, from the start call)" in done.stdout
    assert "DECODE steps were CPU-bound" in done.stdout and ">host wait</th>" in done.stdout
