"""Scheduler decisions without a model: budgets, chunking, preemption, admission, abort."""

from __future__ import annotations

from infertrace.engine.block_manager import BlockManager
from infertrace.engine.config import EngineConfig
from infertrace.engine.sampling_params import SamplingParams
from infertrace.engine.scheduler import Scheduler, StepKind
from infertrace.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, **overrides):
    cfg = EngineConfig.from_overrides({"block_size": block_size, **overrides})
    bm = BlockManager(num_blocks, block_size, cfg.prefix_caching)
    return Scheduler(cfg, bm), bm


def add(sched, n, name, start_token=0):
    s = Sequence(name, list(range(start_token, start_token + n)), SamplingParams())
    sched.add(s)
    return s


def step(sched):
    """One scheduler step with a model that always samples token 7."""
    plan = sched.schedule()
    sched.update_computed(plan)
    for s in plan.scheduled:
        if s.samples:
            s.seq.append_token(7)
    return plan


def test_plan_changes_nothing():
    sched, bm = make()
    a = add(sched, 10, "a")
    step(sched)
    add(sched, 9, "b")
    before = (list(sched.running), list(sched.waiting), bm.num_free_blocks, a.num_computed_tokens, list(a.block_table))
    plan = sched.plan()
    assert plan.batch_size == 2
    assert (list(sched.running), list(sched.waiting), bm.num_free_blocks, a.num_computed_tokens, list(a.block_table)) == before


def test_budget_chunks_long_prefills_and_decodes_go_first():
    sched, _ = make(max_num_batched_tokens=8)
    a = add(sched, 3, "a")
    b = add(sched, 20, "b")
    plan = step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 3), ("b", 5)]
    assert plan.kind is StepKind.PREFILL
    plan = step(sched)
    # a decodes (1 token) before b's next chunk (7 tokens)
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 1), ("b", 7)]
    assert plan.kind is StepKind.MIXED and plan.num_tokens == 8
    step(sched)
    assert b.num_computed_tokens == 19 and len(b) == 20
    plan = step(sched)  # b's last prompt token: a token is sampled at last
    assert [s.num_new_tokens for s in plan.scheduled] == [1, 1] and plan.kind is StepKind.MIXED
    assert len(b) == 21
    plan = step(sched)
    assert plan.kind is StepKind.DECODE and plan.num_tokens == 2
    assert a.status is SequenceStatus.RUNNING


def test_long_prefill_threshold_caps_a_prefill_per_step():
    sched, _ = make(max_num_batched_tokens=100, long_prefill_token_threshold=6)
    add(sched, 20, "a")
    add(sched, 20, "b")
    plan = step(sched)
    assert [s.num_new_tokens for s in plan.scheduled] == [6, 6]


def test_max_num_seqs_limits_running():
    sched, _ = make(max_num_seqs=2)
    for i in range(4):
        add(sched, 3, f"s{i}", start_token=10 * i)
    plan = step(sched)
    assert plan.batch_size == 2 and len(sched.running) == 2 and len(sched.waiting) == 2


def test_without_chunking_a_prefill_waits_for_room_or_runs_alone():
    sched, _ = make(chunked_prefill=False, max_num_batched_tokens=8)
    add(sched, 3, "a")
    add(sched, 6, "b")
    plan = step(sched)
    assert [s.seq.request_id for s in plan.scheduled] == ["a"]  # b (6) does not fit beside a (3) in 8
    plan = step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 1), ("b", 6)]
    add(sched, 30, "c", start_token=500)
    plan = step(sched)
    assert "c" not in [s.seq.request_id for s in plan.scheduled]
    sched.finish(sched.running[0], "length")
    sched.finish(sched.running[0], "length")
    plan = step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("c", 30)]


def test_out_of_blocks_preempts_the_latest_request_and_recomputes_it():
    sched, bm = make(num_blocks=6, block_size=4)
    a = add(sched, 7, "a")  # 2 blocks; its 8th position still fits in the second
    b = add(sched, 12, "b", start_token=100)  # 3 blocks
    plan = step(sched)
    assert plan.batch_size == 2 and bm.num_free_blocks == 1
    step(sched)  # b's 13th position takes the last free block
    assert bm.num_free_blocks == 0
    plan = sched.plan()  # a's 9th position needs a block: nothing free, so b (the latest) goes
    assert plan.preempted == [b] and [s.seq for s in plan.scheduled] == [a]
    sched.apply(plan)
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert sched.waiting[0] is b and len(b) == 14  # its generated tokens stay and are recomputed
    sched.update_computed(plan)
    bm.check_consistency(list(sched.running))
    # once a finishes, b comes back: its three full blocks are still cached, the rest is recomputed
    sched.finish(a, "length")
    plan = step(sched)
    assert [s.seq for s in plan.scheduled] == [b]
    assert (plan.scheduled[0].start, plan.scheduled[0].num_new_tokens) == (12, 2) and plan.num_cached_tokens == 12


def test_a_request_preempts_itself_when_it_is_the_latest():
    sched, bm = make(num_blocks=4, block_size=4)
    a = add(sched, 4, "a")
    b = add(sched, 8, "b", start_token=50)
    step(sched)  # a: 1 block, b: 2 blocks
    step(sched)  # a's 5th token: a second block (the last); b's 9th token: no block left -> b preempts itself
    assert b.status is SequenceStatus.WAITING and a.status is SequenceStatus.RUNNING
    bm.check_consistency([a])


def test_finish_frees_blocks_of_waiting_and_running_requests():
    sched, bm = make()
    a = add(sched, 9, "a")
    step(sched)
    b = add(sched, 9, "b", start_token=50)
    sched.finish(b, "abort")
    sched.finish(a, "abort")
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks
    assert a.finish_reason == "abort" and a.is_finished
