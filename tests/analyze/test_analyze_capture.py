"""Finding trace files, giving each a rank, and reporting what could not be used."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest

from infertrace.analyze.capture import (
    CaptureError,
    claimed_rank,
    load_capture,
    trace_files,
)


def _one_event(ts=1.0):
    return [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": ts, "dur": 2.0}]


def test_ranks_from_distributed_info(traces):
    capture = load_capture(traces / "hta-samples" / "two_rank_nccl")
    assert [r.rank for r in capture.ranks] == [0, 1]
    assert [r.path.name for r in capture.ranks] == ["sampled_rank-0.json.gz", "sampled_rank-1.json.gz"]
    assert capture.problems == []
    # one origin for the capture: every rank's ts counts from the capture's first event
    assert min(r.events["ts"].min() for r in capture.ranks) == 0.0


@pytest.mark.parametrize("name, rank", [
    ("myhost-rank-3.1712.pt.trace.json.gz", 3),  # vLLM: worker_name "<instance>-rank-<r>"
    ("1712345678.123-TP-5.trace.json.gz", 5),  # SGLang
    ("1712345678.123-TP-2-DP-1.trace.json.gz", 2),
    ("rank_7.json", 7),
    ("worker.pt.trace.json", None),
    ("cranky-1.json", None),
])
def test_rank_from_file_name(tmp_path, name, rank):
    assert claimed_rank(tmp_path / name, {}) == rank
    assert claimed_rank(tmp_path / name, {"distributedInfo": {"rank": 11}}) == 11


def test_two_files_with_the_same_rank_are_both_kept(tmp_path, make_trace):
    make_trace(tmp_path / "a.json", _one_event(), rank=0)
    make_trace(tmp_path / "b.json", _one_event(5), rank=0)
    capture = load_capture(tmp_path)
    assert [(r.rank, r.path.name, r.claimed_rank) for r in capture.ranks] == [(0, "a.json", 0), (1, "b.json", 0)]
    assert capture.problems == ["b.json claims rank 0 like a.json; both are analysed, this one as rank 1"]


def test_file_without_rank_does_not_replace_rank_0(traces, tmp_path):
    shutil.copy(traces / "hta-samples/two_rank_nccl/sampled_rank-0.json.gz", tmp_path)
    shutil.copy(traces / "hta-samples/no_rank_info/rank_not_found.json.gz", tmp_path)
    capture = load_capture(tmp_path)
    assert {r.path.name: r.rank for r in capture.ranks} == {"sampled_rank-0.json.gz": 0,
                                                            "rank_not_found.json.gz": 1}
    assert any("names no rank" in p and "as rank 1" in p for p in capture.problems)


def test_single_file_without_rank_is_rank_0_silently(traces):
    capture = load_capture(traces / "hta-samples" / "no_rank_info")
    assert [r.rank for r in capture.ranks] == [0] and capture.problems == []


def test_unusable_files_are_reported_and_skipped(traces, tmp_path):
    shutil.copy(traces / "hta-samples/two_rank_nccl/sampled_rank-1.json.gz", tmp_path)
    (tmp_path / "notes.json").write_text("not json")
    (tmp_path / "memory.pickle").write_bytes(b"\x80")  # not a trace name: ignored
    (tmp_path / "infertrace.1.manifest.json").write_text('{"label": "x"}')  # a capture manifest: ignored
    capture = load_capture(tmp_path)
    assert [r.path.name for r in capture.ranks] == ["sampled_rank-1.json.gz"]
    assert capture.problems == ["notes.json: not a JSON trace (the file is not valid JSON); skipped"]


def test_nothing_usable_raises(tmp_path):
    with pytest.raises(CaptureError, match="no trace files in"):
        load_capture(tmp_path)
    with pytest.raises(CaptureError, match="does not exist"):
        load_capture(tmp_path / "missing")
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(CaptureError, match="no usable trace.*x.json"):
        load_capture(tmp_path)


def test_sqlite_beside_its_report_is_read_once(tmp_path):
    (tmp_path / "run.nsys-rep").write_bytes(b"")
    (tmp_path / "run.sqlite").write_bytes(b"")
    (tmp_path / "other.nsys-rep").write_bytes(b"")
    assert [p.name for p in trace_files(tmp_path)] == ["other.nsys-rep", "run.sqlite"]


def test_nsys_report_without_nsys_says_how_to_convert(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    (tmp_path / "run.nsys-rep").write_bytes(b"\x00" * 16)
    with pytest.raises(CaptureError, match="nsys is not on PATH.*nsys export --type sqlite"):
        load_capture(tmp_path)


def test_ranks_read_in_parallel_give_the_same_capture(traces, tmp_path, monkeypatch):
    from infertrace.analyze import capture as capture_module

    for name in ("sampled_rank-0.json.gz", "sampled_rank-1.json.gz"):
        shutil.copy(traces / "hta-samples/two_rank_nccl" / name, tmp_path)
    (tmp_path / "broken.json").write_text("[{")
    serial = load_capture(tmp_path)
    monkeypatch.setattr(capture_module, "PARALLEL_MIN_BYTES", 0)
    parallel = load_capture(tmp_path)
    assert parallel.problems == serial.problems and len(parallel.problems) == 1
    for a, b in zip(serial.ranks, parallel.ranks):
        pd.testing.assert_frame_equal(a.events, b.events)
