"""The next step planned as late as the device allows (pace.py): the pace's estimates, the engine's delay, and both
engine loops (the engine process's and the in-process AsyncEngine's) taking a request that arrives while a step
runs into the very next step.

On CPU a step's device work runs at launch, so the loops are run over `SlowDevice`: each launched step takes a
fixed device time after the one queued before it, and its results wait for that end, as a GPU step's do.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from infertrace.engine import SamplingParams
from infertrace.engine.pace import LEAD_MARGIN_S, StepPace

STEP_S = 0.2  # the stand-in device's time a step: far longer than a CPU forward of the tiny model and the loop's turn


# ----- the pace alone, on a clock of its own -----
def test_a_step_queued_behind_another_is_timed_from_the_others_end():
    pace, key = StepPace(), StepPace.key("decode", 8)
    pace.completed(key, launched_at=0.0, done_at=1.0)  # nothing before it: from its launch
    pace.completed(key, launched_at=0.5, done_at=1.75)  # queued at 0.5, started when the first ended
    pace.lead(0.1)
    assert pace.plan_at(key, launched_at=1.6) == pytest.approx(1.75 + 0.75 - 0.1 - LEAD_MARGIN_S)


def test_the_estimate_is_the_least_recent_time_and_the_lead_the_greatest():
    pace, key = StepPace(), StepPace.key("decode", 8)
    done = 0.0
    for duration in (0.9, 1.0, 1.2):
        pace.completed(key, launched_at=done, done_at=done + duration)
        done += duration
    for lead in (0.2, 0.05, 0.1):
        pace.lead(lead)
    assert pace.plan_at(key, launched_at=done - 0.5) == pytest.approx(done + 0.9 - 0.2 - LEAD_MARGIN_S)


def test_old_times_make_way_for_new_ones():
    """Decode attention's time grows with the context: the estimate follows the recent steps, not the first."""
    from infertrace.engine.pace import DURATION_SAMPLES

    pace, key = StepPace(), StepPace.key("decode", 8)
    pace.lead(0.0)
    done = 0.0
    for duration in [0.5] + [1.0] * DURATION_SAMPLES:
        pace.completed(key, launched_at=done, done_at=done + duration)
        done += duration
    assert pace.plan_at(key, launched_at=done) == pytest.approx(done + 1.0 - LEAD_MARGIN_S)


def test_no_wait_before_a_step_of_that_kind_and_size_and_a_lead_were_seen():
    pace = StepPace()
    pace.completed(StepPace.key("decode", 8), launched_at=0.0, done_at=1.0)
    assert pace.plan_at(StepPace.key("decode", 8), launched_at=1.0) is None  # no lead yet
    pace.lead(0.1)
    assert pace.plan_at(StepPace.key("decode", 8), launched_at=1.0) is not None
    assert pace.plan_at(StepPace.key("decode", 40), launched_at=1.0) is None  # another size
    assert pace.plan_at(StepPace.key("mixed", 8), launched_at=1.0) is None  # another kind
    assert StepPace.key("mixed", 522) == StepPace.key("mixed", 528) != StepPace.key("mixed", 529)


# ----- a stand-in device under the CPU engine -----
class SlowDevice:
    """Each step launched on `runner` ends `seconds` after the later of its launch and the end of the step queued
    before it; its results wait for that end. `spans` holds each launched step's (start, end), in launch order,
    which is the order the engine numbers steps in."""

    def __init__(self, runner, seconds: float = STEP_S) -> None:
        self.run_on_cpu = runner.launch
        self.seconds = seconds
        self.spans: list[tuple[float, float]] = []
        runner.launch = self.launch

    def launch(self, plan, feed=None):
        launched = self.run_on_cpu(plan, feed)
        start = max(time.perf_counter(), self.spans[-1][1] if self.spans else 0.0)
        self.spans.append((start, start + self.seconds))
        return _Later(launched, start + self.seconds)

    def running_at(self, t: float) -> int:
        """The number of the step on the device at `t`."""
        return next(i for i, (start, end) in enumerate(self.spans) if start <= t < end)


class _Later:
    def __init__(self, launched, end: float) -> None:
        self._launched, self._end = launched, end

    def __getattr__(self, name):
        return getattr(self._launched, name)

    def results(self):
        time.sleep(max(0.0, self._end - time.perf_counter()))
        return self._launched.results()


def _slow_engine(make_engine):
    engine = make_engine(async_scheduling="on", kv_cache_tokens=4096)
    return engine, SlowDevice(engine.runner)


def _first_step(engine, request_id: str) -> int:
    (rec,) = [r for r in engine.request_log.read()["requests"] if r["request_id"] == request_id]
    return rec["steps"][0][0]


