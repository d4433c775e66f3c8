"""bench beside the server: /metrics scraped on the run's clock, GPU telemetry noted where absent, and the HTML run
report of the same run."""

from __future__ import annotations

import json
from types import SimpleNamespace

from click.testing import CliRunner

from infertrace.cli import main
from infertrace.load.observe.observer import Observed, ProfiledWindow, profiled_window, run_findings


def bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def test_server_metrics_are_scraped_into_the_result_and_the_report(standin, prompts_jsonl, tmp_path):
    standin.serve_metrics = True
    standin.token_delay = 0.01
    out, report = tmp_path / "r.json", tmp_path / "run.html"
    res = bench("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl, "--num-prompts", 24,
                "--concurrency", 4, "--warmup", 0, "--scrape-interval", 0.05, "--result-json", out, "--report", report)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    series = doc["server_metrics"]
    assert series["server"] == "vllm" and len(series["times_s"]) >= 3
    assert max(v for v in series["gauges"]["running"] if v is not None) >= 1  # requests seen in flight
    assert series["deltas"]["generation_tokens"] == doc["total_output_tokens"]  # the server's count over the run
    assert doc["gpu_telemetry"]["notes"]  # no NVML here: one note, not an error
    assert isinstance(doc["findings"], list)
    page = report.read_text()
    assert page.startswith("<!DOCTYPE html>") and 'id="timeline"' in page and "Plotly" in page


def test_a_server_without_metrics_gets_one_note(standin, prompts_jsonl, tmp_path):
    out = tmp_path / "r.json"
    res = bench("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl, "--num-prompts", 4,
                "--concurrency", 2, "--warmup", 0, "--result-json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    notes = [n for n in doc["notes"] if "/metrics" in n]
    assert len(notes) == 1 and "404" in notes[0]
    assert doc["server_metrics"]["times_s"] == []
    assert sum(1 for path, *_ in standin.calls if path == "/metrics") == 1  # not asked again


def test_scraping_off_and_bad_intervals(standin, prompts_jsonl, tmp_path):
    standin.serve_metrics = True
    out = tmp_path / "r.json"
    res = bench("--base-url", standin.url, "--dataset", "jsonl", "--dataset-path", prompts_jsonl, "--num-prompts", 4,
                "--concurrency", 2, "--warmup", 0, "--scrape-interval", 0, "--result-json", out)
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["server_metrics"] is None
    assert not any(path == "/metrics" for path, *_ in standin.calls)
    for bad in ("-1", "nan", "inf"):
        res = bench("--base-url", standin.url, "--scrape-interval", bad)
        assert res.exit_code == 2 and "scrape_interval must be 0 (off) or a positive number" in res.output


def test_report_refuses_sweeps_and_unwritable_paths(standin, tmp_path):
    res = bench("--base-url", standin.url, "--sweep", "concurrency=1,2", "--report", tmp_path / "r.html")
    assert res.exit_code == 2 and "--report explains one run" in res.output
    res = bench("--base-url", standin.url, "--report", "/proc/nope/r.html")
    assert res.exit_code == 2 and "--report" in res.output and not standin.streams


def test_embedded_run_report(tmp_path):
    report = tmp_path / "embedded.html"
    res = bench("--num-prompts", 4, "--concurrency", 2, "--warmup", 0, "--output-len", 4, "--input-len", 8,
                "--report", report)
    assert res.exit_code == 0, res.output
    assert 'id="latency"' in report.read_text()


def test_random_without_a_tokenizer_sends_token_ids_and_counts_input_from_usage(standin, tmp_path):
    import numpy as np

    from infertrace.load.client.http_target import HttpTarget
    from infertrace.load.workloads.dataset import TOKEN_ID_RANGE, random_id_specs

    specs = random_id_specs(np.random.default_rng(0), 3, 12, 3, 0.0)
    body = HttpTarget(standin.url, "completions", "m", transport=None).body(specs[0])
    assert isinstance(body["prompt"], list) and len(body["prompt"]) == 12
    assert all(TOKEN_ID_RANGE[0] <= i < TOKEN_ID_RANGE[1] for s in specs for i in s.prompt_ids)
    out = tmp_path / "r.json"
    res = bench("--base-url", standin.url, "--input-len", 12, "--output-len", 3, "--num-prompts", 5,
                "--concurrency", 2, "--warmup", 0, "--result-json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["completed"] == 5 and doc["input_len_source"] == "usage"
    assert doc["total_input_tokens"] == 5 * 5  # the stand-in reports 5 prompt tokens a request
    res = bench("--base-url", standin.url, "--endpoint", "chat", "--num-prompts", 2, "--warmup", 0)
    assert res.exit_code == 2 and "only /v1/completions takes" in res.output


def _profiled_record(trace_files, report):
    observed = Observed(origin=100.0, profile_window=(130.0, 140.0))
    return SimpleNamespace(results=[], observed=observed, profile={"trace_files": trace_files}, client_cpu=None,
                           client_lag=SimpleNamespace(p99=None), config=SimpleNamespace(report=report))


def test_findings_analyse_the_profiled_window_only_for_a_report(tmp_path, monkeypatch):
    from infertrace.analyze import capture

    trace = tmp_path / "a.pt.trace.json"
    trace.write_text('{"traceEvents": []}')
    loads = []
    monkeypatch.setattr(capture, "load_capture", lambda path, *a, **k: loads.append(path) or 1 / 0)
    record = _profiled_record([str(trace)], report=None)
    assert run_findings(record) == [] and loads == []  # --result-json alone: the traces are left alone
    assert record.observed.profiled is None
    json.dumps(record.observed.to_json())


def test_a_profiled_window_not_on_this_host_is_a_note_not_an_analysis():
    record = _profiled_record(["/p/a.pt.trace.json.gz"], report="run.html")
    window = profiled_window(record)
    assert window.phases is None and window.trace_span_s is None and "not on this host" in window.note
    assert profiled_window(_profiled_record([], report="run.html")) is None


def test_the_result_json_carries_the_reports_profiled_window():
    """The result JSON's profile_window is the report's band: start to stop while the trace's span is unknown, the
    start call plus the span once the traces were read."""
    observed = Observed(origin=100.0, profile_window=(130.0, 140.0))
    unknown = observed.to_json()["profile_window"]
    assert unknown["window_s"] == [30.0, 40.0] and unknown["calls_s"] == [30.0, 40.0]
    assert unknown["trace_span_s"] is None and "span is unknown" in unknown["label"]
    observed.profiled = ProfiledWindow(trace_span_s=2.5)
    known = observed.to_json()["profile_window"]
    assert known["window_s"] == [30.0, 32.5] and known["calls_s"] == [30.0, 40.0] and known["trace_span_s"] == 2.5
    assert Observed(origin=100.0).to_json()["profile_window"] is None
