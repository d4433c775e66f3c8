"""Load from several worker processes (and Ray actors): one schedule, split; records merged; the same figures."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from infertrace.cli import main
from infertrace.load.records import RequestSpec
from infertrace.load.run.worker import closed_slices, open_slices, session_slices, shares
from infertrace.load.workloads.conversation import Session, Turn

HERE = Path(__file__).resolve().parent


def bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def specs(n):
    return [RequestSpec(i, "", 4, [1000 + i] * 5) for i in range(n)]


def test_partitions():
    assert shares(10, 3) == [4, 3, 3] and shares(2, 3) == [1, 1, 0]
    parts = open_slices(specs(7), [0.1 * i for i in range(7)], 3, cap=5)
    assert [[s.index for s in p.specs] for p in parts] == [[0, 3, 6], [1, 4], [2, 5]]
    assert [p.offsets for p in parts][1] == [0.1, 0.4] and [p.concurrency for p in parts] == [2, 2, 1]
    parts = closed_slices(specs(6), concurrency=2, n=3, cycle=False, deadline_s=None)
    assert len(parts) == 2 and [p.concurrency for p in parts] == [1, 1]  # no worker without a user
    sessions = [Session(i, (Turn("q", 2),)) for i in range(5)]
    parts = session_slices(sessions, 2, None, users=3, think_time_s=0.5, deadline_s=None)
    assert [[s.index for s in p.sessions] for p in parts] == [[0, 2, 4], [1, 3]]  # whole sessions
    assert [p.concurrency for p in parts] == [2, 1] and parts[0].think_time_s == 0.5


def test_two_workers_give_the_figures_one_gives(standin, tmp_path):
    standin.token_delay = 0.01
    docs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}.json"
        res = bench("--base-url", standin.url, "--num-prompts", 40, "--concurrency", 4, "--warmup", 0,
                    "--output-len", 6, "--workers", workers, "--result-json", out)
        assert res.exit_code == 0, res.output
        docs[workers] = json.loads(out.read_text())
    one, two = docs[1], docs[2]
    assert one["completed"] == two["completed"] == 40 and one["failed"] == two["failed"] == 0
    assert one["total_output_tokens"] == two["total_output_tokens"] == 240
    assert two["workers"] == 2 and "workers" not in one
    # the server's pace sets every latency: the same within noise whatever sends the load
    for key in ("median_e2el_ms", "median_itl_ms"):
        assert two[key] == pytest.approx(one[key], rel=0.3), key
    # client CPU is the busiest worker's (a per-core figure, as for one process); the process figure sums them
    assert 0 < two["client_cpu_percent"] < two["process_cpu_percent"]


def test_client_cpu_of_a_fleet_is_its_busiest_worker():
    from infertrace.load.clock import MonotonicClock
    from infertrace.load.config import BenchConfig
    from infertrace.load.run.fleet import Fleet
    from infertrace.load.run.worker import Batch

    fleet = Fleet(BenchConfig(base_url="http://127.0.0.1:9", workers=3), MonotonicClock())
    fleet.barrier(0.0)
    for cpu_s in (0.25, 0.75, 0.5):
        fleet.take(Batch([], cpu_s=0.1))  # a batch before the end carries no CPU figure
        fleet.take(Batch([], done=True, cpu_s=cpu_s))
    assert fleet.cpu_window is None  # no results: nothing measured
    fleet.results.append(object())
    assert fleet.cpu_window == (0.75, 1.5)


def test_open_loop_schedule_is_computed_once_and_kept(standin, tmp_path):
    from infertrace.load.workloads.dataset import seeded_rng
    from infertrace.load.workloads.schedule import arrival_offsets

    reqs = tmp_path / "r.jsonl"
    res = bench("--base-url", standin.url, "--num-prompts", 24, "--request-rate", 80, "--warmup", 0,
                "--output-len", 2, "--workers", 3, "--seed", 5, "--requests-jsonl", reqs)
    assert res.exit_code == 0, res.output
    lines = [json.loads(l) for l in reqs.read_text().splitlines()]
    expected = arrival_offsets(80, 1.0, seeded_rng(5, "arrivals", 0), 24, None)
    scheduled = {l["index"]: l["scheduled_s"] for l in lines}
    assert sorted(scheduled) == list(range(24))
    # worker w plays requests w, w+3, ... (open_slices) from its own start at the barrier: within a worker the
    # schedule's spacing is kept exactly, whatever the start skew between workers or the machine's load
    for w in range(3):
        mine = range(w, 24, 3)
        got = [scheduled[i] - scheduled[w] for i in mine]
        assert got == pytest.approx([expected[i] - expected[w] for i in mine], rel=1e-9, abs=1e-9)


def test_sessions_are_played_whole_by_workers(standin, tmp_path, tiny_model_dir):
    reqs, out = tmp_path / "r.jsonl", tmp_path / "r.json"
    res = bench("--base-url", standin.url, "--tokenizer", tiny_model_dir, "--dataset", "conversation", "--turns", 3,
                "--turn-input-len", 8, "--output-len", 2, "--num-prompts", 6, "--concurrency", 2, "--warmup", 0,
                "--workers", 2, "--requests-jsonl", reqs, "--result-json", out)
    assert res.exit_code == 0, res.output
    lines = [json.loads(l) for l in reqs.read_text().splitlines()]
    by_session = {}
    for l in sorted(lines, key=lambda l: l["t0_s"]):
        by_session.setdefault(l["session"], []).append(l["turn"])
    assert sorted(by_session) == list(range(6)) and all(t == [0, 1, 2] for t in by_session.values())
    doc = json.loads(out.read_text())
    assert doc["sessions"] == 6 and doc["sessions_completed"] == 6


def test_interrupting_a_fleet_keeps_what_was_measured(standin):
    from infertrace.load.clock import MonotonicClock
    from infertrace.load.config import BenchConfig
    from infertrace.load.run.fleet import Fleet

    standin.token_delay = 0.05
    cfg = BenchConfig(base_url=standin.url, num_prompts=200, concurrency=4, warmup=0, output_len=4, workers=2)
    fleet = Fleet(cfg, MonotonicClock())

    async def scenario():
        task = asyncio.ensure_future(fleet.closed_loop(specs(200), 4))
        await asyncio.sleep(2.5)  # the barrier, then a few requests
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    done = [r for r in fleet.results if r.error is None]
    assert 0 < len(done) < 200 and len(fleet.start_skew_s) == 2  # both workers reported before exiting
    assert all(r.error == "interrupted" for r in fleet.results if r.error is not None)


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


def test_what_a_lost_worker_owed():
    from infertrace.load.records import RequestResult
    from infertrace.load.run.worker import unreported

    part = open_slices(specs(6), [0.1 * i for i in range(6)], 2, None)[1]  # specs 1, 3, 5
    sent = [RequestResult(3, 0.3, 0.3, 0.4)]
    assert unreported(part, sent) == [(1, 0.1, None, None), (5, 0.5, None, None)]
    assert unreported(closed_slices(specs(6), 2, 2, True, None)[0], []) == []  # cycled: nothing countable
    sessions = [Session(i, (Turn("q", 2), Turn("q", 2))) for i in range(3)]
    part = session_slices(sessions, 1, None, 2, 0.0, None)[0]
    sent = [RequestResult(0, 0, 0, 1, session=0, turn=0), RequestResult(1, 0, 0, 1, session=0, turn=1),
            RequestResult(2, 0, 0, 1, session=1, turn=0, error="HTTP 500")]
    assert unreported(part, sent) == [(3, None, 2, 0)]  # session 0 done, 1 ended by its failure, 2 never began


def test_workers_need_a_server():
    res = bench("--workers", 2, "--num-prompts", 2)
    assert res.exit_code == 2 and "--workers and --ray send load to a server" in res.output


@pytest.fixture
def instant_server():
    proc = subprocess.Popen([sys.executable, str(HERE / "instant_server.py")], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.slow
def test_ten_thousand_concurrent_streams(instant_server, tmp_path):
    out = tmp_path / "r.json"
    started = time.monotonic()
    res = bench("--base-url", instant_server, "--served-model-name", "m", "--num-prompts", 10_000,
                "--concurrency", 10_000, "--warmup", 0, "--output-len", 2, "--result-json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["completed"] == 10_000 and doc["failed"] == 0 and doc["total_output_tokens"] == 20_000
    assert time.monotonic() - started < 120


def test_too_few_open_files_is_one_line(instant_server):
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
        "from infertrace.cli import main\n"
        f"sys.argv = ['infertrace', 'bench', '--base-url', {instant_server!r}, '--served-model-name', 'm',"
        " '--num-prompts', '1000', '--concurrency', '1000', '--warmup', '0']\n"
        "main()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "1000 concurrent streams need about 1064 open files" in done.stderr
    assert "ulimit -n 1064" in done.stderr


def test_connections_are_pooled_and_reused(standin, tmp_path):
    res = bench("--base-url", standin.url, "--num-prompts", 60, "--concurrency", 3, "--warmup", 0,
                "--output-len", 2, "--result-json", tmp_path / "r.json")
    assert res.exit_code == 0, res.output
    assert 0 < len(standin.peers) <= 3 + 1  # the requests' connections (and the preflight's, at most one more)


def test_latency_from_the_intended_start_is_reported_and_warned(standin, tmp_path):
    """An open loop capped at one request in flight: requests queue for the slot, so counted from when they were
    due their TTFT grows while the measured one does not."""
    standin.token_delay = 0.02
    out = tmp_path / "r.json"
    res = bench("--base-url", standin.url, "--num-prompts", 12, "--request-rate", "inf", "--concurrency", 1,
                "--warmup", 0, "--output-len", 3, "--result-json", out)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["median_ttft_from_scheduled_ms"] > 2 * doc["median_ttft_ms"]
    assert doc["p99_e2el_from_scheduled_ms"] >= doc["p99_e2el_ms"]
    assert "counted from each request's scheduled time" in " ".join(doc["headroom_warnings"])
