"""The closed and open loops against a fake target on the real clock (short sleeps, no sockets)."""

import asyncio
import json

import pytest
from click.testing import CliRunner

from infertrace.cli import main
from infertrace.load.benchmark import Interrupted, Interrupter
from infertrace.load.client.target import Target
from infertrace.load.clock import MonotonicClock
from infertrace.load.records import RequestSpec, StreamEvent
from infertrace.load.run.runner import Runner


class FakeTarget(Target):
    def __init__(self, tokens=3, gap=0.01):
        self.tokens, self.gap = tokens, gap
        self.inflight = self.max_inflight = 0

    async def stream(self, spec):
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            for k in range(self.tokens):
                await asyncio.sleep(self.gap)
                yield [StreamEvent(text="x", num_tokens=1, completion_tokens=k + 1,
                                   finish_reason="stop" if k == self.tokens - 1 else None)]
        finally:
            self.inflight -= 1


def specs(n):
    return [RequestSpec(i, "p", 3) for i in range(n)]


async def test_closed_loop_keeps_exactly_concurrency_in_flight():
    target = FakeTarget()
    runner = Runner(target, MonotonicClock())
    await runner.closed_loop(specs(10), concurrency=3)
    assert target.max_inflight == 3
    assert sorted(r.index for r in runner.results) == list(range(10))
    assert all(r.success and r.output_tokens == 3 for r in runner.results)
    assert max(r.schedule_lag for r in runner.results) < 0.05


async def test_closed_loop_deadline_stops_new_requests():
    clock = MonotonicClock()
    runner = Runner(FakeTarget(gap=0.02), clock)
    await runner.closed_loop(iter(specs(1000)), concurrency=2, deadline=clock.now() + 0.2)
    assert 4 <= len(runner.results) <= 12  # each request takes ~60 ms


async def test_open_loop_sends_on_schedule_and_records_slot_waits():
    target = FakeTarget(tokens=2, gap=0.05)
    clock = MonotonicClock()
    runner = Runner(target, clock)
    offsets = [0.0, 0.01, 0.02, 0.03]
    await runner.open_loop(specs(4), offsets, concurrency=None)
    by_index = {r.index: r for r in runner.results}
    start = by_index[0].scheduled
    assert [by_index[i].scheduled - start for i in range(4)] == pytest.approx(offsets)
    assert target.max_inflight == 4 and all(r.slot_wait == 0 for r in runner.results)

    capped = Runner(FakeTarget(tokens=2, gap=0.05), clock)
    await capped.open_loop(specs(4), offsets, concurrency=1)
    waits = [r.slot_wait for r in sorted(capped.results, key=lambda r: r.index)]
    assert waits[0] == 0 and all(w > 0.05 for w in waits[1:])
    assert all(r.schedule_lag >= r.slot_wait for r in capped.results)


async def test_interrupt_keeps_finished_and_marks_inflight_requests():
    runner = Runner(FakeTarget(tokens=20, gap=0.01), MonotonicClock())
    interrupter = Interrupter()
    asyncio.get_running_loop().call_later(0.35, interrupter.trigger)
    with pytest.raises(Interrupted):
        await interrupter.run(runner.closed_loop(specs(50), concurrency=2))
    done = [r for r in runner.results if r.success]
    cut = [r for r in runner.results if not r.success]
    assert len(done) >= 2 and len(cut) == 2
    assert all(r.error == "interrupted" and r.ttft is not None for r in cut)


class SwallowingTarget(FakeTarget):
    """A target whose client turns a cancellation into a dropped connection, as client libraries may."""

    async def stream(self, spec):
        try:
            async for events in super().stream(spec):
                yield events
        except asyncio.CancelledError:
            yield [StreamEvent(error="disconnect: cancelled")]


@pytest.mark.skipif(not hasattr(asyncio.Task, "cancelling"), reason="Python 3.10 tasks do not count cancel requests")
async def test_an_interrupt_sends_no_new_request_even_when_the_client_swallows_the_cancel():
    runner = Runner(SwallowingTarget(tokens=20, gap=0.01), MonotonicClock())
    interrupter = Interrupter()
    asyncio.get_running_loop().call_later(0.35, interrupter.trigger)
    with pytest.raises(Interrupted):
        await asyncio.wait_for(interrupter.run(runner.closed_loop(specs(50), concurrency=2)), timeout=10)
    # ~0.2 s a request, two at a time: about 4 done by the interrupt, the 2 in flight cut, none sent after it
    assert len(runner.results) <= 8
    assert sum(r.error == "disconnect: cancelled" for r in runner.results) == 2


