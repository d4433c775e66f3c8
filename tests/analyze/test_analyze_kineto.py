"""The streaming Kineto reader: same events as a plain json.loads, nanosecond-exact times, damaged files."""

from __future__ import annotations

import decimal
import gzip
import json
import zlib

import numpy as np
import pytest

from infertrace.analyze import kineto, kineto_columns, kineto_split, kineto_stream
from infertrace.analyze.kineto import TraceError, read_kineto

SAMPLES = [
    "hta-samples/single_rank_ns/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",  # epoch us, 3 decimals
    "hta-samples/two_rank_nccl/sampled_rank-0.json.gz",  # integer us, compact JSON
    "tracelens/hf_eager_h100_qwen/Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",  # HTA's rounding breaks on it
    "tracelens/vllm_tp8_b200_rank0/eager_trace.json.gz",  # indent=4, metadata after the events
]


def reference(raw: bytes) -> list[dict]:
    """The kept events by a plain, exact reading: every number as a Decimal."""
    doc = json.loads(raw, parse_float=decimal.Decimal)
    return [e for e in doc["traceEvents"] if e.get("dur") is not None and e.get("ts") is not None
            and e.get("cat") not in ("python_function", "Trace")]


def assert_same(cols, events):
    assert len(cols) == len(events)
    ts = [int(decimal.Decimal(e["ts"]) * 1000) for e in events]
    dur = [int((decimal.Decimal(e["dur"]) * 1000).to_integral_value()) for e in events]
    assert cols.ts_ns.tolist() == ts
    assert cols.dur_ns.tolist() == dur
    names = np.array(cols.names, dtype=object)[cols.name]
    assert names.tolist() == [e.get("name", "") for e in events]
    assert cols.correlation.tolist() == [(e.get("args") or {}).get("correlation", -1) for e in events]
    assert cols.stream.tolist() == [(e.get("args") or {}).get("stream", -1) for e in events]


@pytest.mark.parametrize("typed", [True, False], ids=["msgspec", "dicts"])
@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.split("/")[1])
def test_reads_real_traces_exactly(traces, sample, typed):
    path = traces / sample
    cols = read_kineto(path, typed=typed)
    assert_same(cols, reference(gzip.decompress(path.read_bytes())))
    assert cols.exact_times and cols.problem is None


def test_epoch_timestamps_keep_their_nanoseconds(traces):
    # 1712195495519689.047 us is 1712195495519689.0 as a float64: the digits must come from the text
    cols = read_kineto(traces / SAMPLES[0])
    assert (cols.ts_ns % 1000 != 0).mean() > 0.9
    assert 1712195495519689047 in set(cols.ts_ns.tolist())


@pytest.mark.parametrize("typed", [True, False], ids=["msgspec", "dicts"])
def test_small_blocks_split_events_anywhere(traces, tmp_path, monkeypatch, typed):
    # with 4 KiB blocks every piece boundary falls somewhere new: inside strings, numbers and nested args
    monkeypatch.setattr(kineto_stream, "BLOCK", 4096)
    raw = gzip.decompress((traces / SAMPLES[3]).read_bytes())[:3_000_000]
    raw = raw[: raw.rindex(b"},") + 1] + b"]}"  # a well-formed prefix of the event array
    path = tmp_path / "prefix.json"
    path.write_bytes(raw)
    assert_same(read_kineto(path, typed=typed), reference(raw))


