"""The parent side of a run over load workers (load/run/fleet.py): the same figures as one process, the busiest
worker's CPU, what an interrupted or lost worker leaves, and that workers need a server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from infertrace.cli import main
from infertrace.load.records import RequestSpec
from infertrace.load.run.worker import closed_slices, open_slices, session_slices
from infertrace.load.workloads.conversation import Session, Turn

HERE = Path(__file__).resolve().parent



def bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def specs(n):
    return [RequestSpec(i, "", 4, [1000 + i] * 5) for i in range(n)]


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

