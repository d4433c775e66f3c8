"""Captures and ranks told apart by the peers' own file names (vLLM 0.33.0, SGLang 0.5.23) and by directory."""

from __future__ import annotations

import os

import pytest

from infertrace.analyze.catalog import Role, catalog, classify, select


def touch(path, mtime=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"{}")
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


@pytest.mark.parametrize("name, capture, role, rank, stage", [
    ("run1_dp0_pp0_tp1_dcp0_ep0_rank1.1732390000123.pt.trace.json.gz", "run1", Role.RANK, 1, None),
    ("dp0_pp0_tp0_dcp0_ep0_rank0.1732390000123.pt.trace.json.gz", "", Role.RANK, 0, None),
    ("run1_gpu-host-7_4242.async_llm.1732390000456.pt.trace.json.gz", "run1", Role.FRONTEND, None, None),
    ("gpuhost_4242.async_llm.1732390000456.pt.trace.json.gz", "", Role.FRONTEND, None, None),
    ("1732390000.5-TP-3.trace.json.gz", "1732390000.5", Role.RANK, 3, None),
    ("infertrace-20261123-194254-TP-0-EXTEND.trace.json.gz", "infertrace-20261123-194254", Role.RANK, 0, "EXTEND"),
    ("pre-abc-TP-1-DP-1-PP-0-DECODE.trace.json.gz", "pre-abc", Role.RANK, 1, "DECODE"),
    ("merged-abc.trace.json.gz", "abc", Role.MERGED, None, None),
    ("worker0.pt.trace.json", "", Role.RANK, None, None),
])
def test_peer_names(tmp_path, name, capture, role, rank, stage):
    entry = classify(tmp_path / name)
    assert (entry.capture, entry.role, entry.rank, entry.stage) == (capture, role, rank, stage)


def test_a_directory_of_accumulated_captures_is_split_and_the_newest_chosen(tmp_path):
    for rank in (0, 1):
        touch(tmp_path / f"a_dp0_pp0_tp{rank}_dcp0_ep0_rank{rank}.100.pt.trace.json.gz", 1000)
        touch(tmp_path / f"b_dp0_pp0_tp{rank}_dcp0_ep0_rank{rank}.200.pt.trace.json.gz", 2000)
    touch(tmp_path / "b_host_1.async_llm.201.pt.trace.json.gz", 2000)
    touch(tmp_path / "b.infertrace.json", 2000)  # a manifest, not a trace
    groups = catalog(tmp_path)
    assert [g.name for g in groups] == ["a", "b"]
    group, notes = select(groups)
    assert group.name == "b" and len(group.rank_files()) == 2 and len(group.frontend()) == 1
    assert notes and "analysing the newest, b" in notes[0] and "a" in notes[0]
    named, notes = select(groups, capture="a")
    assert named.name == "a" and notes == []
    one, _ = select(groups, rank=1)
    assert [f.rank for f in one.rank_files()] == [1] and len(one.frontend()) == 1


def test_sglang_stages_pair_and_merged_is_a_fallback(tmp_path):
    touch(tmp_path / "x-TP-0-EXTEND.trace.json.gz")
    touch(tmp_path / "x-TP-0-DECODE.trace.json.gz")
    touch(tmp_path / "merged-x.trace.json.gz")
    (group,) = catalog(tmp_path)
    assert group.name == "x"
    assert sorted(f.stage for f in group.rank_files()) == ["DECODE", "EXTEND"]
    assert {f.rank for f in group.rank_files()} == {0}
    only_merged = tmp_path / "m"
    touch(only_merged / "merged-y.trace.json.gz")
    (group,) = catalog(only_merged)
    assert [f.role for f in group.rank_files()] == [Role.MERGED]


def test_subdirectories_are_captures_of_their_own(tmp_path):
    touch(tmp_path / "capture-1" / "rank0.pt.trace.json.gz", 10)
    touch(tmp_path / "capture-2" / "rank0.pt.trace.json.gz", 20)
    touch(tmp_path / "capture-2" / "rank1.pt.trace.json.gz", 20)
    groups = catalog(tmp_path)
    assert [(g.name, len(g.files)) for g in groups] == [("capture-1", 1), ("capture-2", 2)]


