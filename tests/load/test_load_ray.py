"""Load workers as Ray actors on a real local Ray cluster (two actors on this machine's one node)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from infertrace.cli import main

ray = pytest.importorskip("ray", reason="Ray is the optional [distributed] extra")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_an_address_with_no_cluster_is_one_line_in_seconds(standin, prompts_jsonl):
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "infertrace", "bench", "--base-url", standin.url, "--dataset",
                           "jsonl", "--dataset-path", str(prompts_jsonl), "--num-prompts", "2", "--warmup", "0",
                           "--ray", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and time.monotonic() - started < 60
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: --ray 127.0.0.1:{port}: cannot reach a Ray cluster there"), done.stderr
    assert "Unclosed" not in done.stderr  # the run's sessions were closed on the way out
    assert standin.count == 0


def test_a_ray_client_address_without_ray_client_says_so(monkeypatch, standin, prompts_jsonl):
    import sys

    from infertrace.load.client.timing import TargetError
    from infertrace.load.run.ray_launcher import connect

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setitem(sys.modules, "ray.util.client.worker", None)  # a Ray without its client half
    with pytest.raises(TargetError, match=r"ray://h:10001: a ray:// address connects through Ray Client") as e:
        connect("ray://h:10001")
    assert "pip install 'ray[client]'" in str(e.value) and "needs Ray:" not in str(e.value)
    res = CliRunner().invoke(main, ["bench", "--base-url", standin.url, "--dataset", "jsonl", "--dataset-path",
                                    str(prompts_jsonl), "--num-prompts", "2", "--warmup", "0", "--ray", "ray://h:1"])
    assert res.exit_code == 2 and "pip install 'ray[client]'" in res.stderr  # brackets shown as given


def test_two_actors_send_one_schedule_and_their_records_merge(cluster, standin, tmp_path):
    standin.token_delay = 0.005
    out, reqs = tmp_path / "r.json", tmp_path / "r.jsonl"
    res = CliRunner().invoke(main, ["bench", "--base-url", standin.url, "--num-prompts", "30", "--request-rate", "60",
                                    "--warmup", "0", "--output-len", "4", "--workers", "2", "--ray", "auto",
                                    "--result-json", str(out), "--requests-jsonl", str(reqs)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["completed"] == 30 and doc["failed"] == 0 and doc["total_output_tokens"] == 120
    assert doc["workers"] == 2 and doc["ray_nodes"] == 1
    offsets = doc["worker_clock_offsets_ms"]
    assert len(offsets) == 2 and all(abs(o) < 1000 for o in offsets)  # one host: the clocks agree closely
    assert 0 <= doc["worker_start_skew_max_ms"] < 1000
    assert len(reqs.read_text().splitlines()) == 30 and standin.count == 30


def test_a_killed_actor_counts_as_failed_requests_and_fails_the_run(cluster, standin, tmp_path):
    import threading
    import time

    import psutil

    standin.token_delay = 0.05
    out = tmp_path / "r.json"
    killed = []

    def kill_one_actor():
        deadline = time.monotonic() + 120
        while standin.count < 10 and time.monotonic() < deadline:  # both actors are sending
            time.sleep(0.02)
        actors = [p for p in psutil.process_iter(["cmdline"]) if "LoadActor" in " ".join(p.info["cmdline"] or [])]
        if actors:
            actors[0].kill()
            killed.append(actors[0].pid)

    killer = threading.Thread(target=kill_one_actor)
    killer.start()
    res = CliRunner().invoke(main, ["bench", "--base-url", standin.url, "--num-prompts", "80", "--concurrency", "4",
                                    "--warmup", "0", "--output-len", "4", "--workers", "2", "--ray", "auto",
                                    "--result-json", str(out)])
    killer.join()
    assert killed, "no actor process was found"
    assert res.exit_code == 1, res.output
    doc = json.loads(out.read_text())
    assert doc["completed"] + doc["failed"] == 80 and 0 < doc["completed"] < 80
    assert len(doc["lost_workers"]) == 1 and "request(s) of its slice never reported count as failed" in \
        doc["lost_workers"][0]
