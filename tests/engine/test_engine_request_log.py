"""The request log: each request's arrival, the steps it rode with its tokens in each, preemptions, first token
and end, as the engine ran them; bounded; the step numbers are the profiler ranges' `#N`."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from infertrace.engine import SamplingParams
from infertrace.engine.request_log import RequestLog
from infertrace.server.frontend.request_log import MAX_PAGE_BYTES

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


class _Plan:  # the scheduler's StepPlan, as much of it as the log reads
    def __init__(self, request_ids, prompts=()):
        """Decode rows of `request_ids`, then a prefill row of each (request id, prompt tokens) in `prompts`."""
        self.scheduled = [_Row(request_id) for request_id in request_ids]
        self.scheduled += [_Row(request_id, tokens, True) for request_id, tokens in prompts]
        self.preempted = []
        self.kind = type("K", (), {"value": "decode"})


class _Row:
    def __init__(self, request_id, tokens=1, prefill=False):
        self.seq = SimpleNamespace(request_id=request_id)
        self.num_new_tokens, self.is_prefill = tokens, prefill


def test_the_log_is_bounded_and_reads_from_a_cursor():
    log = RequestLog(max_requests=3, max_step_rows=4)
    for i in range(5):
        log.arrived(f"q{i}", float(i), 10, 0, 0)
        log.step(i, _Plan([f"q{i}", f"q{max(0, i - 1)}"]), i + 0.5, 0.1, [7, 7])
    out = log.read()
    assert [r["request_id"] for r in out["requests"]] == ["q2", "q3", "q4"]  # the last three requests
    assert [s["step"] for s in out["steps"]] == [3, 4]  # the last four rows
    assert out["next"] == 5 and out["oldest"] == 2
    assert not out["requests"][0]["steps_complete"] and out["requests"][2]["steps_complete"]
    assert [r["request_id"] for r in log.read(since=4)["requests"]] == ["q4"]
    assert log.read(since=5)["requests"] == []
    # a page cut by its limit says where the next one starts; an empty page gives the log's end
    page = log.read(since=2, limit=1)
    assert [r["seq"] for r in page["requests"]] == [2] and page["next"] == 3
    assert log.read(limit=0)["next"] == 5 == log.read(since=10**30)["next"]


def _finished_log(n: int, steps_each: int, batch: int = 1) -> RequestLog:
    """`n` requests one after another, each riding `steps_each` steps (with `batch - 1` rows of others)."""
    log = RequestLog(max_requests=n)
    number = 0
    for i in range(n):
        t = i * (steps_each * 0.1 + 1.0)  # one after another: no step of one in the span of the next
        log.arrived(f"r{i}", t, 8, 0, 0)
        for k in range(steps_each):
            log.step(number, _Plan([f"r{i}"] + [f"other{j}" for j in range(batch - 1)]), t + k * 0.1 + 0.01, 0.05,
                     [1] * batch)
            number += 1
        log.finished(f"r{i}", t + steps_each * 0.1, "length", steps_each, 0, step=number - 1)
    return log


class _Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"the read touched a request it does not return (.{name})")


def test_a_read_touches_only_the_requests_and_steps_it_returns():
    log = _finished_log(1000, steps_each=3)
    for seq in range(1000):  # every request but one: a read that scans the log trips on them
        if seq != 500:
            log._ring[seq] = _Untouchable()
    cursor = log.read(limit=0)
    assert (cursor["requests"], cursor["steps"], cursor["next"]) == ([], [], 1000)
    page = log.read(since=500, limit=1)
    [rec] = page["requests"]
    assert rec["request_id"] == "r500" and page["next"] == 501
    assert [s["step"] for s in page["steps"]] == [1500, 1501, 1502]  # its own steps, not every later one
    assert [row[0] for row in rec["steps"]] == [1500, 1501, 1502]


@pytest.mark.parametrize("batch", [1, 16])
def test_pages_are_bounded_in_bytes_and_following_next_reads_every_request_once(batch):
    log = _finished_log(60, steps_each=20, batch=batch)
    whole = log.read()
    max_bytes = 40_000
    seen, since, pages = [], 0, 0
    while True:
        page = log.read(since=since, limit=1000, max_bytes=max_bytes)
        if not page["requests"]:
            break
        pages += 1
        assert len(json.dumps({"requests": page["requests"], "steps": page["steps"]})) <= max_bytes
        seen += page["requests"]
        assert page["next"] == page["requests"][-1]["seq"] + 1
        since = page["next"]
    assert pages > 3
    assert [r["seq"] for r in seen] == list(range(60))
    assert [r["steps"] for r in seen] == [r["steps"] for r in whole["requests"]]  # each request whole
    # a bound below one request still gives one a page, so a reader always moves on
    tiny = log.read(since=7, max_bytes=1)
    assert [r["seq"] for r in tiny["requests"]] == [7] and tiny["next"] == 8


def test_a_request_whose_own_steps_pass_the_bound_has_them_cut_there():
    log = _finished_log(3, steps_each=400, batch=8)
    whole = log.read(since=1, limit=1)
    assert whole["requests"][0]["steps_complete"] and len(whole["steps"]) == 400
    page = log.read(since=1, limit=1, max_bytes=30_000)
    [rec] = page["requests"]
    assert len(json.dumps({"requests": page["requests"], "steps": page["steps"]})) <= 30_000
    assert 0 < len(page["steps"]) < 400 and page["next"] == 2
    assert not rec["steps_complete"]  # the reader knows its list is short
    assert rec["steps"] == whole["requests"][0]["steps"][:len(page["steps"])]


def test_requests_are_logged_under_their_engine_id_and_read_with_their_label():
    log = RequestLog(max_requests=10)
    log.arrived("0/same", 1.0, 4, 0, 0, label="same")
    log.arrived("1/same", 1.5, 4, 0, 0, label="same")
    log.step(0, _Plan(["0/same", "1/same"]), 2.0, 0.1, [5, None])
    log.step(1, _Plan(["1/same"]), 2.2, 0.1, [5])
    log.finished("0/same", 2.15, "length", 1, 0, step=0)
    log.stamp("1/same", {"sent": 3.0})
    a, b = log.read()["requests"]
    assert a["request_id"] == b["request_id"] == "same"
    assert [row[0] for row in a["steps"]] == [0] and [row[0] for row in b["steps"]] == [0, 1]
    assert (a["finish_reason"], b["finish_reason"], a["sent"], b["sent"]) == ("length", None, None, 3.0)


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


def test_each_kind_of_step_is_logged_with_its_plans_kind_and_rows():
    """The scheduler's own plans: prefill, mixed and decode steps (a decode step's rows are kept as one shared
    record per batch size), a decode row that sampled nothing, and rows whose tokens differ."""
    from infertrace.engine.sampling_params import SamplingParams as Params
    from infertrace.engine.scheduler import ScheduledSeq, StepPlan
    from infertrace.engine.sequence import Sequence

    seqs = {name: Sequence(name, [1] * 40, Params(max_tokens=8)) for name in ("a", "b", "c")}
    steps = [  # (plan rows as (request, tokens, prefill), sampled)
        ([("a", 32, True), ("b", 40, True)], [None, 5]),
        ([("a", 8, True), ("b", 1, False)], [6, 7]),
        ([("a", 1, False), ("b", 1, False)], [8, 9]),
        ([("a", 1, False), ("b", 1, False), ("c", 1, False)], [3, None, 4]),
        ([("a", 1, False), ("b", 1, False)], [1, 2]),
    ]
    log = RequestLog(max_requests=10)
    for name in seqs:
        log.arrived(name, 0.0, 40, 0, 0)
    for number, (rows, sampled) in enumerate(steps):
        plan = StepPlan(scheduled=[ScheduledSeq(seqs[r], 0, n, p) for r, n, p in rows])
        log.step(number, plan, 1.0 + number, 0.5, sampled)
        assert log.read()["steps"][-1]["kind"] == plan.kind.value
    out = log.read()
    assert [s["kind"] for s in out["steps"]] == ["prefill", "mixed", "decode", "decode", "decode"]
    assert [(s["batch_size"], s["num_tokens"], s["prefill_tokens"], s["prefill_rows"]) for s in out["steps"]] == [
        (2, 72, 72, 2), (2, 9, 8, 1), (2, 2, 0, 0), (3, 3, 0, 0), (2, 2, 0, 0)]
    for rec in out["requests"]:
        expected = [[number, n, int(p), int(sampled[i] is not None)]
                    for number, (rows, sampled) in enumerate(steps)
                    for i, (r, n, p) in enumerate(rows) if r == rec["request_id"]]
        assert rec["steps"] == expected


def test_the_collector_does_not_walk_the_ring():
    """A full ring holds 100,000 requests and their steps: a full collection of the engine process must not walk
    them (tens of ms a collection, a pause of the step loop)."""
    import gc

    log = RequestLog(max_requests=50)
    for i in range(60):
        log.arrived(f"q{i}", float(i), 10, 0, 0)
        log.stamp(f"q{i}", {"received": 0.5, "sent": 2.0})
        log.step(i, _Plan([f"q{i}", f"q{max(0, i - 1)}"]), i + 0.5, 0.1, [7, None])
        if i % 7 == 0:
            log.preempted([f"q{i}"], i)
        log.finished(f"q{i}", i + 0.7, "length", 1, 0, step=i)
    gc.collect()
    records = [*log._ring, *log._steps[log._head:]]
    held = [x for r in log._ring for x in (r.stamps, r.preempted)]
    held += [x for st in log._steps[log._head:] for x in (st.ids, st.tokens, st.prefill, st.sampled)]
    assert not [x for x in records + held if gc.is_tracked(x)]
    assert log.read(since=14, limit=1)["requests"][0]["preempted"] == [14]


def saturated_log(streams=256, requests=1024, prompt=512, out=128, budget=8192):
    """A closed loop at saturation, as one GPU serves a small model: `streams` requests at once, each replaced as it
    ends, so every step carries a row of each and a request spans out+ steps of `streams` rows; new prompts ride
    mixed steps, up to `budget` tokens a step. Returns the log and, per request id, its arrival and the end of each
    step that sampled a token of it (the first one its first token)."""
    log = RequestLog(max_requests=requests)
    waiting, running, ends = [], {}, {}
    t, number, arrived = 0.0, 0, 0

    def arrive():
        nonlocal arrived
        rid = f"req-{arrived}"
        log.arrived(rid, t, prompt, len(waiting), len(running))
        log.stamp(rid, {"received": t - 0.002, "tokenized": t - 0.001})
        waiting.append(rid)
        ends[rid] = (t, [])
        arrived += 1

    for _ in range(streams):
        arrive()
    while waiting or running:
        decoding = list(running)
        starting = waiting[:max(0, (budget - len(decoding)) // prompt)]
        del waiting[:len(starting)]
        running.update((rid, 0) for rid in starting)
        rows = len(decoding) + len(starting)
        duration = 0.004 + 1e-6 * (len(decoding) + prompt * len(starting))
        log.step(number, _Plan(decoding, [(rid, prompt) for rid in starting]), t, duration, [7] * rows)
        t += duration
        for rid in [*decoding, *starting]:
            running[rid] += 1
            ends[rid][1].append(t)
            if running[rid] == 1:
                log.stamp(rid, {"first_output": t + 0.0005})
            if running[rid] == out:
                del running[rid]
                log.finished(rid, t, "length", out, 0, step=number)
                log.stamp(rid, {"sent": t + 0.001})
                if arrived < requests:
                    arrive()
        number += 1
    return log, ends


def read_pages(log, max_bytes=MAX_PAGE_BYTES):
    """Every page from the start, following `next`, as the front end reads them."""
    pages, since = [], 0
    while (page := log.read(since=since, limit=1000, max_bytes=max_bytes))["requests"]:
        pages.append(page)
        since = page["next"]
    return pages


def test_at_saturation_a_page_holds_many_whole_requests():
    """At saturation a request's span is a few hundred steps of 256 rows each: the page's bound counts what it
    sends (each request's own rows), so every request comes whole, many a page."""
    log, _ = saturated_log()
    whole = log.read()["requests"]
    assert min(len(r["steps"]) for r in whole) == 128 and len(log.read()["steps"]) > 500
    pages = read_pages(log)
    for page in pages:
        assert len(json.dumps({"requests": page["requests"], "steps": page["steps"]})) <= MAX_PAGE_BYTES
    got = [r for page in pages for r in page["requests"]]
    assert [r["seq"] for r in got] == list(range(1024))
    assert all(r["steps_complete"] for r in got)
    assert [r["steps"] for r in got] == [r["steps"] for r in whole]
    assert len(pages) < 20  # about 200 requests a page, not one
