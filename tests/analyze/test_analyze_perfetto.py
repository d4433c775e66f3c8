"""`analyze --perfetto`: the capture in Chrome trace format with steps, phases and the critical path as tracks."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from infertrace.analyze import load_capture
from infertrace.analyze.command import analyze
from infertrace.analyze.perfetto import OURS_PID, RANK_PID
from infertrace.analyze.phases import find_steps, gpu_ops_by_step


def _export(trace_dir, out):
    result = CliRunner().invoke(analyze, [str(trace_dir), "--perfetto", str(out), "--quiet"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def _check_format(doc: dict) -> list[dict]:
    assert set(doc) == {"displayTimeUnit", "traceEvents"}
    events = doc["traceEvents"]
    for e in events:
        assert e["ph"] in ("X", "M") and isinstance(e["name"], str)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0
        else:
            assert e["name"] in ("process_name", "thread_name") and isinstance(e["args"]["name"], str)
    return events


def test_every_event_and_the_step_tracks(engine_trace, tmp_path):
    events = _check_format(_export(engine_trace.parent, tmp_path / "p.json"))
    capture = load_capture(engine_trace.parent)
    rank = capture.ranks[0].events
    ours = [e for e in events if e["ph"] == "X" and e.get("cat") == "infertrace"]
    theirs = [e for e in events if e["ph"] == "X" and e.get("cat") != "infertrace"]
    assert len(theirs) == len(rank)  # every complete event, as read
    assert all(e["pid"] < RANK_PID for e in theirs)  # rank 0 keeps its pids
    steps = [e for e in ours if e["pid"] == OURS_PID and e["tid"] == 1]
    found = find_steps(rank)
    assert [e["name"] for e in steps] == [f"{t} step" for t in found["type"]]
    # every step's slice spans the GPU work the step launched, to the nanosecond
    gpu, step_of = gpu_ops_by_step(rank, found)
    start_ns = gpu["ts_ns"].to_numpy()
    end_ns = start_ns + gpu["dur_ns"].to_numpy()
    for k, e in enumerate(steps):
        lo = round(e["ts"] * 1000)
        hi = lo + round(e["dur"] * 1000)
        mine = step_of == k
        assert mine.any()
        assert lo <= start_ns[mine].min() and end_ns[mine].max() <= hi
    phases = [e["name"] for e in ours if e["pid"] == OURS_PID and e["tid"] == 2]
    assert phases == ["PREFILL", "DECODE", "MIXED"]  # runs of steps of one type
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"infertrace, rank 0", "steps", "phases", "infertrace critical path"} <= names


def test_two_ranks_and_the_critical_path(tmp_path, make_trace, make_events):
    from tests.analyze.test_analyze_critical import AR, GEMM, NORM, _rank

    make_trace(tmp_path / "in" / "rank0.json", _rank(make_events, [(GEMM, 10, 100), (AR, 110, 20), (GEMM, 130, 50),
                                                                   (AR, 180, 10), (NORM, 190, 10)]), rank=0)
    make_trace(tmp_path / "in" / "rank1.json", _rank(make_events, [(GEMM, 10, 115), (AR, 125, 5), (GEMM, 130, 40),
                                                                   (AR, 170, 20), (NORM, 190, 10)]), rank=1)
    events = _check_format(_export(tmp_path / "in", tmp_path / "p.json"))
    rank1 = [e for e in events if e["ph"] == "X" and RANK_PID <= e["pid"] < 2 * RANK_PID]
    assert len(rank1) == 11  # the step, five launches, five kernels
    critical = [e for e in events if e["ph"] == "X" and e["pid"] == OURS_PID + 10**6]
    step = [e for e in critical if e["tid"] == 1]
    assert [e["name"] for e in step] == ["step 0: gated by rank 1"]
    assert step[0]["args"]["what-if saved (ms)"] == 0.0075
    path = [(e["name"].split(":")[0], e["ts"], e["dur"]) for e in critical if e["tid"] == 2]
    assert path == [("rank 1", 0.0, 125.0), ("rank 0", 130.0, 50.0), ("rank 0", 190.0, 10.0)]
    assert np.isclose(sum(d for *_, d in path), 185.0)


def test_a_high_rank_keeps_its_pids_apart(tmp_path):
    """A rank's pids are offset by rank * RANK_PID; the reader holds pids as int32 where they fit, and the offset
    pids of rank 21 and up do not fit int32: they must neither wrap nor raise."""
    import gzip

    from infertrace.analyze.kineto import read_kineto
    from infertrace.analyze.perfetto import _events

    trace = tmp_path / "rank.json.gz"
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 99_999_999, "tid": 7, "ts": 1.0, "dur": 2.0,
         "args": {"stream": 7, "correlation": 1}}]}).encode()))
    cols = read_kineto(trace)
    assert cols.pid.dtype == np.int32
    for rank in (21, 30):
        doc = json.loads("[" + ",\n".join(_events(rank, cols)) + "]")
        assert {e["pid"] for e in doc} == {rank * RANK_PID + 99_999_999}