LONG = SamplingParams(max_tokens=12, ignore_eos=True)
SHORT = SamplingParams(max_tokens=2, ignore_eos=True)


def test_the_engine_delays_the_next_plan_while_the_device_is_busy(make_engine):
    engine, device = _slow_engine(make_engine)
    engine.add_request("a", [5, 6, 7], LONG)
    for _ in range(4):  # the prefill, then decode steps: a decode step's time and a lead are known
        engine.step()
    delay = engine.plan_delay()
    # the step in flight started when the last one ended (the host saw it then) and runs STEP_S: the plan waits for
    # most of that, less the lead (a CPU forward of the tiny model and the scheduler's plan)
    in_flight_end = device.spans[-1][1]
    assert 0 < delay < in_flight_end - time.perf_counter()
    assert delay > STEP_S / 2
    engine.add_request("b", [8, 9], SHORT)
    assert engine.plan_delay() == 0.0  # a request waits: the next step is planned now, with it
    while engine.has_unfinished():
        engine.step()
    assert engine.plan_delay() == 0.0  # nothing in flight


def test_no_delay_without_async_scheduling(make_engine):
    engine = make_engine(async_scheduling="off")
    engine.add_request("a", [5, 6, 7], LONG)
    while engine.has_unfinished():
        engine.step()
        assert engine.plan_delay() == 0.0


def test_the_engine_process_loop_plans_a_new_request_into_the_step_after_the_running_one(make_engine):
    """A request sent while step N runs on the device rides step N+1: the loop waited for it instead of planning
    N+1 at once (which would leave the request N+2)."""
    from infertrace.server.engine_link.messages import FrameReader, ToEngine, decode_from_engine, frame
    from infertrace.server.engine_link.process import EngineLoop

    engine, device = _slow_engine(make_engine)
    ours, theirs = socket.socketpair()
    loop = EngineLoop(engine, _Services(), [theirs])
    thread = threading.Thread(target=loop.run, name="engine-loop", daemon=True)
    thread.start()
    reader = FrameReader()

    def next_step_message():
        while True:
            for body in reader.feed(ours.recv(1 << 16)) or []:
                msg = decode_from_engine(body)
                if msg.kind == "step":
                    return msg

    try:
        ours.sendall(frame(ToEngine("add", request_id="a", prompt=[5, 6, 7], params=LONG)))
        for _ in range(4):
            next_step_message()
        time.sleep(0.02)  # well into the step now running, well before its end
        sent = time.perf_counter()
        ours.sendall(frame(ToEngine("add", request_id="b", prompt=[8, 9], params=SHORT)))
        while not any(d.request_id == "b" and d.finished for d in next_step_message().outputs):
            pass
    finally:
        ours.close()
        thread.join(10)
    assert not thread.is_alive()
    assert _first_step(engine, "b") == device.running_at(sent) + 1


def test_the_in_process_engine_plans_a_new_request_into_the_step_after_the_running_one(make_engine):
    from infertrace.engine.async_engine import AsyncEngine

    engine, device = _slow_engine(make_engine)

    async def main() -> float:
        aeng = AsyncEngine(engine)
        try:
            outputs = aeng.generate("a", [5, 6, 7], LONG)
            for _ in range(4):
                await anext(outputs)
            await asyncio.sleep(0.02)
            sent = time.perf_counter()
            async for _ in aeng.generate("b", [8, 9], SHORT):
                pass
            async for _ in outputs:
                pass
            return sent
        finally:
            await aeng.shutdown()

    sent = asyncio.run(main())
    assert _first_step(engine, "b") == device.running_at(sent) + 1


def test_only_a_wait_for_a_step_s_plan_polls_its_last_stretch(monkeypatch):
    """The loop's wait for a planning deadline polls its last SPIN_S (epoll rounds to whole milliseconds); a wait
    for a silence or farewell deadline sleeps all the way, spending no CPU."""
    from infertrace.server.engine_link import process

    monkeypatch.setattr(process, "SPIN_S", 0.05)  # long enough to tell polling from sleeping in CPU time
    ours, theirs = socket.socketpair()
    loop = process.EngineLoop(None, _Services(), [theirs])
    try:
        spent = {}
        for exact in (False, True):
            cpu, wall = time.thread_time(), time.perf_counter()
            assert loop._select(0.06, exact=exact) == []  # nothing sent: the whole wait runs
            spent[exact] = time.thread_time() - cpu
            assert time.perf_counter() - wall >= 0.06
    finally:
        ours.close()
        theirs.close()
    assert spent[False] < 0.005, spent
    assert spent[True] > 0.01, spent  # most of the 50 ms polled (less only if the thread was held off its core)


class _Services:
    def on_step(self, step) -> None:
        pass
