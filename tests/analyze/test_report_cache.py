"""The finished report cached: a second `analyze` of unchanged traces prints the same report (and writes the same
--json) without reading a trace or importing pandas or numpy; a changed, added or removed file, another option or a
damaged entry makes the report again."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

FROM_CACHE = "the report from the cache"
SCRIPT = """
import sys
from infertrace.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("IMPORTED", "pandas" in sys.modules, "numpy" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


@pytest.fixture()
def capture(traces, tmp_path):
    target = tmp_path / "capture"
    shutil.copytree(traces / "hta-samples/two_rank_nccl", target)
    return target


def analyze(run_python, *args):
    done = run_python(["-c", SCRIPT, "analyze", *map(str, args)], timeout=180)
    assert done.returncode == 0, done.stderr
    return done


def test_a_second_run_prints_the_report_without_a_trace_read_or_pandas_imported(capture, tmp_path, run_python):
    first = analyze(run_python, capture, "--json", tmp_path / "first.json")
    second = analyze(run_python, capture, "--json", tmp_path / "second.json")
    assert FROM_CACHE not in first.stderr and "IMPORTED True True" in first.stderr
    assert FROM_CACHE in second.stderr and "IMPORTED False False" in second.stderr
    assert second.stdout == first.stdout and "Critical path" in second.stdout
    assert json.loads((tmp_path / "second.json").read_text()) == json.loads((tmp_path / "first.json").read_text())


def test_a_changed_added_or_removed_file_or_another_option_makes_the_report_again(capture, tmp_path, run_python):
    analyze(run_python, capture)
    assert FROM_CACHE in analyze(run_python, capture).stderr
    rank1 = next(capture.glob("*rank-1*"))
    data = rank1.read_bytes()
    rank1.write_bytes(data)  # the same bytes, written again: a new modification time
    os.utime(rank1, ns=(1, 1))
    assert FROM_CACHE not in analyze(run_python, capture).stderr
    assert FROM_CACHE not in analyze(run_python, capture, "--top", "3").stderr
    assert FROM_CACHE in analyze(run_python, capture, "--top", "3").stderr
    (capture / "capture.request_log.json").write_text(json.dumps({"requests": []}))  # a log beside the capture
    assert FROM_CACHE not in analyze(run_python, capture).stderr
    rank1.unlink()
    alone = analyze(run_python, capture)
    assert FROM_CACHE not in alone.stderr and "rank-1" not in alone.stdout


def test_a_damaged_entry_is_made_again_and_other_outputs_read_the_traces(capture, tmp_path, run_python):
    first = analyze(run_python, capture)
    entries = list(Path(os.environ["INFERTRACE_CACHE_DIR"]).glob("**/report-*.json"))  # this test's own cache
    assert len(entries) == 1
    entries[0].write_text(entries[0].read_text()[:100])  # cut short
    again = analyze(run_python, capture)
    assert FROM_CACHE not in again.stderr and again.stdout == first.stdout
    assert FROM_CACHE in analyze(run_python, capture).stderr
    # --csv, --html and --perfetto need the report's tables as the analysis makes them: those runs read the traces
    with_csv = analyze(run_python, capture, "--csv", tmp_path / "csv")
    assert FROM_CACHE not in with_csv.stderr and "IMPORTED True True" in with_csv.stderr
    assert (tmp_path / "csv" / "ranks.csv").is_file()
