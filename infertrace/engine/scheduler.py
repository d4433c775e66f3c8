"""Continuous batching: which requests run in the next step, and with how many tokens each.

A step is planned first without touching any state (so that the step can be named for the profiler before it
starts), then applied. Running requests come first, in arrival order, each with its next prefill chunk or its one
decode token; when KV blocks run out, the most recent running request is preempted (its KV is dropped and
recomputed later). Waiting requests are admitted after them while the token budget, the sequence limit and the
free blocks allow, never in a step that had to preempt.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from infertrace.engine.block_manager import BlockManager
from infertrace.engine.config import EngineConfig
from infertrace.engine.sequence import Sequence, SequenceStatus


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens with KV before this step (prefix-cache hits included)
    num_new_tokens: int
    is_prefill: bool

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a token is sampled from its last position."""
        return self.start + self.num_new_tokens == len(self.seq)


@dataclass(slots=True)
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # running requests first, then admitted ones
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # with their prefix-cache hits
    num_cached_tokens: int = 0  # prompt tokens the admitted requests take from the prefix cache

    @property
    def batch_size(self) -> int:
        return len(self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def kind(self) -> StepKind:
        prefill = sum(s.is_prefill for s in self.scheduled)
        if prefill == len(self.scheduled):
            return StepKind.PREFILL
        return StepKind.DECODE if prefill == 0 else StepKind.MIXED


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def plan(self) -> StepPlan:
        """Decide the next step without changing anything."""
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        free = bm.num_free_blocks
        unref: dict[int, int] = {}  # references the planned preemptions drop, per block
        plan = StepPlan()
        running = list(self.running)

        def release(victim: Sequence) -> int:
            freed = 0
            for block_id in victim.block_table:
                unref[block_id] = unref.get(block_id, 0) + 1
                freed += bm.blocks[block_id].ref_count == unref[block_id]
            return freed

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = self._chunk(seq.num_uncomputed_tokens, budget, alone=not plan.scheduled)
            if n == 0:
                i += 1
                continue
            need = bm.num_new_blocks(seq, n)
            while need > free and running[-1] is not seq:
                victim = running.pop()
                plan.preempted.append(victim)
                free += release(victim)
            if need > free:
                running.pop()
                plan.preempted.append(seq)
                free += release(seq)
                break
            free -= need
            budget -= n
            start = seq.num_computed_tokens
            plan.scheduled.append(ScheduledSeq(seq, start, n, n > 1 or start < seq.num_prompt_tokens))
            i += 1

        if plan.preempted:
            return plan
        claimed: set[int] = set()
        for seq in self.waiting:
            if budget <= 0 or len(running) + len(plan.admitted) >= cfg.max_num_seqs:
                break
            hits = bm.match_prefix(seq)
            start = len(hits) * bm.block_size
            n = self._chunk(len(seq) - start, budget, alone=not plan.scheduled)
            if n == 0:
                break
            reclaimed = sum(1 for b in hits if not bm.is_referenced(b) and b not in claimed)
            need = bm.num_new_blocks(seq, n, num_table_blocks=len(hits)) + reclaimed
            if need > free:
                break
            free -= need
            budget -= n
            claimed.update(hits)
            plan.admitted.append((seq, hits))
            plan.num_cached_tokens += start
            plan.scheduled.append(ScheduledSeq(seq, start, n, n > 1 or start < seq.num_prompt_tokens))
        return plan

    def apply(self, plan: StepPlan) -> None:
        """Carry out a plan from `plan()`: preempt, admit, and give every scheduled request its KV slots."""
        bm = self.block_manager
        for victim in plan.preempted:
            self.running.remove(victim)
            bm.free(victim)
            victim.reset_for_recompute()
            self.waiting.appendleft(victim)
        # claim every admitted request's cache hits before allocating, so no allocation evicts a claimed block
        for seq, hits in plan.admitted:
            assert self.waiting[0] is seq
            self.waiting.popleft()
            bm.claim(seq, hits)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = len(hits) * bm.block_size
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        for s in plan.scheduled:
            assert s.seq.num_computed_tokens == s.start
            bm.allocate(s.seq, s.num_new_tokens)

    def schedule(self) -> StepPlan:
        plan = self.plan()
        self.apply(plan)
        return plan

    def update_computed(self, plan: StepPlan) -> None:
        """Record that the planned tokens now have KV, and publish newly full blocks to the prefix cache."""
        for s in plan.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.register_full_blocks(s.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a request: free its blocks now and drop it from the queues."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _chunk(self, remaining: int, budget: int, alone: bool) -> int:
        """Tokens of a request's `remaining` ones that go into this step."""
        cfg = self.config
        if cfg.chunked_prefill:
            n = min(remaining, budget)
            if cfg.long_prefill_token_threshold:
                n = min(n, cfg.long_prefill_token_threshold)
            return n
        # whole prefills only; one larger than the budget runs in a step of its own rather than never
        return remaining if remaining <= budget or alone else 0
