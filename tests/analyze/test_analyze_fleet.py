"""Ranks analysed apart (worker processes, Ray tasks) and the columnar cache: the same report as in one process."""

from __future__ import annotations

import json
import os
import shutil

import pandas as pd
import pytest

from infertrace.analyze import build_report, kineto_split, load_capture
from infertrace.analyze.fleet import analyze_fleet


def assert_same_report(a, b):
    assert sorted(a.tables) == sorted(b.tables)
    assert a.skipped == b.skipped and a.problems == b.problems
    pd.testing.assert_frame_equal(a.ranks, b.ranks, check_dtype=False)
    for name in a.tables:
        pd.testing.assert_frame_equal(a.tables[name].reset_index(drop=True), b.tables[name].reset_index(drop=True),
                                      check_dtype=False, obj=name)


@pytest.fixture()
def two_rank(traces, tmp_path):
    for name in ("sampled_rank-0.json.gz", "sampled_rank-1.json.gz"):
        shutil.copy(traces / "hta-samples/two_rank_nccl" / name, tmp_path)
    return tmp_path


def test_ranks_in_worker_processes_give_the_one_process_report(two_rank):
    expected = build_report(load_capture(two_rank))
    got = analyze_fleet(two_rank, jobs=2)
    assert_same_report(got, expected)
    assert "2 rank(s) analysed apart in up to 2 process(es)" in got.run_notes


