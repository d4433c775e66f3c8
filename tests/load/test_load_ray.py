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
