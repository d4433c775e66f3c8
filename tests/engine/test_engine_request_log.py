"""The request log: each request's arrival, the steps it rode with its tokens in each, preemptions, first token
and end, as the engine ran them; bounded; the step numbers are the profiler ranges' `#N`."""

from __future__ import annotations

import json
import re

import pytest
import torch

from infertrace.engine import SamplingParams
from infertrace.engine.request_log import RequestLog

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def run(engine, prompts, params=GREEDY):
    """Step to completion; each request's output count, and every completed step's StepStats."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    steps = []
    while engine.has_unfinished():
        before = engine.counters["steps"]
        engine.step()
        if engine.counters["steps"] != before:
            steps.append(engine.last_step)
    return steps


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_every_request_has_its_steps_tokens_and_end(make_engine, make_prompts, async_scheduling):
    engine = make_engine(kv_cache_tokens=4096, max_num_batched_tokens=48, max_num_seqs=3,
                         async_scheduling=async_scheduling)
    prompts = make_prompts([30, 70, 12, 9, 40], seed=5)
    steps = run(engine, prompts)
    log = engine.request_log.read()
    assert [r["request_id"] for r in log["requests"]] == [f"r{i}" for i in range(5)]
    by_number = {s["step"]: s for s in log["steps"]}
    assert sorted(by_number) == [s.index for s in steps]  # every step, numbered as StepStats numbers them
    for stats in steps:
        row = by_number[stats.index]
        assert (row["kind"], row["batch_size"], row["num_tokens"]) == (stats.kind, stats.batch_size,
                                                                        stats.num_tokens)
        assert row["prefill_tokens"] == stats.num_prefill_tokens
    for rec, prompt in zip(log["requests"], prompts):
        rode = rec["steps"]
        prefill = [r for r in rode if r[2]]
        assert sum(r[1] for r in prefill) == len(prompt)  # its prompt, chunk by chunk, no preemption here
        assert sum(r[3] for r in rode) == GREEDY.max_tokens  # one sampled row per output token
        assert rec["finish_reason"] == "length" and rec["output_tokens"] == GREEDY.max_tokens
        assert rec["finish_step"] == rode[-1][0]
        last = by_number[rec["finish_step"]]
        assert rec["arrival"] <= by_number[rode[0][0]]["start"] <= last["start"] <= rec["finished"]
        assert rec["steps_complete"] and rec["preempted"] == []
    # requests added together: each saw the ones before it waiting
    assert [r["waiting_ahead"] for r in log["requests"]] == [0, 1, 2, 3, 4]
    json.dumps(log)  # plain data, as the server sends it


def test_preemption_is_logged_and_the_recompute_rides_later_steps(make_engine, make_prompts):
    engine = make_engine(kv_cache_tokens=128, block_size=8, max_num_batched_tokens=64, max_num_seqs=6)
    prompts = make_prompts([40, 40, 40], seed=9)
    run(engine, prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    assert engine.counters["preemptions"] > 0
    log = engine.request_log.read()
    victims = [r for r in log["requests"] if r["preempted"]]
    assert victims
    for rec in victims:
        after = [r for r in rec["steps"] if r[0] > rec["preempted"][0]]
        assert after and after[0][2] == 1  # it came back with a prefill that recomputes its KV


def test_profiler_step_ranges_carry_the_log_step_numbers(make_engine, make_prompts):
    engine = make_engine(kv_cache_tokens=4096, max_num_batched_tokens=32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(engine, make_prompts([6, 50], seed=31), SamplingParams(max_tokens=3, ignore_eos=True))
    names = [e.name for e in prof.events() if e.name.startswith("step[")]
    numbers = [int(re.search(r" #(\d+)\]$", n).group(1)) for n in names]
    assert sorted(numbers) == [s["step"] for s in engine.request_log.read()["steps"]]


def test_the_log_is_bounded_and_reads_from_a_cursor():
    class Plan:  # the scheduler's StepPlan, as much of it as the log reads
        def __init__(self, rows):
            self.scheduled = rows
            self.preempted = []
            self.kind = type("K", (), {"value": "decode"})

    class Row:
        def __init__(self, request_id):
            self.seq = type("S", (), {"request_id": request_id})
            self.num_new_tokens, self.is_prefill = 1, False

    log = RequestLog(max_requests=3, max_step_rows=4)
    for i in range(5):
        log.arrived(f"q{i}", float(i), 10, 0, 0)
        log.step(i, Plan([Row(f"q{i}"), Row(f"q{max(0, i - 1)}")]), i + 0.5, 0.1, [7, 7])
    out = log.read()
    assert [r["request_id"] for r in out["requests"]] == ["q2", "q3", "q4"]  # the last three requests
    assert [s["step"] for s in out["steps"]] == [3, 4]  # the last four rows
    assert out["next"] == 5 and out["oldest"] == 2
    assert not out["requests"][0]["steps_complete"] and out["requests"][2]["steps_complete"]
    assert [r["request_id"] for r in log.read(since=4)["requests"]] == ["q4"]
    assert log.read(since=5)["requests"] == []


def test_front_end_stamps_wait_for_their_request_and_stay_bounded():
    log = RequestLog(max_requests=10)
    log.stamp("early", {"received": 1.0, "tokenized": 1.5, "bogus": 3.0})
    log.arrived("early", 2.0, 5, 0, 0)
    log.stamp("early", {"sent": 9.0})
    rec = log.read()["requests"][0]
    assert (rec["received"], rec["tokenized"], rec["sent"]) == (1.0, 1.5, 9.0)
    assert "bogus" not in rec
    for i in range(5000):  # stamps of requests that never arrive (refused) do not pile up
        log.stamp(f"never{i}", {"received": 0.0})
    assert len(log._pending) <= 4096


def test_off_when_sized_zero(make_engine):
    assert make_engine(kv_cache_tokens=1024, request_log_size=0).request_log is None
