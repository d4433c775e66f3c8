"""The views of a run: plain progress lines off a terminal (on a scripted clock), and the rows the summary table
adds for failures, the prefix cache, reasoning and energy."""

import io

import pytest
from rich.console import Console

from infertrace.load.config import BenchConfig
from infertrace.load.observe.observer import Observed
from infertrace.load.observe.scrape import ScrapeSeries
from infertrace.load.observe.telemetry import GpuSeries, TelemetrySeries
from infertrace.load.records import RequestResult
from infertrace.load.results.metrics import compute_metrics
from infertrace.load.results.point import PointRecord
from infertrace.load.results.render import PlainProgress, progress_for, summary_table
from infertrace.load.results.result import point_result
from infertrace.load.stats import Stats


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _console():
    return Console(file=io.StringIO(), width=200, force_terminal=False)


def test_plain_progress_prints_a_line_per_phase_every_interval_and_at_the_end():
    console, clock = _console(), Clock()
    progress = PlainProgress(console, clock, every_s=10.0)
    progress.on_phase("measure", 5, None)
    for i, t in enumerate((1.0, 2.0, 11.0, 12.0, 13.0)):
        clock.t = t
        progress.on_result(RequestResult(i, 0.0, 0.0, 0.0, error="HTTP 500: x" if i == 1 else None))
    assert console.file.getvalue().splitlines() == [
        "measure: 5 requests", "measure: 3/5 done, 1 failed, 11.0 s", "measure: 5/5 done, 1 failed, 13.0 s"]


def test_a_terminal_gets_the_live_bar_and_anything_else_plain_lines():
    assert isinstance(progress_for(_console()), PlainProgress)
    assert not isinstance(progress_for(Console(file=io.StringIO(), force_terminal=True)), PlainProgress)


def _result(i, t0, ttft=0.1, ttfct=None, error=None):
    done = error is None
    return RequestResult(i, t0, t0, t0 + 1.0, ttft=ttft if done else None, ttfct=(ttfct or ttft) if done else None,
                         e2el=0.9 if done else None, itl=[0.01] * 9 if done else [], output_tokens=10 if done else None,
                         error=error)


def _record(results, cfg=None, observed=None):
    cfg = cfg or BenchConfig(base_url="http://127.0.0.1:8000")
    return PointRecord(config=cfg, results=results, warmup_results=[], metrics=compute_metrics(results),
                       token_checks={}, client_cpu=0.1, process_cpu=0.1, client_lag=Stats(), observed=observed)


def _text(record):
    console = Console(width=220, record=True, file=io.StringIO())
    console.print(summary_table(record))
    return console.export_text()


def test_the_first_message_of_each_kind_of_failure_is_shown_and_saved():
    results = [_result(0, 0.0), _result(1, 1.0, error="HTTP 404: The model `x` does not exist."),
               _result(2, 2.0, error="HTTP 404: another"), _result(3, 3.0, error="HTTP 400: max_tokens too large")]
    record = _record(results)
    text = _text(record)
    assert "HTTP 404: 2, HTTP 400: 1" in text
    assert "HTTP 404 (first)" in text and "The model `x` does not exist." in text and "another" not in text
    assert "max_tokens too large" in text
    assert point_result(record)["failure_examples"] == {"HTTP 404": "The model `x` does not exist.",
                                                        "HTTP 400": "max_tokens too large"}


def test_the_hit_rate_is_shown_for_random_prompts_with_what_they_imply():
    scrape = ScrapeSeries("http://x/metrics", 1.0)
    scrape.add(0.0, {}, {"prefix_cache_hits": 0, "prefix_cache_queries": 0})
    scrape.add(5.0, {}, {"prefix_cache_hits": 928, "prefix_cache_queries": 1000})
    record = _record([_result(i, float(i)) for i in range(4)], observed=Observed(origin=0.0, scrape=scrape))
    assert "server prefix-cache hit rate" in _text(record) and "92.8%  (the workload implies 0.0%)" in _text(record)
    doc = point_result(record)
    assert doc["server_prefix_cache_hit_rate"] == pytest.approx(0.928) and doc["implied_prefix_cache_hit_rate"] == 0
    assert len(doc["prefix_cache_warnings"]) == 1 and record.warnings[-1] == doc["prefix_cache_warnings"][0]


def test_ttfct_is_shown_only_when_reasoning_came_first_and_is_always_saved():
    plain = _record([_result(i, float(i)) for i in range(4)])
    assert "TTFCT" not in _text(plain) and point_result(plain)["median_ttfct_ms"] == pytest.approx(100.0)
    thinking = _record([_result(i, float(i), ttft=0.1, ttfct=0.5) for i in range(4)])
    assert "TTFCT, to the answer (ms)" in _text(thinking)
    assert point_result(thinking)["mean_ttfct_ms"] == pytest.approx(500.0)


def test_energy_per_output_token_in_the_table_and_the_result():
    gpu = GpuSeries(0, "H100", power_w=[700.0, 700.0], energy_j=[1000.0, 1400.0])
    observed = Observed(origin=0.0, telemetry=TelemetrySeries(times=[0.0, 4.0], gpus=[gpu]))
    record = _record([_result(i, float(i)) for i in range(4)], observed=observed)  # 40 output tokens
    assert "energy per output token (J/tok)" in _text(record) and "10.000" in _text(record)
    doc = point_result(record)
    assert doc["energy_joules"] == 400.0 and doc["energy_per_output_token_j"] == 10.0
    assert doc["energy_method"] == "NVML energy counter"
    remote = _record(record.results, BenchConfig(base_url="http://10.0.0.9:8000"), observed)
    assert remote.energy is None and point_result(remote)["energy_per_output_token_j"] is None


def test_a_concurrency_sweep_plot_has_whole_ticks_only():
    import dataclasses

    from infertrace.load.results.plot import sweep_figure

    results = [RequestResult(i, 0.1 * i, 0.1 * i, 0.1 * i + 0.5, ttft=0.05, itl=[0.01, 0.01],
                             output_tokens=3) for i in range(4)]
    base = BenchConfig(base_url="http://127.0.0.1:8000")
    records = [_record(results, dataclasses.replace(base, concurrency=c)) for c in (1, 2, 3)]
    fig = sweep_figure(records, "concurrency")
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
