"""`infertrace analyze`: tables, output files, damaged inputs explained in one line each, and exit codes."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from infertrace.analyze.command import analyze
from infertrace.console import err_console, out_console


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    # rich sizes its consoles once; a wide one keeps titles and kernel names on one line
    monkeypatch.setattr(out_console, "width", 200)
    monkeypatch.setattr(err_console, "width", 200)


def invoke(*args):
    return CliRunner().invoke(analyze, [str(a) for a in args], catch_exceptions=False)


def warnings_of(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("warning:")]


def test_tables(traces):
    result = invoke(traces / "hta-samples" / "two_rank_nccl")
    assert result.exit_code == 0, result.output
    for title in ("Temporal breakdown (HTA)", "GPU idle time by cause (HTA)", "GPU time by kernel type",
                  "Top kernels per rank", "Communication / computation overlap", "Kernel launches",
                  "GPU time by kernel category", "Inference phases by step type"):
        assert title in result.stdout
    assert "53.56%" in result.stdout and "11.81%" in result.stdout
    assert warnings_of(result) == []
    assert "note: the last ProfilerStep is left out of the HTA breakdowns, as HTA does" in result.stderr


def test_output_files(engine_trace, tmp_path):
    out = tmp_path / "out"
    result = invoke(engine_trace.parent, "--json", out / "r.json", "--csv", out / "csv", "--html", out / "r.html",
                    "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    doc = json.loads((out / "r.json").read_text())
    assert doc["schema"] == "infertrace.analyze/1" and doc["skipped"] == {}
    phases = {row["type"]: row for row in doc["tables"]["phases"]}
    assert phases["DECODE"]["verdict"] == "CPU-bound" and phases["PREFILL"]["verdict"] == "GPU-bound"
    assert sorted(p.name for p in (out / "csv").iterdir()) == sorted(
        f"{n}.csv" for n in ["ranks", "temporal", "idle", "kernel_types", "top_kernels", "overlap", "launches",
                             "categories", "steps", "phases", "phase_categories", "critical_path",
                             "critical_summary", "critical_segments"])
    html = (out / "r.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "<svg" in html and "CPU-bound" in html
    import re

    assert html.count("* plotly.js v") == 1  # the library inlined once, for the step timeline
    page = re.sub(r"<script[^>]*>.*?</script>", "", html, flags=re.S)
    for external in ("<script", "src=", "href=", "@import", "url("):
        assert external not in page  # nothing to fetch: the page opens offline
    assert "wrote" in result.stderr


def test_short_kernel_names_in_tables(traces):
    result = invoke(traces / "tracelens" / "hf_eager_h100_qwen")
    assert result.exit_code == 0
    assert "pytorch_flash::flash_fwd_kernel" in result.stdout and "elementwise_kernel<BinaryFunctor>" in result.stdout
    assert "at::native::" not in result.stdout


@pytest.mark.parametrize("sample, expect", [
    ("hta-samples/cpu_only", "no GPU kernels in the capture (a CPU-only trace)"),
    ("hta-samples/no_rank_info", "no GPU kernels in the capture (a CPU-only trace)"),
    ("tracelens/hf_eager_h100_qwen", "Temporal breakdown (HTA)"),
])
def test_hard_samples_run(traces, sample, expect):
    result = invoke(traces / sample)
    assert result.exit_code == 0, result.output
    assert expect in result.stdout


def test_truncated_gzip(traces, tmp_path):
    data = (traces / "tracelens/vllm_tp8_b200_rank0/eager_trace.json.gz").read_bytes()
    (tmp_path / "cut.json.gz").write_bytes(data[: len(data) * 9 // 10])
    result = invoke(tmp_path)
    assert result.exit_code == 0
    (line,) = warnings_of(result)
    assert line.startswith("warning: cut.json.gz: the compressed stream ends early (truncated file); kept the")
    assert "Top kernels" in result.stdout


def test_file_that_is_not_json_next_to_a_good_one(traces, tmp_path):
    shutil.copy(traces / "hta-samples/two_rank_nccl/sampled_rank-0.json.gz", tmp_path)
    (tmp_path / "broken.json").write_text("{not json")
    result = invoke(tmp_path)
    assert result.exit_code == 0
    assert "warning: broken.json: not a JSON trace (the file is not valid JSON); skipped" in warnings_of(result)
    assert "Temporal breakdown (HTA)" in result.stdout


def test_two_files_with_one_rank(traces, tmp_path):
    source = traces / "hta-samples/two_rank_nccl/sampled_rank-0.json.gz"
    shutil.copy(source, tmp_path / "a.json.gz")
    shutil.copy(source, tmp_path / "b.json.gz")
    result = invoke(tmp_path)
    assert result.exit_code == 0
    assert "warning: b.json.gz claims rank 0 like a.json.gz; both are analysed, this one as rank 1" in \
        warnings_of(result)


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "no trace files in"),
    (lambda p: (p / "only.json").write_text("garbage"), "no usable trace"),
])
def test_nothing_usable_exits_2(tmp_path, setup, message):
    setup(tmp_path)
    result = invoke(tmp_path)
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_missing_path_exits_2(tmp_path):
    result = invoke(tmp_path / "nope")
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_unwritable_output_exits_2(engine_trace, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = invoke(engine_trace, "--json", blocker / "r.json", "--quiet")
    assert result.exit_code == 2 and "cannot write" in result.output


def test_explicit_run_and_help():
    result = invoke("--help")
    assert result.exit_code == 0 and "Exit codes:" in result.output and "diff" in result.output
    assert "Exit codes:" in invoke("run", "--help").output


def test_diff(engine_trace, tmp_path, make_trace, make_events):
    slower = make_events([
        ("user_annotation", "step[DECODE bs=2]", 100, 600, 100, {}),
        ("cuda_runtime", "cudaLaunchKernel", 110, 5, 100, {"correlation": 1}),
        ("kernel", "gemv_kernel", 120, 500, 7, {"stream": 7, "correlation": 1}),
    ])
    after = make_trace(tmp_path / "after" / "t.json", slower, rank=0)
    before_json = tmp_path / "before.json"
    assert invoke(engine_trace.parent, "--json", before_json, "--quiet").exit_code == 0
    result = invoke("diff", before_json, after.parent, "--json", tmp_path / "d.json")
    assert result.exit_code == 0, result.output
    assert "Step types: A -> B" in result.stdout and "GPU time by kernel category: A -> B" in result.stdout
    doc = json.loads((tmp_path / "d.json").read_text())
    decode = next(r for r in doc["tables"]["phases"] if r["type"] == "DECODE")
    assert decode["step_mean (ms) A"] == pytest.approx(0.25) and decode["step_mean (ms) B"] == pytest.approx(0.6)
    assert decode["step_mean (ms) change"] == pytest.approx(140.0)
    gemm = next(r for r in doc["tables"]["categories"] if r["category"] == "GEMM")
    assert gemm["total (ms) A"] == pytest.approx(0.25) and gemm["total (ms) B"] == pytest.approx(0.5)
    prefill = next(r for r in doc["tables"]["phases"] if r["type"] == "PREFILL")
    assert prefill["steps A"] == 1 and prefill["steps B"] is None


def test_diff_of_missing_path_exits_2(engine_trace, tmp_path):
    result = invoke("diff", engine_trace.parent, tmp_path / "nope")
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_trace_events_that_never_open_an_array_beside_good_files(engine_trace, tmp_path, run_python):
    # each of these once sent the reader into an endless loop, hanging the whole run and `analyze diff`
    (engine_trace.parent / "null.json").write_text('{"traceEvents": null}')
    (engine_trace.parent / "nested.json").write_text('{"meta": {"traceEvents": []}}')
    done = run_python(["-m", "infertrace", "analyze", str(engine_trace.parent), "--quiet"])
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert 'warning: null.json: not a Kineto trace (no "traceEvents" array); skipped' in warnings
    assert 'warning: nested.json: not a Kineto trace (no "traceEvents" array); skipped' in warnings
    done = run_python(["-m", "infertrace", "analyze", "diff", str(engine_trace.parent), str(engine_trace.parent)])
    assert done.returncode == 0, done.stderr
    assert "Step types: A -> B" in done.stdout


def _edited(edit):
    def damage(text: str) -> str:
        doc = json.loads(text)
        edit(doc)
        return json.dumps(doc)
    return damage


@pytest.mark.parametrize("damage, words", [
    (lambda text: text[: len(text) // 2], "not a whole infertrace analyze report (invalid JSON"),
    (_edited(lambda doc: doc["tables"].update(phases=5)), "table 'phases' is not a list of rows"),
    (_edited(lambda doc: [row.pop("type") for row in doc["tables"]["phases"]]), "table 'phases' has no 'type'"),
    (_edited(lambda doc: doc.update(problems=5)), "'problems' is not a list"),
])
def test_diff_of_a_damaged_report_exits_2(engine_trace, tmp_path, damage, words):
    report = tmp_path / "r.json"
    assert invoke(engine_trace.parent, "--json", report, "--quiet").exit_code == 0
    report.write_text(damage(report.read_text()))
    result = invoke("diff", report, engine_trace.parent)
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {report}") and words in lines[0]


def test_own_outputs_in_the_trace_directory_are_never_read_as_traces(engine_trace, tmp_path):
    """A report written into the trace directory, under any name and at any depth, is ignored by the run that
    writes it and by every later run; only the traces are read."""
    trace_dir = engine_trace.parent
    outputs = ["--json", trace_dir / "report.json", "--csv", trace_dir / "tables", "--html", trace_dir / "page.json"]
    first = invoke(trace_dir, *outputs, "--quiet")
    assert first.exit_code == 0, first.output
    assert warnings_of(first) == []
    again = invoke(trace_dir, *outputs, "--quiet")  # the same outputs, now on disk
    assert again.exit_code == 0 and warnings_of(again) == [], again.output
    later = invoke(trace_dir, "--json", trace_dir / "newer" / "rank0.pt.trace.json", "--quiet")
    assert later.exit_code == 0 and warnings_of(later) == [], later.output
    plain = invoke(trace_dir, "--json", tmp_path / "elsewhere.json", "--quiet")  # no output inside: still ignored
    assert plain.exit_code == 0 and warnings_of(plain) == [] and "captures here" not in plain.stderr, plain.output
    doc = json.loads((tmp_path / "elsewhere.json").read_text())
    assert [row["rank"] for row in doc["ranks"]] == [0] and doc["problems"] == []


def test_a_report_given_as_the_trace_is_a_clear_error(engine_trace, tmp_path):
    report = tmp_path / "r.json"
    assert invoke(engine_trace.parent, "--json", report, "--quiet").exit_code == 0
    result = invoke(report)
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {report} is a report or manifest written by infertrace, not a " \
                                    "trace"


@pytest.mark.parametrize("text", ['{"traceEvents": []}', '{"traceEvents": [{"ph": "M", "name": "process_name"}]}'])
def test_a_folder_whose_traces_hold_no_event_exits_2(tmp_path, text):
    (tmp_path / "x.pt.trace.json").write_text(text)
    result = invoke(tmp_path, "--quiet")
    assert result.exit_code == 2
    assert "no events in" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_fifo_named_like_a_trace_is_passed_over(engine_trace, tmp_path, run_python):
    import os

    fifo = engine_trace.parent / "stuck.pt.trace.json"
    os.mkfifo(fifo)  # opening it for reading would block forever: no writer ever comes
    done = run_python(["-m", "infertrace", "analyze", str(engine_trace.parent), "--quiet"], timeout=60)
    assert done.returncode == 0, done.stderr
    assert "stuck" not in done.stderr
    done = run_python(["-m", "infertrace", "analyze", str(fifo), "--quiet"], timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {fifo} is not a regular file or a directory"


def test_impossible_durations_are_dropped_with_one_warning(tmp_path, make_events):
    events = make_events([
        ("kernel", "gemv_kernel", 10, 5, 7, {"stream": 7}),
        ("kernel", "gemv_kernel", 20, -3, 7, {"stream": 7}),
        ("kernel", "gemv_kernel", 30, float("nan"), 7, {"stream": 7}),
        ("kernel", "gemv_kernel", 40, float("inf"), 7, {"stream": 7}),
        ("kernel", "gemv_kernel", 50, 1e300, 7, {"stream": 7}),
        ("kernel", "gemv_kernel", float("nan"), 5, 7, {"stream": 7}),
        ("kernel", "gemv_kernel", 1e300, 5, 7, {"stream": 7}),
        ("kernel", "gemv_kernel", 60, 5, 7, {"stream": 7}),
    ])
    (tmp_path / "t.pt.trace.json").write_text(json.dumps({"traceEvents": events}))  # NaN and Infinity as Python writes them
    result = invoke(tmp_path, "--json", tmp_path / "r.json", "--quiet")
    assert result.exit_code == 0, result.output
    assert warnings_of(result) == [
        "warning: t.pt.trace.json: 6 event(s) with a negative, non-finite or impossible duration or timestamp "
        "(dur over 24 h, |ts| over 4e+15 us) dropped"]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["ranks"][0]["kernels"] == 2
    top = doc["tables"]["top_kernels"]
    assert [(row["count"], row["sum (us)"]) for row in top] == [(2, 10.0)]


def test_a_small_gzip_of_huge_names_is_read_in_bounded_time(tmp_path, run_python):
    import zlib

    # 50 events with 15 MB names in under 1 MB of gzip: once over 300 s classifying the names
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [packer.compress(b'{"traceEvents": [')]
    chunk = b"a" * (1 << 20)
    for i in range(50):
        parts.append(packer.compress(b'%s{"ph": "X", "cat": "kernel", "name": "' % (b"," if i else b"")))
        parts += [packer.compress(chunk) for _ in range(15)]
        parts.append(packer.compress(b'%d", "pid": 0, "tid": 7, "ts": %d, "dur": 5, "args": {"stream": 7}}'
                                     % (i, 10 * i)))
    parts += [packer.compress(b"]}"), packer.flush()]
    path = tmp_path / "names.pt.trace.json.gz"
    path.write_bytes(b"".join(parts))
    assert path.stat().st_size < 1 << 20
    done = run_python(["-m", "infertrace", "analyze", str(tmp_path), "--quiet"], timeout=60)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert any("decompresses to more than 64x its size" in w for w in warnings), warnings
    assert any("longer than 8,192 characters cut to that length" in w for w in warnings), warnings


def test_pandas_is_imported_without_pyarrow_which_stays_importable(engine_trace, tmp_path):
    # pandas 3 imports pyarrow where it is installed (about 55-96 MB more resident on a 523 MB rank); a stand-in
    # pyarrow that records each import and then fails, as an absent one would
    import os
    import subprocess
    import sys

    fake = tmp_path / "site" / "pyarrow"
    fake.mkdir(parents=True)
    marker = tmp_path / "pyarrow-imports.txt"
    (fake / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('imported\\n')\n"
                                      "raise ImportError('stand-in pyarrow')\n")
    script = ("import sys\nfrom infertrace.cli import main\n"
              f"main(['analyze', {str(engine_trace.parent)!r}, '--quiet', '--no-cache'], standalone_mode=False)\n"
              "print('pandas' in sys.modules, 'pyarrow' in sys.modules)\n"
              "try:\n    import pyarrow\nexcept ImportError as exc:\n    print(exc)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["True False", "stand-in pyarrow"]
    assert marker.read_text() == "imported\n"  # once: by the script after the analysis, never by pandas


def test_a_small_truncated_gzip_keeps_its_complete_events(tmp_path, make_trace, make_events):
    # under a megabyte decompressed: the whole readable part comes in the read that meets the cut
    path = make_trace(tmp_path / "t" / "rank0.pt.trace.json.gz",
                      make_events([("cpu_op", f"aten::op{i % 7}", 10 * i, 5, 1, {}) for i in range(2000)]))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 6 // 10])
    result = invoke(path.parent, "--no-cache")
    assert result.exit_code == 0, result.output
    (line,) = warnings_of(result)
    kept = int(line.split("kept the ")[1].split(" complete")[0].replace(",", ""))
    assert line.startswith("warning: rank0.pt.trace.json.gz: the compressed stream ends early (truncated file)")
    assert 1000 < kept < 2000


def test_concatenated_and_padded_gzip_members_are_read_whole(tmp_path, make_events):
    import gzip as gz

    events = make_events([("cpu_op", "aten::mm", 10 * i, 5, 1, {}) for i in range(300)])
    text = json.dumps({"schemaVersion": 1, "traceEvents": events}).encode()
    path = tmp_path / "t" / "rank0.pt.trace.json.gz"
    path.parent.mkdir()
    path.write_bytes(gz.compress(text[:5000]) + b"\0" * 8 + gz.compress(text[5000:]))
    result = invoke(path.parent, "--no-cache", "--json", tmp_path / "r.json")
    assert result.exit_code == 0 and warnings_of(result) == []
    assert json.loads((tmp_path / "r.json").read_text())["ranks"][0]["events"] == 300
