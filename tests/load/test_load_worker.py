"""The load worker (load/run/worker.py): how one schedule is cut into slices, and that workers keep each slice's
schedule and sessions whole."""

from __future__ import annotations

import json
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

