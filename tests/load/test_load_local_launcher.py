"""Load workers as local processes (load/run/local_launcher.py): a worker killed mid-run is a lost worker."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from infertrace.cli import main

HERE = Path(__file__).resolve().parent



def bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def _worker_pids(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


def test_a_killed_worker_counts_as_failed_requests_and_fails_the_run(standin, tmp_path):
    """A worker killed mid-run: what it never reported is failed, named by its signal; the run exits non-zero."""
    import psutil

    standin.token_delay = 0.05
    out, reqs = tmp_path / "r.json", tmp_path / "r.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "infertrace", "bench", "--base-url", standin.url,
                             "--num-prompts", "80", "--concurrency", "4", "--warmup", "0", "--output-len", "4",
                             "--workers", "2", "--result-json", str(out), "--requests-jsonl", str(reqs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while standin.count < 10:  # both workers are sending
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        victim = _worker_pids(proc.pid)[0]
        psutil.Process(victim).kill()
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr
    named = re.search(rf"load worker (\d) of 2 \(pid {victim}\) killed by SIGKILL: (\d+) request\(s\)", stderr)
    assert named, stderr
    worker, owed = int(named[1]), int(named[2])
    doc = json.loads(out.read_text())
    assert doc["completed"] + doc["failed"] == 80 and doc["failed"] == owed and 0 < owed < 40
    assert doc["interrupted"] is False and len(doc["lost_workers"]) == 1
    assert doc["lost_workers"][0].startswith(named[0])
    failed = [json.loads(line) for line in reqs.read_text().splitlines() if not json.loads(line)["success"]]
    # every failure is of the killed worker's slice (every second spec), under its name
    assert all(r["index"] % 2 == worker - 1 and r["error"] == f"load worker {worker} lost: killed by SIGKILL"
               for r in failed) and len(failed) == owed
    assert f"load worker {worker} lost" in stdout  # the failure's reason in the table



def test_a_worker_that_exits_while_its_pipe_stays_open_is_lost_not_waited_for(standin, tmp_path, monkeypatch):
    """Another process may hold a copy of a worker's end of its pipe (here: this one, which keeps a duplicate), so
    the pipe never reports its end when the worker dies: its process's exit is enough to count it lost."""
    import multiprocessing
    import os
    import threading

    import psutil

    ctx = multiprocessing.get_context("spawn")
    real_pipe = ctx.Pipe
    held: list[int] = []

    def pipe_with_a_copy(*args, **kwargs):
        parent, child = real_pipe(*args, **kwargs)
        held.append(os.dup(child.fileno()))
        return parent, child

    monkeypatch.setattr(ctx, "Pipe", pipe_with_a_copy)
    standin.token_delay = 0.05
    killed: list[int] = []

    def kill_one_worker():
        deadline = time.monotonic() + 60
        while standin.count < 10 and time.monotonic() < deadline:
            time.sleep(0.02)
        pids = _worker_pids(os.getpid())
        if pids:
            psutil.Process(pids[0]).kill()
            killed.append(pids[0])

    killer = threading.Thread(target=kill_one_worker, daemon=True)
    killer.start()
    out = tmp_path / "r.json"
    try:
        res = bench("--base-url", standin.url, "--num-prompts", 80, "--concurrency", 4, "--warmup", 0,
                    "--output-len", 4, "--workers", 2, "--result-json", out)
    finally:
        for fd in held:
            os.close(fd)
    killer.join(10)
    assert killed, "no worker was found to kill"
    assert res.exit_code == 1, res.output
    doc = json.loads(out.read_text())
    assert doc["completed"] + doc["failed"] == 80 and doc["failed"] > 0 and len(doc["lost_workers"]) == 1