async def test_client_cpu_is_measured_over_exactly_the_measured_window(monkeypatch, tmp_path):
    from infertrace.load import benchmark
    from infertrace.load.benchmark import Hooks, run_point
    from infertrace.load.config import BenchConfig
    from infertrace.load.workloads import prompts

    cpu = {"s": 0.0}  # a scripted CPU clock: 5 s of setup before the first send and of work after the last end
    monkeypatch.setattr("infertrace.load.run.runner.cpu_seconds", lambda: (cpu["s"], cpu["s"]))

    class CpuTarget(FakeTarget):
        kind, tokenizer = "embedded", None

        async def stream(self, spec):
            async for events in super().stream(spec):
                cpu["s"] += 0.001
                yield events

    build_specs, resolve = prompts.build_specs, benchmark.resolve_output_tokens

    def costly(fn):
        def wrapped(*args, **kw):
            cpu["s"] += 5.0
            return fn(*args, **kw)
        return wrapped

    monkeypatch.setattr(prompts, "build_specs", costly(build_specs))
    monkeypatch.setattr(benchmark, "resolve_output_tokens", costly(resolve))
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "p", "max_tokens": 3}\n')
    cfg = BenchConfig(dataset="jsonl", dataset_path=str(path), num_prompts=4, concurrency=2, warmup=0)
    record = await run_point(cfg, CpuTarget(), MonotonicClock(), Interrupter(), Hooks())
    assert record.metrics.completed == 4
    # 4 requests x 3 events x 1 ms inside the window; the 10 s of setup and teardown are not charged
    assert record.client_cpu * record.metrics.duration == pytest.approx(0.012)
    assert record.process_cpu * record.metrics.duration == pytest.approx(0.012)


def test_measured_gc_raises_the_thresholds_and_puts_them_back():
    import gc

    from infertrace.load.run.runner import MEASURED_GC_THRESHOLD, measured_gc

    before = gc.get_threshold()
    with pytest.raises(RuntimeError), measured_gc():
        assert gc.get_threshold() == MEASURED_GC_THRESHOLD
        raise RuntimeError
    assert gc.get_threshold() == before


async def test_requests_held_behind_a_slot_wait_count_that_wait_as_their_own():
    """Cap 2, four requests due at t=0 and a fifth at t=2.5, each answered one second after it is sent (scripted
    clock): the third waits 1 s for a slot; the fourth, due at 0 but reached only once the third got its slot,
    waited that second too (none of it is the client's own lag); the fifth, due later with a slot free, none."""
    from infertrace.load.clock import ScriptedClock

    clock = ScriptedClock(0.0)
    pending: list[tuple[float, asyncio.Event]] = []  # (answer time, release) of each request sent

    class OneSecond(Target):
        async def stream(self, spec):
            release = asyncio.Event()
            pending.append((clock.now() + 1.0, release))
            await release.wait()
            yield [StreamEvent(text="x", num_tokens=1, completion_tokens=1, finish_reason="stop")]

    class Clock(ScriptedClock):  # the loop's sleeps wait for the test to move time, as a real clock would
        async def sleep_until(self, t):
            while self.t < t:
                await asyncio.sleep(0)

    clock = Clock(0.0)
    runner = Runner(OneSecond(), clock, cpu_clock=lambda: (0.0, 0.0))
    task = asyncio.create_task(runner.open_loop(specs(5), [0.0, 0.0, 0.0, 0.0, 2.5], concurrency=2))
    for t in (1.0, 2.0, 2.5, 3.5):
        for _ in range(20):
            await asyncio.sleep(0)
        clock.set(t)
        for due, release in pending:
            if due <= t:
                release.set()
    await asyncio.wait_for(task, 5)
    by_index = {r.index: r for r in runner.results}
    assert [by_index[i].slot_wait for i in range(5)] == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert [by_index[i].schedule_lag - by_index[i].slot_wait for i in range(5)] == [0.0] * 5


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


def bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])
