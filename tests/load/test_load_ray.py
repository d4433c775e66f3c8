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
