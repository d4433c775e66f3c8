"""The shared consoles: off a terminal (a CI log, a pipe) tables keep their natural width instead of 80 columns."""

from __future__ import annotations

import io
import json

from click.testing import CliRunner

from infertrace.analyze.command import analyze
from infertrace.console import WIDE_OFF_TERMINAL, _Console, err_console, out_console

LONG_KERNEL = "triton_poi_fused__to_copy_add_cat_clone_mean_mul_pow_rsqrt_slice_scatter_split_with_sizes_view_0"


def test_off_a_terminal_the_width_is_columns_or_wide():
    assert _Console(file=io.StringIO(), _environ={}).width == WIDE_OFF_TERMINAL
    assert _Console(file=io.StringIO(), _environ={"COLUMNS": "120"}).width == 120
    assert _Console(file=io.StringIO(), width=90, _environ={}).width == 90
    assert _Console(file=io.StringIO(), force_terminal=True, width=70, _environ={}).width == 70


def _trace(path):
    def event(cat, name, ts, dur, tid, args):
        return {"ph": "X", "cat": cat, "name": name, "pid": 0 if cat == "kernel" else 100, "tid": tid, "ts": ts,
                "dur": dur, "args": args}

    events = [event("user_annotation", "step[DECODE bs=8]", 1000, 400, 100, {})]
    for i in range(3):
        events.append(event("cuda_runtime", "cudaLaunchKernel", 1010 + 100 * i, 5, 100, {"correlation": i}))
        events.append(event("kernel", LONG_KERNEL, 1050 + 100 * i, 40, 7, {"stream": 7, "correlation": i}))
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    return path


def test_analyze_tables_in_a_ci_log_are_not_cut(tmp_path, monkeypatch):
    # CliRunner's output is not a terminal, as in CI; the consoles take COLUMNS at import, so an exported
    # COLUMNS in the test's own environment is set aside here
    monkeypatch.setattr(out_console, "_width", None)
    monkeypatch.setattr(err_console, "_width", None)
    result = CliRunner().invoke(analyze, [str(_trace(tmp_path / "a_rather_long_trace_file_name.pt.trace.json"))],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "…" not in result.stdout
    assert LONG_KERNEL in result.stdout
    assert "a_rather_long_trace_file_name.pt.trace.json" in result.stdout
    for header in ("kernel span (ms)", "non-compute", "kernels/step", "host wait", "mean (us)", "total (ms)"):
        assert header in result.stdout
    lines = result.stdout.splitlines()
    assert any(LONG_KERNEL in line and "triton" in line for line in lines)  # on one line, not folded


def test_an_error_keeps_the_brackets_the_user_gave(capsys):
    import pytest

    from infertrace.console import fail

    with pytest.raises(SystemExit) as exited:
        fail("no such file: runs/[bold]/run.json")
    assert exited.value.code == 2
    assert "runs/[bold]/run.json" in capsys.readouterr().err
