"""On a GPU: a capture of the bundled engine on qwen3-0.6b holds its CUDA kernels inside our step ranges,
in the torch.profiler trace and, under nsys, in the NVTX ranges of the same names."""

from __future__ import annotations

import gzip
import json
import re
import sqlite3
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from click.testing import CliRunner

from infertrace.capture import nsys
from infertrace.cli import main

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# Runs in its own process (under nsys in one test): 6 steps outside the window, then a window of 10. The KV cache
# is sized in tokens, not from free memory: earlier GPU tests in the pytest process may still hold most of the GPU.
ENGINE_RUN = """
import sys
from pathlib import Path
from infertrace.capture.torch_capture import CaptureSession
from infertrace.engine import Engine, EngineConfig, SamplingParams

engine = Engine(sys.argv[1], EngineConfig(max_model_len=2048, kv_cache_tokens=8192))
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
for i in range(8):
    engine.add_request(f"req-{i}", [100 + i] * 128, params)
for _ in range(6):
    engine.step()
session = CaptureSession(Path(sys.argv[2]), activities=("CPU", "GPU"), num_steps=10, label="qwen3")
session.start()
while engine.has_unfinished():
    outputs = engine.step()
    session.add_request_ids(o.request_id for o in outputs)
    if session.on_step(engine.last_step):
        break
session.stop()
"""


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from infertrace.modelgen import init_model

    return init_model("qwen3-0.6b", tmp_path_factory.mktemp("models") / "qwen3-0.6b")


def kernels_in_steps(trace: Path) -> tuple[list[str], dict[str, int], int]:
    """Step range names, kernels launched inside each step (by name), and all kernels in the trace."""
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = [e for e in events if e.get("ph") == "X" and e.get("name", "").startswith("step[")]
    kernels = defaultdict(int)
    for e in events:
        if e.get("cat") == "kernel":
            kernels[e["args"]["correlation"]] += 1
    inside: dict[str, int] = defaultdict(int)
    for e in events:  # launches through the runtime (torch) or the driver (Triton)
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            for s in steps:
                if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]:
                    inside[s["name"]] += kernels.get(e["args"]["correlation"], 0)
    return [s["name"] for s in steps], inside, sum(kernels.values())


def test_torch_trace_holds_kernels_inside_steps(qwen3_dir, tmp_path):
    done = subprocess.run([sys.executable, "-c", ENGINE_RUN, str(qwen3_dir), str(tmp_path)], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    trace = next(tmp_path.glob("qwen3.*.pt.trace.json.gz"))
    steps, inside, total = kernels_in_steps(trace)
    assert len(steps) == 10 and all(name.startswith("step[DECODE bs=8]") for name in steps)
    assert total > 0 and sum(inside.values()) == total  # every kernel was launched inside a step range
    manifest = json.loads(next(tmp_path.glob("qwen3.*.manifest.json")).read_text())
    assert manifest["activities"] == ["CPU", "GPU"] and manifest["device"]["type"] == "cuda"
    assert len(manifest["steps"]) == 10 and len(manifest["request_ids"]) == 8


@pytest.mark.skipif(nsys.find_nsys() is None, reason="needs nsys (set NSYS or put it on PATH)")
def test_nsys_nvtx_ranges_hold_the_kernels(qwen3_dir, tmp_path):
    result = CliRunner().invoke(main, ["profile", "--nsys", "--output-dir", str(tmp_path / "nsys"), "--",
                                       sys.executable, "-c", ENGINE_RUN, str(qwen3_dir), str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = Path(result.stdout.split()[-1])
    database = tmp_path / "report.sqlite"
    subprocess.run([str(nsys.find_nsys()), "export", "--type", "sqlite", "-o", str(database), str(report)],
                   check=True, capture_output=True)
    db = sqlite3.connect(database)
    ranges = db.execute("SELECT n.start, n.end, coalesce(n.text, s.value) FROM NVTX_EVENTS n "
                        "LEFT JOIN StringIds s ON n.textId = s.id WHERE n.end IS NOT NULL").fetchall()
    steps = [(start, end) for start, end, name in ranges if name and name.startswith("step[")]
    names = {re.sub(r" #\d+\]$", "]", name or "") for _, _, name in ranges}  # without the step numbers
    assert len(steps) == 10 and {"step[DECODE bs=8]", "schedule", "prepare_inputs", "forward", "sample"} <= names
    launched = defaultdict(int)
    for (correlation,) in db.execute("SELECT correlationId FROM CUPTI_ACTIVITY_KIND_KERNEL"):
        launched[correlation] += 1
    calls = db.execute("SELECT start, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME").fetchall()
    inside = sum(launched.get(c, 0) for t, c in calls if any(a <= t <= b for a, b in steps))
    assert sum(launched.values()) > 0 and inside == sum(launched.values())
    manifest = json.loads(next(tmp_path.glob("qwen3.*.manifest.json")).read_text())
    assert manifest["activities"] == ["CUDA_PROFILER"] and manifest["trace"] is None


def _post(url: str, body: dict | None = None) -> bytes:
    import urllib.request

    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json"} if body is not None else {})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read()


@pytest.mark.skipif(nsys.find_nsys() is None, reason="needs nsys (set NSYS or put it on PATH)")
def test_serve_under_nsys_gives_one_report_per_window(qwen3_dir, tmp_path):
    """`infertrace serve` launched as `profile --nsys --server infertrace` prints, driven by `profile --start
    --activities CUDA_PROFILER`: two windows of one server run land in two reports (--capture-range-end=repeat)."""
    import os
    import signal
    import socket
    import time
    import urllib.request

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "infertrace", "serve", "--model", str(qwen3_dir), "--port", str(port),
             "--profile-dir", str(tmp_path / "profiles"), "--kv-cache-tokens", "8192", "--max-model-len", "2048"]
    line = nsys.server_nsys_line("infertrace", tmp_path / "serve", serve, nsys.find_nsys())
    server = subprocess.Popen(line, shell=True, start_new_session=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, server.stdout.read()[-3000:]
                time.sleep(1)
        for window in range(2):
            started = CliRunner().invoke(main, ["profile", "--url", url, "--start", "--activities", "CUDA_PROFILER",
                                                "--name", f"w{window}"])
            assert started.exit_code == 0, started.output
            for _ in range(2):
                _post(url + "/v1/completions", {"prompt": "hello " * 40, "max_tokens": 16, "ignore_eos": True})
            stopped = CliRunner().invoke(main, ["profile", "--url", url, "--stop"])
            assert stopped.exit_code == 0, stopped.output
    finally:
        os.killpg(server.pid, signal.SIGINT)
        output = server.communicate(timeout=240)[0]
    reports = sorted(tmp_path.glob("serve*.nsys-rep"))
    assert len(reports) == 2, (reports, output[-3000:])