def test_tricky_json_layouts(tmp_path, monkeypatch):
    monkeypatch.setattr(kineto_stream, "BLOCK", 64)
    events = [
        {"ph": "X", "cat": "cpu_op", "name": 'a "},{" b \\"}, {', "pid": 1, "tid": 1, "ts": 5, "dur": 2,
         "args": {"nested": [{"x": 1}, {"y": [1, 2]}], "text": "]]]"}},
        {"ph": "i", "name": "instant", "pid": 1, "tid": 1, "ts": 6},
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 7.5, "dur": 0.001,
         "args": {"stream": 7, "correlation": 3}},
        {"ph": "X", "cat": "python_function", "name": "f", "pid": 1, "tid": 1, "ts": 8, "dur": 1},
    ]
    doc = {"deviceProperties": [{"name": "GPU-A"}, {"name": "GPU-B"}], "traceEvents": events,
           "distributedInfo": {"rank": 3, "pg_config": [{"ranks": [0, 1]}]}, "traceName": "x"}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    cols = read_kineto(path)
    assert cols.ts_ns.tolist() == [5000, 7500] and cols.dur_ns.tolist() == [2000, 1]
    assert [cols.names[i] for i in cols.name] == ['a "},{" b \\"}, {', "k"]
    assert cols.metadata["distributedInfo"]["rank"] == 3 and cols.metadata["traceName"] == "x"
    assert len(read_kineto(path, keep_python=True)) == 3


def test_bare_array_and_nan(tmp_path):
    path = tmp_path / "bare.json"
    path.write_text('[{"ph": "X", "name": "a", "cat": "cpu_op", "ts": 1, "dur": 2, "args": {"v": NaN}}]')
    cols = read_kineto(path)
    assert len(cols) == 1 and cols.metadata == {}


def test_truncated_gzip_keeps_the_events_before_the_cut(traces, tmp_path):
    data = (traces / SAMPLES[3]).read_bytes()
    path = tmp_path / "cut.json.gz"
    path.write_bytes(data[: len(data) // 2])
    cols = read_kineto(path)
    assert "truncated" in cols.problem and "kept the" in cols.problem
    full = reference(gzip.decompress((traces / SAMPLES[3]).read_bytes()))
    assert 0 < len(cols) < len(full)
    assert_same(cols, full[: len(cols)])


def test_truncated_json_text(tmp_path):
    doc = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "ts": i, "dur": 1, "pid": 1, "tid": 1}
                           for i in range(50)]}
    text = json.dumps(doc)
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) * 2 // 3])
    cols = read_kineto(path)
    assert "ends inside the traceEvents array" in cols.problem
    assert 20 < len(cols) < 50


@pytest.mark.parametrize("content, message", [
    (b"this is not json at all", "not a JSON trace"),
    (b'{"schema": "something else", "rows": [1, 2]}', "no \"traceEvents\" array"),
    (b"", "not a JSON trace"),
])
def test_unusable_files_raise_one_line(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(TraceError, match=message) as info:
        read_kineto(path)
    assert "\n" not in str(info.value)


def test_garbage_gzip(tmp_path):
    path = tmp_path / "bad.json.gz"
    path.write_bytes(b"\x1f\x8b" + b"\x00" * 50)
    with pytest.raises(TraceError):
        read_kineto(path)


@pytest.mark.parametrize("typed", [True, False], ids=["msgspec", "dicts"])
def test_odd_values_do_not_stop_the_reader(tmp_path, typed):
    events = [5, "x", None, {"ph": "X", "ts": "abc", "dur": 1, "name": "bad time"},
              {"ph": "X", "ts": 3, "dur": 1, "name": 7, "pid": [1], "tid": {"a": 1},
               "args": {"stream": "s", "correlation": "9"}},
              {"ph": "X", "ts": 4, "dur": 1, "name": "b", "pid": 3, "tid": "t", "args": {"correlation": [2]}}]
    path = tmp_path / "odd.json"
    path.write_text(json.dumps({"traceEvents": events}))
    cols = read_kineto(path, typed=typed)
    assert [cols.names[i] for i in cols.name] == ["7", "b"]
    assert cols.pid[1] == 3 and cols.pid[0] < 0 and cols.tid[0] != cols.tid[1]  # text ids get codes
    assert cols.correlation.tolist() == [9, -1] and cols.stream.tolist() == [-1, -1]


def test_an_event_larger_than_many_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(kineto_stream, "BLOCK", 256)
    big = {"ph": "X", "cat": "cpu_op", "name": "big", "ts": 1, "dur": 1, "args": {"blob": ["x" * 50] * 400}}
    small = {"ph": "X", "cat": "cpu_op", "name": "small", "ts": 2, "dur": 1}
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"traceEvents": [small, big, small, big, small]}))
    cols = read_kineto(path)
    assert [cols.names[i] for i in cols.name] == ["small", "big", "small", "big", "small"]


