"""A CPU-only capture (vLLM on a CPU, torch.profiler without CUDA): its step types show CPU operators per step, and
neither the page nor `analyze diff` shows GPU figures that are zero by construction."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from infertrace.analyze import analyze_path
from infertrace.analyze.html import html_report
from infertrace.cli import main
from infertrace.console import out_console

from .conftest import engine_trace_events, kineto_events, write_kineto


def cpu_capture(path, ops_per_decode: int):
    """Two DECODE steps, each with `ops_per_decode` CPU operators inside, and one operator outside them."""
    spec, t = [], 0
    for _ in range(2):
        spec.append(("user_annotation", "execute_context_0(0)_generation_2(2)", t, 100, 1, {}))
        spec += [("cpu_op", "aten::linear", t + 1 + 10 * i, 8, 1, {}) for i in range(ops_per_decode)]
        t += 200
    spec.append(("cpu_op", "aten::copy_", t + 50, 5, 1, {}))
    return write_kineto(path / "rank0.pt.trace.json", kineto_events(spec)).parent


def test_cpu_only_step_types_count_cpu_operators_not_gpu_shares(tmp_path):
    report = analyze_path(cpu_capture(tmp_path / "a", 6))
    (row,) = report.tables["phases"].to_dict("records")
    assert row["type"] == "DECODE" and row["cpu_ops_per_step"] == 6.0 and row["verdict"] == "no GPU work"
    assert not {"gpu_busy_share", "host_wait_share", "kernels_per_step"} & set(row)
    page = html_report(report)
    assert "GPU busy and host wait" not in page and "other idle" not in page
    assert "step time (ms) by step type" in page  # the step chart is still drawn


def test_a_gpu_capture_keeps_its_gpu_figures(tmp_path):
    report = analyze_path(write_kineto(tmp_path / "g" / "t.json", engine_trace_events(), rank=0))
    assert {"gpu_busy_share", "kernels_per_step"} <= set(report.tables["phases"].columns)
    assert "cpu_ops_per_step" not in report.tables["phases"].columns
    page = html_report(report)
    assert "GPU busy and host wait" in page and "other idle" in page


def test_diff_of_cpu_only_captures_compares_cpu_operators_per_step(tmp_path, monkeypatch):
    monkeypatch.setattr(out_console, "width", 200)
    before, after = cpu_capture(tmp_path / "a", 6), cpu_capture(tmp_path / "b", 3)
    result = CliRunner().invoke(main, ["analyze", "diff", str(before), str(after), "--json", str(tmp_path / "d.json")])
    assert result.exit_code == 0, result.output
    assert "CPU ops/step" in result.stdout and "kernels/step" not in result.stdout
    line = next(l for l in result.stdout.splitlines() if "DECODE" in l)
    assert "6.0 -> 3.0" in line and "-50.0%" in line
    (row,) = json.loads((tmp_path / "d.json").read_text())["tables"]["phases"]
    assert row["cpu_ops_per_step A"] == 6.0 and row["cpu_ops_per_step change"] == pytest.approx(-50.0)