def test_unnamed_vllm_captures_are_told_apart_by_time(tmp_path):
    touch(tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1000000.pt.trace.json.gz")
    touch(tmp_path / "dp0_pp0_tp1_dcp0_ep0_rank1.1000400.pt.trace.json.gz")
    touch(tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.9000000.pt.trace.json.gz")
    groups = catalog(tmp_path)
    assert [len(g.files) for g in groups] == [2, 1]


def test_unknown_capture_or_rank_is_a_clear_error(tmp_path):
    touch(tmp_path / "a-TP-0.trace.json.gz")
    groups = catalog(tmp_path)
    with pytest.raises(LookupError, match="no capture named 'zz'; captures here: a"):
        select(groups, capture="zz")
    with pytest.raises(LookupError, match="has no rank 3"):
        select(groups, rank=3)


OWN_DOCUMENTS = {  # what each infertrace writer starts its document with, under names a trace could have
    "report.json": '{\n "schema": "infertrace.analyze/1",\n "source": "x",\n "tables": {}\n}\n',
    "diff.json": '{"schema": "infertrace.analyze-diff/1", "before": "a", "after": "b", "tables": {}}',
    "rank0.pt.trace.json": '{\n  "label": "run1",\n  "trace": "t.json",\n  "schema": "infertrace.capture/1"\n}\n',
    "manifest.json": '{"url": "http://h", "files": [], "schema": "infertrace.server-capture/1"}',
    "ablation.json": '{"schema": "infertrace.ablate/1", "phases": []}',
    "benchmark_result.json": '{\n  "schema_version": 1,\n  "duration": 1.0,\n  "completed": 4\n}\n',
    "sweep.json.gz": '{"schema_version": 1, "sweep": {"param": "concurrency", "values": [1]}, "runs": []}',
    "requests.json": '{"point": 0, "phase": "warmup", "ttft": 0.1}\n{"point": 0, "phase": "measured"}\n',
    "baseline.json": '{\n  "kind": "infertrace-gate-baseline",\n  "schema_version": 1,\n  "runs": []\n}\n',
    "page.json": "<!DOCTYPE html><html lang='en'><head><title>infertrace analyze: x</title></head></html>",
}


def test_infertrace_documents_are_never_traces_whatever_their_name(tmp_path, make_trace, make_events):
    import gzip

    events = make_events([("kernel", "gemv_kernel", 10, 5, 7, {"stream": 7})])
    trace = make_trace(tmp_path / "run" / "benchmark_result_1_trace.json.gz", events, rank=0)
    for name, text in OWN_DOCUMENTS.items():
        data = gzip.compress(text.encode()) if name.endswith(".gz") else text.encode()
        (tmp_path / "run" / name).write_bytes(data)
        late = tmp_path / "later" / name  # a newer directory of nothing but reports must not become a capture
        late.parent.mkdir(exist_ok=True)
        late.write_bytes(data)
        os.utime(late, (trace.stat().st_mtime + 60,) * 2)
    groups = catalog(tmp_path)
    assert [(g.name, [f.path.name for f in g.files]) for g in groups] == [("run", [trace.name])]


def test_the_outputs_of_this_run_are_left_out_by_path(tmp_path):
    touch(tmp_path / "rank0.pt.trace.json.gz", 10)
    touch(tmp_path / "out.json", 20)
    touch(tmp_path / "tables" / "x.json", 20)
    assert len(catalog(tmp_path)) == 2  # without `exclude`, the stubs are files like any other
    groups = catalog(tmp_path, exclude=[tmp_path / "out.json", tmp_path / "tables"])
    assert [[f.path.name for f in g.files] for g in groups] == [["rank0.pt.trace.json.gz"]]


def vllm_trace_name(worker_name: str, time_ns: int) -> str:
    """A trace file's name as vLLM 0.33.0 makes it: the worker name (vllm/v1/worker/gpu_worker.py `profile`:
    `{prefix}_` + vllm/distributed/utils.py `get_worker_rank_suffix`, whose fallback without parallel groups is
    `rank{r}`; vllm/v1/engine/async_llm.py: `{host}_{pid}.async_llm` for the API server), then torch's
    `tensorboard_trace_handler`: `{worker_name}.{time.time_ns()}.pt.trace.json` and `.gz` with use_gzip."""
    return f"{worker_name}.{time_ns}.pt.trace.json.gz"


@pytest.mark.parametrize("workers", [
    ["rank0"],  # vLLM CPU 0.32 on one process: the rank suffix's fallback
    ["dp0_pp0_tp0_dcp0_ep0_rank0", "dp0_pp0_tp1_dcp0_ep0_rank1"],
])
def test_two_vllm_captures_in_one_profiler_dir_are_two_captures(tmp_path, workers):
    start = 1_765_000_000_000_000_000  # ns: /start_profile../stop_profile twice, ten seconds apart
    for n, stop in enumerate((start, start + 10 * 10**9)):
        for i, worker in enumerate(workers):
            touch(tmp_path / vllm_trace_name(worker, stop + i * 3_000_000), 1000 + n)
        touch(tmp_path / vllm_trace_name("cpuhost_4242.async_llm", stop + 9_000_000), 1000 + n)
    groups = catalog(tmp_path)
    assert len(groups) == 2
    for group in groups:
        assert sorted(f.rank for f in group.rank_files()) == list(range(len(workers)))
        assert len(group.frontend()) == 1
    newest, notes = select(groups)
    assert newest is groups[-1] and str(start + 10 * 10**9) in newest.name
    assert "analysing the newest" in notes[0]
    older, _ = select(groups, capture=str(start))
    assert older is groups[0]


def test_a_prefixed_vllm_capture_taken_twice_is_two_captures(tmp_path):
    for stop in (1_765_000_000_000_000_000, 1_765_000_005_000_000_000):
        touch(tmp_path / vllm_trace_name("run_rank0", stop))
    groups = catalog(tmp_path)
    assert [len(g.files) for g in groups] == [1, 1] and all(g.name.startswith("run@") for g in groups)


def test_a_single_capture_is_named(tmp_path):
    touch(tmp_path / vllm_trace_name("rank0", 1_765_000_000_000_000_000))
    group, notes = select(catalog(tmp_path))
    assert notes == [f"analysing capture {tmp_path.name}, the only one here"]


def test_vllm_cpu_files_in_the_order_a_real_server_wrote_them(tmp_path):
    # vLLM CPU 0.32.0, two /start_profile../stop_profile (the second idle): each API-server trace is stamped
    # before its engine's, the second one 10.6 s before
    names = ["vm_10298.async_llm.1796536921009233566", "rank0.1796536922071395294",
             "vm_10298.async_llm.1796536975943042752", "rank0.1796536986518422718"]
    for i, name in enumerate(names):
        touch(tmp_path / f"{name}.pt.trace.json.gz", 1000 + i)
    groups = catalog(tmp_path)
    assert [sorted(f.stamp for f in g.files) for g in groups] == [
        ["1796536921009233566", "1796536922071395294"], ["1796536975943042752", "1796536986518422718"]]
    assert [g.name for g in groups] == [f"{tmp_path.name}@1796536922071395294", f"{tmp_path.name}@1796536986518422718"]