_READ_IN_CHILD = """
import json, re, sys
from infertrace.analyze import kineto_stream
from infertrace.analyze.kineto import TraceError, read_kineto
if len(sys.argv) > 2:
    kineto_stream.GZIP_RATIO_LIMIT = int(sys.argv[2])
try:
    cols = read_kineto(sys.argv[1])
    out = {"events": len(cols), "problem": cols.problem, "metadata": cols.metadata}
except TraceError as exc:
    out = {"error": str(exc)}
status = open("/proc/self/status").read()  # VmHWM: this process's peak (ru_maxrss counts the forking parent)
out["peak_mb"] = int(re.search(r"VmHWM:\\s*(\\d+)", status).group(1)) / 1024
print(json.dumps(out))
"""


@pytest.fixture()
def read_in_child(run_python):
    """Read a trace in a child process with a deadline: returns its events, problem and metadata, or its error,
    and the child's peak memory."""
    def read(path, timeout: float = 60.0, gzip_ratio_limit: int | None = None) -> dict:
        args = [] if gzip_ratio_limit is None else [str(gzip_ratio_limit)]
        done = run_python(["-c", _READ_IN_CHILD, str(path), *args], timeout)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)
    return read


EVENT = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1, "dur": 2}


@pytest.mark.parametrize("text", [
    '{"traceEvents": null}', '{"traceEvents": 5}', '{"traceEvents": "x"}', "5", '{"meta": {"traceEvents": [1]}}',
    '{"name": "traceEvents", "n": 1}',
])
def test_trace_events_that_are_not_a_top_level_array(tmp_path, read_in_child, text):
    path = tmp_path / "t.json"
    path.write_text(text)
    assert read_in_child(path)["error"] == 'not a Kineto trace (no "traceEvents" array)'


def test_nested_trace_events_keys_before_the_real_one(tmp_path, read_in_child):
    doc = ('{"meta": {"traceEvents": []}, "name": "traceEvents", "other": {"traceEvents": null}, '
           f'"traceEvents": [{json.dumps(EVENT)}], "after": 1}}')
    path = tmp_path / "t.json"
    path.write_text(doc)
    out = read_in_child(path)
    assert out["events"] == 1 and out["problem"] is None
    assert out["metadata"]["meta"] == {"traceEvents": []} and out["metadata"]["after"] == 1


BOMB_MB = 128  # of whitespace, about 130 KB gzipped


@pytest.mark.parametrize("before, after, expect", [
    ("", "", {"error": "not a JSON trace (the file is not valid JSON)"}),
    ("", '{"traceEvents": [EV]}', {"events": 1, "problem": None}),
    ('{"traceEvents": [', "EV]}", {"events": 1, "problem": None}),
    ('{"traceEvents": [EV,', "EV]}", {"events": 2, "problem": None}),
    ('{"pad": "', '", "traceEvents": [EV]}', {"error": 'no "traceEvents" array in the first 16 MB of JSON'}),
    ('{"traceEvents": [EV, {"name": "', '"}]}', {"events": 1,
                                                 "problem": "an event larger than 16 MB after 1 events; "
                                                            "kept the 1 complete events before it"}),
    ('{"traceEvents": [EV]', ', "x": 1}', {"events": 1}),
], ids=["only-whitespace", "before-object", "inside-array", "between-events", "metadata", "inside-event",
        "after-array"])
