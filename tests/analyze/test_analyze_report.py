"""Reports: each analysis runs on its own, and a report survives a JSON round trip."""

from __future__ import annotations

from html import escape

import pandas as pd
import pytest

from infertrace.analyze import analyze_path, hta_bridge
from infertrace.analyze.persist import is_report_file, read_json, write_json
from infertrace.analyze.report import AnalyzeConfig


def test_cpu_only_trace_runs_what_it_can(traces, tmp_path, make_trace, make_events):
    report = analyze_path(traces / "hta-samples" / "cpu_only")
    # its one ProfilerStep is still timed, and its CPU operators take the place of the GPU tables
    assert set(report.tables) == {"steps", "phases", "cpu_ops", "cpu_steps"}
    assert report.tables["phases"]["verdict"].tolist() == ["no GPU work"]
    assert report.skipped["temporal"] == "no GPU kernels in the capture (a CPU-only trace)"
    assert report.skipped["phase_categories"] == "no GPU kernels in the capture (a CPU-only trace)"
    plain = make_trace(tmp_path / "t.json", make_events([("cpu_op", "aten::mm", 10, 5, 1, {})]))
    no_steps = analyze_path(plain)
    assert no_steps.skipped["phases"].startswith("no step annotations") and set(no_steps.tables) == {"cpu_ops"}


def test_one_failing_analysis_leaves_the_others(engine_trace, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("HTA exploded\nwith a second line")

    monkeypatch.setattr(hta_bridge, "idle_time_breakdown", broken)
    report = analyze_path(engine_trace)
    assert report.skipped == {"idle": "failed: RuntimeError: HTA exploded"}
    assert {"temporal", "phases", "top_kernels"} <= set(report.tables)


def test_json_round_trip(engine_trace, tmp_path):
    report = analyze_path(engine_trace, AnalyzeConfig(top_kernels=2))
    path = write_json(report, tmp_path / "r.json")
    assert is_report_file(path) and not is_report_file(engine_trace)
    back = read_json(path)
    assert back.source == report.source and back.skipped == report.skipped
    for name, table in report.tables.items():
        pd.testing.assert_frame_equal(back.tables[name], table.reset_index(drop=True), check_dtype=False,
                                      obj=name)
    assert (back.tables["top_kernels"]["name"] == "others").any()


def test_config_is_validated():
    with pytest.raises(ValueError, match="top_kernels"):
        AnalyzeConfig(top_kernels=0)
    with pytest.raises(ValueError, match="duration_ratio"):
        AnalyzeConfig(duration_ratio=1.5)


def test_without_htas_classifier_the_rest_still_runs(engine_trace, monkeypatch):
    from infertrace.analyze import breakdown

    def no_hta(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'psutil'")

    monkeypatch.setattr(breakdown, "add_classes", no_hta)
    report = analyze_path(engine_trace)
    assert report.skipped["temporal"] == "failed: ModuleNotFoundError: No module named 'psutil'"
    assert {"idle", "launches", "categories", "steps", "phases", "phase_categories"} <= set(report.tables)


def test_html_report_of_a_real_trace_draws_in_chromium(traces, tmp_path, browse):
    """analyze --html: the per-step timeline (the run report's figure) draws, shares read as percentages."""
    from click.testing import CliRunner

    from infertrace.cli import main

    page = tmp_path / "sglang.html"
    result = CliRunner().invoke(main, ["analyze", str(traces / "tracelens" / "sglang_prefill_decode_mi300x"),
                                       "--html", str(page), "--quiet"])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert text.count("<script>") >= 1 and 'id="steps"' in text and "src=\"http" not in text
    assert "%</td>" in text
    # the phases table's headers are the terminal's; a GPU capture has no CPU-operator column
    from infertrace.analyze.render import LABELS

    gpu_columns = [label for key, label in LABELS["phases"].items() if key != "cpu_ops_per_step"]
    assert all(f">{escape(label)}</th>" in text for label in gpu_columns)
    assert f">{escape(LABELS['phases']['cpu_ops_per_step'])}</th>" not in text
    probe, done = browse(page)
    assert probe["errors"] == [] and probe["svgs"] >= 1
    assert "Uncaught" not in done.stderr
