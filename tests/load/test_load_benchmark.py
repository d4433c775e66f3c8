"""load/benchmark.py: every dataset is one shaped load (make_load), and the profiled window is a context manager
that stops the profiler however the measured block ends."""

from __future__ import annotations

import asyncio
import math

import pytest

from infertrace.load.benchmark import Hooks, make_load, profiled_window
from infertrace.load.client.timing import TargetError
from infertrace.load.clock import ScriptedClock
from infertrace.load.config import BenchConfig
from infertrace.load.observe.observer import Observed
from infertrace.load.workloads.conversation import ConversationLoad
from infertrace.load.workloads.prompts import PromptLoad, numbered_cycle
from infertrace.load.workloads.replay import TraceReplay


class ProfiledTarget:
    def __init__(self, clock: ScriptedClock, stop_error: bool = False) -> None:
        self.clock = clock
        self.stop_error = stop_error
        self.calls: list[tuple[str, float]] = []

    async def start_profile(self, steps):
        self.calls.append(("start", self.clock.now()))
        return {"notes": ["CPU only"]}

    async def stop_profile(self):
        self.calls.append(("stop", self.clock.now()))
        if self.stop_error:
            raise TargetError("POST /stop_profile: HTTP 500")
        return 200, {"trace_files": ["/t/a.json.gz"]}


def _window(cfg, target, clock, on=True):
    infos: list[str] = []
    observed = Observed(origin=0.0)
    return profiled_window(cfg, target, clock, Hooks(on_info=infos.append), observed, on), observed, infos


async def test_the_profiled_window_wraps_the_block_and_marks_it():
    clock = ScriptedClock(10.0)
    target = ProfiledTarget(clock)
    window, observed, infos = _window(BenchConfig(base_url="http://x", profile_steps=5), target, clock)
    async with window as profile:
        assert target.calls == [("start", 10.0)]
        clock.advance(2.5)
    assert target.calls == [("start", 10.0), ("stop", 12.5)]
    assert observed.profile_window == (10.0, 12.5)
    assert profile["num_steps"] == 5 and profile["trace_files"] == ["/t/a.json.gz"] and profile["stop_status"] == 200
    assert infos == ["profiler started for 5 steps", "note: CPU only", "profiler stopped: 1 trace file(s)"]


async def test_the_profiler_is_stopped_when_the_block_fails_and_a_failed_stop_is_kept():
    clock = ScriptedClock()
    target = ProfiledTarget(clock, stop_error=True)
    window, observed, _ = _window(BenchConfig(base_url="http://x", profile=True), target, clock)
    with pytest.raises(asyncio.CancelledError):
        async with window as profile:
            clock.advance(1.0)
            raise asyncio.CancelledError
    assert [c for c, _ in target.calls] == ["start", "stop"]
    assert profile["stop_status"] is None and "HTTP 500" in profile["stop_response"] and profile["trace_files"] == []
    assert observed.profile_window == (0.0, 1.0)


async def test_no_profiler_call_when_off():
    clock = ScriptedClock()
    target = ProfiledTarget(clock)
    window, observed, infos = _window(BenchConfig(base_url="http://x", profile=True), target, clock, on=False)
    async with window as profile:
        pass
    assert profile is None and target.calls == [] and observed.profile_window is None and infos == []


class RecordingRunner:
    """Runner-shaped: records which loop a load asked for, with what."""

    def __init__(self) -> None:
        self.calls = []

    async def open_loop(self, specs, offsets, concurrency=None):
        self.calls.append(("open", specs, list(offsets), concurrency))

    async def closed_loop(self, specs, concurrency, deadline=None):
        self.calls.append(("closed", specs, concurrency, deadline))


def _phase(cfg: BenchConfig, window: float | None = None):
    load = make_load(cfg, None)
    runner = RecordingRunner()
    clock = ScriptedClock(100.0)
    asyncio.run(load.phase(runner, clock, window))
    (call,) = runner.calls
    return load, call


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"prompt": "p{i}", "max_tokens": 3}}\n' for i in range(4)))
    return str(path)


def test_prompt_datasets_are_a_shaped_load_in_every_loop(jsonl):
    base = {"dataset": "jsonl", "dataset_path": jsonl, "num_prompts": 4}
    load, (kind, specs, users, deadline) = _phase(BenchConfig(**base, concurrency=3))
    assert isinstance(load, PromptLoad) and not load.reads_prefix_cache and load.figures([], None) == {}
    assert (kind, users, deadline, load.total) == ("closed", 3, None, 4) and specs is load.specs
    assert [s.prompt for s in load.warmup_specs(2)] == ["p0", "p1"]

    load, (kind, specs, users, deadline) = _phase(BenchConfig(**base, duration_s=5.0), window=5.0)
    assert kind == "closed" and isinstance(specs, numbered_cycle) and deadline == 105.0 and load.total is None

    load, (kind, specs, offsets, cap) = _phase(BenchConfig(**base, request_rate=math.inf))
    assert kind == "open" and offsets == [0.0] * 4 and cap is None

    load, (kind, specs, offsets, cap) = _phase(BenchConfig(**base, ramp_up_strategy="linear", ramp_up_start_rps=1.0,
                                                           ramp_up_end_rps=4.0, concurrency=2))
    assert kind == "open" and specs is load.specs and len(offsets) == 4 and offsets == sorted(offsets) and cap == 2


def test_every_dataset_makes_a_load_of_one_shape(jsonl, tmp_path, tiny_model_dir):
    from infertrace.load.client.targets import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 8, "output_length": 2, "hash_ids": [1]}\n')
    chats = tmp_path / "s.json"
    chats.write_text('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]')
    loads = [make_load(BenchConfig(dataset="jsonl", dataset_path=jsonl), tokenizer),
             make_load(BenchConfig(dataset="trace", dataset_path=str(trace), base_url="http://x"), tokenizer),
             make_load(BenchConfig(dataset="conversation", dataset_path=str(chats), num_prompts=1), tokenizer)]
    assert [type(load) for load in loads] == [PromptLoad, TraceReplay, ConversationLoad]
    assert [load.reads_prefix_cache for load in loads] == [False, True, True]
    for load in loads:
        assert len(load.warmup_specs(1)) == 1