def test_gzip_bomb_of_whitespace_reads_in_bounded_memory(tmp_path, read_in_child, before, after, expect):
    ev = json.dumps(EVENT)
    packer = zlib.compressobj(1, zlib.DEFLATED, 31)  # wbits 31: a gzip stream
    block = b" " * (1 << 20)
    parts = [packer.compress(before.replace("EV", ev).encode())]
    parts += [packer.compress(block) for _ in range(BOMB_MB)]
    parts += [packer.compress(after.replace("EV", ev).encode()), packer.flush()]
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(b"".join(parts))
    out = read_in_child(path, gzip_ratio_limit=10**6)  # each state of the reader, past the gzip bound below
    assert {k: out.get(k) for k in expect} == expect
    assert out["peak_mb"] < 250  # the columns, one event's worth of buffer and the libraries; not the 128 MB


def _plain_trace(traces, path):
    import gzip

    path.write_bytes(gzip.decompress((traces / "tracelens/vllm_tp8_b200_rank0/eager_trace.json.gz").read_bytes()))
    return path


def _same_columns(a, b):
    for field in ("ts_ns", "dur_ns", "pid", "tid", "stream", "correlation", "external_id"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert [a.names[i] for i in a.name] == [b.names[i] for i in b.name]
    assert [a.cats[i] for i in a.cat] == [b.cats[i] for i in b.cat]
    assert (a.metadata, a.problem, a.exact_times) == (b.metadata, b.problem, b.exact_times)


def _count_stretches(monkeypatch) -> list[int]:
    """Records, per joined read, how many stretches it was decoded in (the first and each one joined to it)."""
    calls: list[int] = []
    real = kineto_split._joined

    def counted(head, start, first, rest):
        calls.append(1)

        def each():
            for part in rest:
                calls[-1] += 1
                yield part
        return real(head, start, first, each())

    monkeypatch.setattr(kineto_split, "_joined", counted)
    return calls


@pytest.mark.parametrize("workers", [2, 3])
def test_a_file_decoded_in_several_processes_equals_one_process(traces, tmp_path, monkeypatch, workers):
    path = _plain_trace(traces, tmp_path / "t.json")
    whole = read_kineto(path)
    monkeypatch.setattr(kineto_split, "SPLIT_MIN_BYTES", 0)
    calls = _count_stretches(monkeypatch)
    split = read_kineto(path, workers=workers)
    assert calls == [workers]  # it was split, not read in one process
    _same_columns(whole, split)


def test_a_cut_inside_an_event_falls_back_to_one_process(tmp_path, monkeypatch):
    # the middle of the file is inside one event's long list of objects, where "}, {" is no event boundary
    small = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 1, "tid": 1, "ts": i, "dur": 1} for i in range(50)]
    big = {"ph": "X", "cat": "cpu_op", "name": "big", "pid": 1, "tid": 1, "ts": 100, "dur": 1,
           "args": {"list": [{"a": i} for i in range(200_000)]}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": small + [big] + small}))
    monkeypatch.setattr(kineto_split, "SPLIT_MIN_BYTES", 0)
    calls = _count_stretches(monkeypatch)
    split = read_kineto(path, workers=2)
    assert calls == []  # the stretch before the false cut did not decode as whole events
    assert [split.names[i] for i in split.name] == [e["name"] for e in small + [big] + small]


def _wide_id_events(n: int) -> list[dict]:
    """Events whose ids fit int32 except: external ids in the first tenth, a tid in the middle, pids and a
    correlation in the last tenth (each stretch of a split read then holds some narrow and some wide)."""
    out = []
    for i in range(n):
        out.append({"ph": "X", "cat": "kernel" if i % 2 else "cpu_op", "name": f"k{i % 7}", "pid": 1, "tid": 5,
                    "ts": 1000 + i, "dur": 1, "args": {"correlation": i, "stream": 7, "External id": i}})
        if i < n // 10:
            out[-1]["args"]["External id"] = 2**35 + i
        if i == n // 2:
            out[-1]["tid"] = -(2**33)
        if i >= n - n // 10:
            out[-1]["pid"] = 2**40 + i
            out[-1]["args"]["correlation"] = 2**31 if i == n - 1 else i
    return out


@pytest.mark.parametrize("how", ["one", "split", "ahead"])
def test_ids_past_int32_widen_their_column_wherever_they_come(tmp_path, monkeypatch, how):
    monkeypatch.setattr(kineto_stream, "BLOCK", 4096)
    monkeypatch.setattr(kineto_split, "SPLIT_MIN_BYTES", 0)
    events = _wide_id_events(3000)
    path = tmp_path / "wide.json"
    path.write_text(json.dumps({"traceEvents": events}))
    calls = _count_stretches(monkeypatch)
    if how == "one":
        cols = read_kineto(path)
    elif how == "split":
        cols = read_kineto(path, workers=3)
    else:
        received = []
        real_taken = kineto_split._taken
        monkeypatch.setattr(kineto_split, "_taken", lambda fd, region: received.append(r := real_taken(fd, region)) or r)
        cols = read_kineto(path, ahead=kineto.read_ahead(path, workers=3))
        assert len(received) == 2 and all(r is not None for r in received)  # two stretches came from their processes
    assert calls == {"one": [], "split": [3], "ahead": [3]}[how]
    assert cols.pid.tolist() == [e["pid"] for e in events]
    assert cols.tid.tolist() == [e["tid"] for e in events]
    assert cols.correlation.tolist() == [e["args"]["correlation"] for e in events]
    assert cols.external_id.tolist() == [e["args"]["External id"] for e in events]
    assert cols.stream.dtype == np.int32 and cols.pid.dtype == np.int64  # only the columns that need it widen


def _mixed_events(n: int) -> list[dict]:
    """Kineto-like events with, from the middle on, a category no table knows, and one event without any."""
    known = ["cpu_op", "kernel", "python_function", "cuda_runtime", "ac2g", "Trace"]
    out = []
    for i in range(n):
        cat = known[i % len(known)] if i < n // 2 or i % 3 else "my_own_category"
        e = {"ph": "X", "cat": cat, "name": f"op{i % 13}", "pid": 1, "tid": i % 3, "ts": 1000.5 + i,
             "dur": 1 + i % 5, "args": {"correlation": i, "stream": 7, "External id": i // 2}}
        if i == n // 4:
            del e["cat"]
        out.append(e)
    return out


def test_tagged_decoding_learns_new_categories_and_equals_the_plain_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(kineto_stream, "BLOCK", 4096)
    raw = json.dumps({"traceEvents": _mixed_events(4000)}).encode()
    path = tmp_path / "mixed.json"
    path.write_bytes(raw)
    tagged = []
    real = kineto_columns._ColumnSink._from_tagged
    monkeypatch.setattr(kineto_columns._ColumnSink, "_from_tagged", lambda self, ev: tagged.append(len(ev)) or real(self, ev))
    cols = read_kineto(path)
    assert_same(cols, reference(raw))
    _same_columns(cols, read_kineto(path, typed=False))
    assert "my_own_category" in cols.cats and "" in cols.cats  # the event without a category is kept, as ""
    assert sum(tagged) > 3000  # most pieces went through the tagged decoder, those after the new category too


def _gone(pid: int) -> bool:
    import os

    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True  # reaped already
    return False


@pytest.mark.parametrize("workers", [2, 3])
def test_a_read_ahead_equals_one_process_and_leaves_no_process(traces, tmp_path, monkeypatch, workers):
    path = _plain_trace(traces, tmp_path / "t.json")
    whole = read_kineto(path)
    monkeypatch.setattr(kineto_split, "SPLIT_MIN_BYTES", 0)
    ahead = kineto.read_ahead(path, workers=workers)
    pids = [pid for pid, *_ in ahead.children]
    assert len(pids) == workers - 1
    received, joined = [], []
    real_taken, real_join = kineto_split._taken, kineto_split._join
    monkeypatch.setattr(kineto_split, "_taken", lambda fd, region: received.append(r := real_taken(fd, region)) or r)
    monkeypatch.setattr(kineto_split, "_join", lambda whole, part: joined.append(1) or real_join(whole, part))
    cols = read_kineto(path, ahead=ahead)
    assert len(received) == workers - 1 and all(r is not None for r in received)  # each child sent its stretch
    assert len(joined) == workers - 1
    _same_columns(whole, cols)
    assert not ahead.children and all(_gone(pid) for pid in pids)


def test_a_read_ahead_child_that_dies_is_decoded_here(traces, tmp_path, monkeypatch):
    import os

    path = _plain_trace(traces, tmp_path / "t.json")
    whole = read_kineto(path)
    monkeypatch.setattr(kineto_split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(kineto_split, "_put", lambda region, layout, fd, result: os._exit(3))  # dies before its word
    ahead = kineto.read_ahead(path, workers=2)
    decoded = []
    real_decode = kineto_split._decode_range
    monkeypatch.setattr(kineto_split, "_decode_range", lambda *a: decoded.append(a[1:3]) or real_decode(*a))
    _same_columns(whole, read_kineto(path, ahead=ahead))
    assert len(decoded) == 2 and decoded[1][1] == path.stat().st_size  # its own stretch, then the dead child's
    assert not ahead.children


def test_a_read_ahead_with_a_false_cut_is_read_whole_and_an_unread_one_is_cancelled(tmp_path, monkeypatch):
    small = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 1, "tid": 1, "ts": i, "dur": 1} for i in range(50)]
    big = {"ph": "X", "cat": "cpu_op", "name": "big", "pid": 1, "tid": 1, "ts": 100, "dur": 1,
           "args": {"list": [{"a": i} for i in range(200_000)]}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": small + [big] + small}))
    monkeypatch.setattr(kineto_split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(kineto_split, "AHEAD_IMPORT_S", 0.0)  # equal shares: the cut falls inside the big event
    ahead = kineto.read_ahead(path, workers=2)
    pids = [pid for pid, *_ in ahead.children]
    calls = _count_stretches(monkeypatch)
    cols = read_kineto(path, ahead=ahead)
    assert calls == []  # the first stretch did not end at its cut as whole events: read in one process
    assert [cols.names[i] for i in cols.name] == [e["name"] for e in small + [big] + small]
    assert all(_gone(pid) for pid in pids)
    other = tmp_path / "u.json"
    other.write_text(json.dumps({"traceEvents": small * 40}))
    unread = kineto.read_ahead(other, workers=3)
    pids = [pid for pid, *_ in unread.children]
    mismatched = kineto.read_ahead(other, workers=2)
    whole = read_kineto(path, ahead=mismatched)  # a read-ahead of another file is not joined, only ended
    assert [whole.names[i] for i in whole.name] == [e["name"] for e in small + [big] + small]
    assert not mismatched.children
    unread.cancel()  # what the owner does when the file was never read (its analysed part was cached)
    unread.cancel()  # twice is harmless
    assert not unread.children and all(_gone(pid) for pid in pids)


@pytest.mark.parametrize("how", ["no word", "bad exit"])
def test_a_read_ahead_child_that_does_not_end_well_is_decoded_here(traces, tmp_path, monkeypatch, how):
    """A stretch's process that fills its region but never says the stretch is whole (it ended first), or says so
    and then ends badly: its stretch is decoded here, nothing of the region taken."""
    import os

    path = _plain_trace(traces, tmp_path / "t.json")
    whole = read_kineto(path)
    monkeypatch.setattr(kineto_split, "SPLIT_MIN_BYTES", 0)
    real_put = kineto_split._put

    def put(region, layout, fd, result):
        if how == "no word":
            real_put(region, layout, os.open(os.devnull, os.O_WRONLY), result)  # the region whole, the word lost
            os._exit(0)
        real_put(region, layout, fd, result)
        os._exit(5)

    monkeypatch.setattr(kineto_split, "_put", put)
    ahead = kineto.read_ahead(path, workers=2)
    decoded, joined = [], []
    real_decode, real_join = kineto_split._decode_range, kineto_split._join
    monkeypatch.setattr(kineto_split, "_decode_range", lambda *a: decoded.append(a[1:3]) or real_decode(*a))
    monkeypatch.setattr(kineto_split, "_join", lambda w, part: joined.append("release" in part) or real_join(w, part))
    _same_columns(whole, read_kineto(path, ahead=ahead))
    assert len(decoded) == 2 and decoded[1][1] == path.stat().st_size  # its own stretch, then the child's
    assert joined == [False]  # the child's stretch joined as decoded here, not from its region


def test_decoding_a_stretch_leaves_the_collector_as_it_was(traces, tmp_path, monkeypatch):
    """A stretch decoded in this process (the first of a split read) switches the garbage collector off while it
    decodes and back on after: a process that goes on (a test run, a library caller) kept it off for good, and the
    CI run's pytest process grew to 3.1 GB resident."""
    import gc

    path = _plain_trace(traces, tmp_path / "t.json")
    monkeypatch.setattr(kineto_split, "SPLIT_MIN_BYTES", 0)
    start, end = kineto_split._plan_split(path, [1.0])[2][0][0], path.stat().st_size
    assert gc.isenabled()
    assert kineto_split._decode_range(str(path), start, end, True, False) is not None
    assert gc.isenabled()
    gc.disable()
    try:  # and a collector that was off stays off
        kineto_split._decode_range(str(path), start, end, True, False)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_stretch_goes_through_its_region_whole_and_one_too_small_is_refused(traces, tmp_path, monkeypatch):
    import mmap
    import os

    path = _plain_trace(traces, tmp_path / "t.json")
    monkeypatch.setattr(kineto_split, "SPLIT_MIN_BYTES", 0)
    start, end = kineto_split._plan_split(path, [1.0])[2][0][0], path.stat().st_size
    expected = [np.array(a) for a in kineto_split._decode_range(str(path), start, end, True, False)["sink"].arrays()]

    def through(layout):
        region = mmap.mmap(-1, layout.size)
        decoded = kineto_split._decode_range(str(path), start, end, True, False, (region, layout))
        if decoded is None:
            return None, region
        assert all(isinstance(f, kineto_columns._Slot) for f in decoded["sink"].fields)  # decoded into the region
        read_end, write_end = os.pipe()
        kineto_split._put(region, layout, write_end, decoded)
        os.close(write_end)
        return kineto_split._taken(read_end, region), region

    layout = kineto_columns._RegionLayout.for_stretch(end - start)
    part, region = through(layout)
    assert sum(a.size for a in expected) > 1000
    assert [a.dtype for a in part["arrays"]] == [a.dtype for a in expected]
    for a, b in zip(expected, part["arrays"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert part["trailer"].rstrip().endswith(b"}") and part["count"] > 0  # what follows the events array
    received = kineto_columns._ColumnSink(False)
    kineto_split._join(received, part)  # into an empty sink: the same columns, its codes its own
    for a, b in zip(expected, received.arrays(), strict=True):
        np.testing.assert_array_equal(a, b)
    del part
    region.close()  # no array over the region is left
    part, region = through(kineto_columns._RegionLayout(layout.room, 64))  # no room for the tables: refused
    assert part is None
    part, region = through(kineto_columns._RegionLayout(len(expected[0]) * 2, layout.tables_room))  # nor for the columns
    assert part is None


def test_a_read_ahead_process_ends_with_its_parent_however_the_parent_ends(traces, tmp_path, run_python):
    import time

    path = _plain_trace(traces, tmp_path / "t.json")
    script = f"""
import os, signal, time
from infertrace.analyze import kineto, kineto_split
kineto_split.SPLIT_MIN_BYTES = 0
real = kineto_split._decode_range
kineto_split._decode_range = lambda *a: time.sleep(60) or real(*a)  # the stretch's process is still at work
ahead = kineto.read_ahead({str(path)!r}, workers=3)
print(" ".join(str(pid) for pid, *_ in ahead.children), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs
"""
    done = run_python(["-c", script], timeout=60)
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2 and done.returncode == -9

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), "a stretch's process outlived its parent"