def test_second_run_reads_the_cache_and_a_changed_file_is_read_again(two_rank, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    first = analyze_fleet(two_rank, jobs=1, cache_dir=cache)
    assert "2 rank(s) analysed apart in up to 1 process(es); 0 from the cache" in first.run_notes
    second = analyze_fleet(two_rank, jobs=1, cache_dir=cache)
    assert "2 rank(s) analysed apart in up to 1 process(es); 2 from the cache" in second.run_notes
    assert_same_report(second, first)
    # a trace rewritten with other content (same size, same mtime) is read again: its ends are hashed
    path = two_rank / "sampled_rank-1.json.gz"
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[-9] ^= 0xFF  # the gzip trailer's CRC: the file now ends differently
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    third = analyze_fleet(two_rank, jobs=1, cache_dir=cache)
    assert "1 from the cache" in third.run_notes[-1]
    # a damaged cache entry is read again from the trace, not trusted
    for part in cache.rglob("part.json"):
        part.write_text("{")
    for info in cache.rglob("info.json"):
        info.write_text("{")
    fourth = analyze_fleet(two_rank, jobs=1, cache_dir=cache)
    assert "0 from the cache" in fourth.run_notes[-1]
    assert_same_report(fourth, third)


def _rank_file(path, traces, rank: int, copies: int):
    """A rank made of `copies` shifted copies of the vLLM B200 rank-0 trace (about 14 MB of JSON each)."""
    import gzip

    doc = json.loads(gzip.decompress((traces / "tracelens/vllm_tp8_b200_rank0/eager_trace.json.gz").read_bytes()))
    events = doc.pop("traceEvents")
    timed = [e for e in events if "ts" in e]
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - min(e["ts"] for e in timed) + 1000.0
    out = []
    for c in range(copies):
        for e in events:
            e = dict(e)
            if "ts" in e:
                e["ts"] = round(e["ts"] + c * span, 3)
            if isinstance(e.get("args"), dict) and "correlation" in e["args"]:
                e["args"] = {**e["args"], "correlation": e["args"]["correlation"] + c * 10**7}
            out.append(e)
    doc["distributedInfo"] = {"rank": rank, "world_size": 4}
    doc["traceEvents"] = out
    path.write_text(json.dumps(doc))


_MEASURE = """
import json, resource, sys
from infertrace.analyze.fleet import analyze_fleet
report = analyze_fleet(sys.argv[1], jobs=int(sys.argv[2]))
status = open("/proc/self/status").read()
own = int(status.split("VmHWM:")[1].split()[0]) / 1024
children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
print(json.dumps({"own_mb": own, "children_mb": children, "ranks": len(report.ranks)}))
"""


def test_peak_memory_is_about_one_ranks_whatever_the_ranks(traces, tmp_path, run_python):
    one, four = tmp_path / "one", tmp_path / "four"
    one.mkdir()
    four.mkdir()
    _rank_file(one / "rank0.json", traces, 0, 6)
    for rank in range(4):
        shutil.copy(one / "rank0.json", four / f"rank{rank}.json")
        text = (four / f"rank{rank}.json").read_text().replace('"rank": 0,', f'"rank": {rank},')
        (four / f"rank{rank}.json").write_text(text)
    alone = json.loads(run_python(["-c", _MEASURE, str(one), "1"], timeout=300).stdout)
    spread = json.loads(run_python(["-c", _MEASURE, str(four), "2"], timeout=300).stdout)
    assert alone["ranks"] == 1 and spread["ranks"] == 4
    # the combining process never holds a rank's events; each worker holds one rank's at a time
    assert spread["own_mb"] < alone["own_mb"]
    assert spread["children_mb"] < alone["own_mb"] * 1.25


ray = pytest.importorskip("ray", reason="Ray is the optional [distributed] extra")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ranks_as_ray_tasks_on_a_local_cluster(cluster, two_rank, tmp_path):
    from click.testing import CliRunner

    from infertrace.analyze.command import analyze

    expected = build_report(load_capture(two_rank))
    got = analyze_fleet(two_rank, ray_address="auto")
    assert_same_report(got, expected)
    assert "2 rank(s) analysed apart as Ray tasks on auto" in got.run_notes
    result = CliRunner().invoke(analyze, [str(two_rank), "--ray", "auto", "--no-cache", "--json",
                                          str(tmp_path / "r.json"), "--quiet"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "as Ray tasks" in result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["ranks"][1]["rank"] == 1


def test_read_ahead_starts_only_for_large_uncached_json_ranks(traces, two_rank, tmp_path_factory, monkeypatch):
    import gzip

    from infertrace.analyze import fleet

    monkeypatch.setattr(kineto_split, "SPLIT_MIN_BYTES", 0)
    one = tmp_path_factory.mktemp("one")
    (one / "rank0.json").write_bytes(
        gzip.decompress((traces / "tracelens/vllm_tp8_b200_rank0/eager_trace.json.gz").read_bytes()))
    expected = build_report(load_capture(one))
    assert fleet.read_ahead(two_rank, jobs=2) is None  # two ranks on two processes: one process a rank
    assert fleet.read_ahead(one, jobs=1) is None  # one process asked for
    assert fleet.read_ahead(one, jobs=2, ray_address="auto") is None
    ahead = fleet.read_ahead(one, jobs=2)
    (started,) = ahead.files.values()
    assert len(started.children) == 1
    joined = []
    real = kineto_split._take_ahead
    monkeypatch.setattr(kineto_split, "_take_ahead", lambda *a: joined.append(1) or real(*a))
    assert_same_report(analyze_fleet(one, jobs=2, ahead=ahead), expected)
    assert joined == [1] and not started.children  # the read-ahead was taken up by the analysis
    cache = tmp_path_factory.mktemp("cache")
    analyze_fleet(one, jobs=1, cache_dir=cache)
    assert fleet.read_ahead(one, jobs=2, cache_dir=cache) is None  # its events are cached: nothing to decode


def test_a_read_ahead_starts_no_more_processes_than_can_decode_while_this_one_imports(traces, tmp_path, monkeypatch):
    import gzip

    from infertrace.analyze import fleet

    # the rule as it stands: a 523 MB rank on 16 cores in six processes, the same as `--jobs 6` there
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert fleet._ahead_workers(fleet._split_workers(None), 523_000_000) == 6
    assert fleet._ahead_workers(fleet._split_workers(6), 523_000_000) == 6
    monkeypatch.setattr(kineto_split, "SPLIT_MIN_BYTES", 0)
    one = tmp_path / "one"
    one.mkdir()
    trace = one / "rank0.json"
    trace.write_bytes(gzip.decompress((traces / "tracelens/vllm_tp8_b200_rank0/eager_trace.json.gz").read_bytes()))
    # the file as if it took 1 s to decode and importing 0.25 s: 2 x 1 / 0.25 = 8 later stretches at most
    monkeypatch.setattr(fleet, "AHEAD_DECODE_BYTES_S", trace.stat().st_size)
    monkeypatch.setattr(fleet, "AHEAD_IMPORT_S", 0.25)
    monkeypatch.setattr(fleet, "AHEAD_MARGIN", 2)
    asked = []
    monkeypatch.setattr(fleet, "read_file_ahead", lambda path, keep_python, workers: asked.append(workers))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    for jobs in (None, 64, 9, 4):
        fleet.read_ahead(one, jobs=jobs, cache_dir=None)
    assert asked == [9, 9, 9, 4]
    monkeypatch.setattr(fleet, "AHEAD_DECODE_BYTES_S", trace.stat().st_size * 4)  # 0.25 s to decode: 2 stretches
    fleet.read_ahead(one, cache_dir=None)
    assert asked[-1] == 3


def _two_plain_ranks(traces, capture):
    """The TraceLens vLLM rank as two ranks' plain JSON files (large enough to split with SPLIT_MIN_BYTES at 0)."""
    import gzip

    doc = json.loads(gzip.decompress((traces / "tracelens/vllm_tp8_b200_rank0/eager_trace.json.gz").read_bytes()))
    capture.mkdir()
    for rank in (0, 1):
        doc["distributedInfo"]["rank"] = rank
        (capture / f"rank{rank}.json").write_text(json.dumps(doc))
    return capture


def test_ranks_take_up_the_read_aheads_started_before_their_workers(traces, tmp_path, monkeypatch):
    """Several ranks: each file's later stretches start decoding before the analysis modules are imported, forked
    from this process; each rank's worker (forked later) joins its own file's, and the report is the one-process
    report. The stretch processes end by themselves, having left their stretches."""

    from infertrace.analyze import fleet

    monkeypatch.setattr(kineto_split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(fleet, "PARALLEL_MIN_BYTES", 0)
    capture = _two_plain_ranks(traces, tmp_path / "capture")
    expected = build_report(load_capture(capture))
    monkeypatch.setattr(fleet, "AHEAD_IMPORT_S", 0.0)  # as many processes as the split gives, whatever the size
    ahead = fleet.read_ahead(capture, jobs=8)  # 2 ranks on 8 cores: 4 + 1 processes a file, 4 started here
    assert sorted(ahead.files) == [str(capture / "rank0.json"), str(capture / "rank1.json")]
    pids = [pid for started in ahead.files.values() for pid, *_ in started.children]
    assert len(pids) == 8
    marks = tmp_path / "taken"
    real = kineto_split._take_ahead

    def counted(path, keep_python, started):  # runs in the forked rank workers
        with open(marks, "a") as fh:
            fh.write(f"{path.name} {len(started.children)}\n")
        return real(path, keep_python, started)

    monkeypatch.setattr(kineto_split, "_take_ahead", counted)
    try:
        assert_same_report(analyze_fleet(capture, jobs=8, ahead=ahead), expected)
        assert sorted(marks.read_text().split("\n")[:-1]) == ["rank0.json 4", "rank1.json 4"]
        assert all(os.waitpid(pid, 0) == (pid, 0) for pid in pids)  # each had ended well, by itself
    finally:
        ahead.cancel()


def test_ranks_fewer_than_the_cores_each_decode_their_file_in_several_processes(traces, tmp_path, monkeypatch):
    """8 ranks on 16 cores: each rank's large JSON file is decoded in 2 processes (the cores shared out), and the
    report is the one-process report."""

    from infertrace.analyze import fleet

    assert [fleet._rank_split(j, units) for j, units in ((16, 8), (8, 2), (2, 8), (3, 1), (16, 32))] == [2, 4, 1, 3, 1]
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert fleet._rank_split(None, 8) == 2
    monkeypatch.setattr(kineto_split, "SPLIT_MIN_BYTES", 0)
    capture = _two_plain_ranks(traces, tmp_path / "capture")
    expected = build_report(load_capture(capture))
    marks = tmp_path / "splits"
    real = kineto_split._read_split

    def counted(path, keep_python, workers):  # runs in the forked rank workers: leaves a line per split read
        with open(marks, "a") as fh:
            fh.write(f"{path.name} {workers}\n")
        return real(path, keep_python, workers)

    monkeypatch.setattr(kineto_split, "_read_split", counted)
    got = analyze_fleet(capture, jobs=8)
    assert_same_report(got, expected)
    assert sorted(marks.read_text().split("\n")[:-1]) == ["rank0.json 4", "rank1.json 4"]
