"""CaptureSession: a torch.profiler window over annotated steps, its trace and its manifest."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
import torch
from torch.profiler import record_function

from infertrace.capture.nsys import NSYS_OUTPUT_ENV
from infertrace.capture.torch_capture import CaptureSession


def run_steps(session, n, kind="DECODE", bs=2):
    """Annotated CPU work shaped like engine steps; returns how many ran before the session said done."""
    for i in range(n):
        with record_function(f"step[{kind} bs={bs}]"):
            with record_function("forward"):
                torch.ones(32, 32) @ torch.ones(32, 32)
            with record_function("sample"):
                torch.argmax(torch.ones(4, 8), dim=-1)
        stats = {"index": i, "kind": kind.lower(), "batch_size": bs, "num_tokens": bs, "duration_s": 0.002}
        if session.on_step(stats, request_ids=[f"req-{i}", "req-shared"]):
            return i + 1
    return n


def load_trace(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def test_capture_writes_gzip_kineto_trace_and_manifest(tmp_path):
    session = CaptureSession(tmp_path / "traces", num_steps=3, label="bench")
    assert not session.active
    session.start()
    assert session.active
    assert run_steps(session, 10) == 3
    paths = session.stop()
    assert not session.active

    trace_path, manifest_path = paths
    assert trace_path.name.startswith("bench.") and trace_path.name.endswith(".pt.trace.json.gz")
    assert manifest_path.name == trace_path.name.replace(".pt.trace.json.gz", ".manifest.json")
    names = [re.sub(r" #\d+\]$", "]", e.get("name") or "") for e in load_trace(trace_path)["traceEvents"]]
    assert names.count("step[DECODE bs=2]") == 3
    assert names.count("forward") == 3 and names.count("sample") == 3

    manifest = json.loads(manifest_path.read_text())
    assert manifest["trace"] == trace_path.name
    assert manifest["activities_requested"] == ["CPU", "GPU"]
    assert manifest["activities"] == (["CPU", "GPU"] if torch.cuda.is_available() else ["CPU"])
    assert [s["index"] for s in manifest["steps"]] == [0, 1, 2]
    assert manifest["steps"][0] == {"index": 0, "kind": "decode", "bs": 2, "toks": 2, "duration_ms": 2.0}
    assert manifest["request_ids"] == ["req-0", "req-shared", "req-1", "req-2"]
    assert manifest["started_at"] <= manifest["stopped_at"] and manifest["duration_s"] > 0
    assert manifest["versions"]["torch"] == torch.__version__
    assert manifest["device"]["type"] in ("cpu", "cuda")


def test_steps_outside_the_window_are_not_recorded(tmp_path):
    session = CaptureSession(tmp_path, activities=("CPU",))
    assert session.on_step({"index": 0, "kind": "prefill"}) is False  # not started: ignored
    session.start()
    run_steps(session, 2, kind="PREFILL", bs=1)
    _, manifest_path = session.stop()
    manifest = json.loads(manifest_path.read_text())
    assert [s["kind"] for s in manifest["steps"]] == ["prefill", "prefill"]
    assert manifest["num_steps"] is None
    assert session.on_step({"index": 9}) is False


def test_step_stats_object_and_enum_kind(tmp_path):
    import enum
    from dataclasses import dataclass

    class Kind(enum.Enum):
        MIXED = "mixed"

    @dataclass
    class Stats:
        index: int
        kind: Kind
        batch_size: int
        num_tokens: int
        duration_s: float

    session = CaptureSession(tmp_path, activities=("CPU",), num_steps=1)
    session.start()
    assert session.on_step(Stats(7, Kind.MIXED, 3, 40, 0.01)) is True
    manifest = json.loads(session.stop()[-1].read_text())
    assert manifest["steps"] == [{"index": 7, "kind": "mixed", "bs": 3, "toks": 40, "duration_ms": 10.0}]


def test_stop_without_start():
    with pytest.raises(RuntimeError, match="no capture in progress"):
        CaptureSession(Path("/tmp/unused")).stop()


def test_start_twice(tmp_path):
    session = CaptureSession(tmp_path, activities=("CPU",))
    session.start()
    try:
        with pytest.raises(RuntimeError, match="already in progress"):
            session.start()
    finally:
        session.stop()


def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    session = CaptureSession(blocker / "traces")
    with pytest.raises(ValueError, match="cannot write traces to .*a-file/traces"):
        session.start()
    assert not session.active


@pytest.mark.parametrize("kwargs, message", [
    ({"activities": ("CPU", "TPU")}, "unknown capture activity 'TPU'"),
    ({"activities": ()}, "no capture activity"),
    ({"num_steps": 0}, "num_steps must be at least 1"),
    ({"label": "a/b"}, "plain file-name prefix"),
])
def test_invalid_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        CaptureSession(tmp_path, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_profiler_needs_cuda(tmp_path):
    with pytest.raises(ValueError, match="CUDA_PROFILER activity needs a CUDA device"):
        CaptureSession(tmp_path, activities=("CUDA_PROFILER",)).start()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_under_nsys_only_the_cuda_range_is_opened(tmp_path, monkeypatch):
    monkeypatch.setenv(NSYS_OUTPUT_ENV, str(tmp_path / "run.%p"))
    with pytest.raises(ValueError, match="CUDA_PROFILER"):
        CaptureSession(tmp_path, activities=("CPU",)).start()


def test_memory_activity_alone_profiles_cpu(tmp_path):
    session = CaptureSession(tmp_path, activities=("MEM",))
    session.start()
    run_steps(session, 1)
    trace, manifest = session.stop()
    assert json.loads(manifest.read_text())["activities"] == ["CPU", "MEM"]
    assert any(e.get("name") == "[memory]" for e in load_trace(trace)["traceEvents"])


@pytest.mark.gpu
def test_gpu_capture_holds_kernels_inside_steps(tmp_path):
    session = CaptureSession(tmp_path, activities=("CPU", "GPU", "CUDA_PROFILER"), num_steps=2)
    session.start()
    a = torch.ones(256, 256, device="cuda")
    for i in range(2):
        with record_function("step[DECODE bs=1]"):
            a = a @ a / 256
        session.on_step({"index": i, "kind": "decode", "batch_size": 1, "num_tokens": 1})
    trace, manifest = session.stop()
    events = load_trace(trace)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    assert json.loads(manifest.read_text())["device"]["type"] == "cuda"


def test_kinetos_chatter_stays_out_of_stderr_and_real_errors_do_not(tmp_path):
    """A fresh process starts a capture on a thread other than the one that imported torch, as the server's engine
    thread and ablate do: Kineto printed an "External init callback" ERROR line and USDT lines on stderr at every
    start and stop. They are dropped; a line printed at the descriptor meanwhile still comes through."""
    import subprocess
    import sys

    code = f"""
import os, threading, torch
from pathlib import Path
from infertrace.capture import torch_capture

def run():
    session = torch_capture.CaptureSession(Path({str(tmp_path)!r}), activities=("CPU",))
    session.start()
    torch.ones(3) + 1
    with torch_capture.kineto_chatter_filtered():
        os.write(2, b"a real error from C++\\n")
    session.stop()

thread = threading.Thread(target=run)
thread.start()
thread.join()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["a real error from C++"], done.stderr
