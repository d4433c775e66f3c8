"""Continuous batching: which requests run in the next step, and with how many tokens each.

A step is planned first without touching any state (so that the step can be named for the profiler before it
starts), then applied. Running requests come first, in arrival order, each with its next prefill chunk or its one
decode token; when KV blocks run out, the most recent running request is preempted (its KV is dropped and
recomputed later). Waiting requests are admitted after them while the token budget, the sequence limit and the
free blocks allow, never in a step that had to preempt.

With a host tier of the prefix cache, an admitted request's leading blocks that miss on the device are looked up
there next; hits get fresh device blocks and a load into them (`StepPlan.loads`) that runs before the forward.
With long-context offload, a request whose KV cannot fit the device pool runs in steps of its own (one such
request at a time), alternating with the steps of the others; its KV lives in host memory.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from infertrace.engine.block_manager import BlockManager
from infertrace.engine.config import EngineConfig
from infertrace.engine.sequence import Sequence, SequenceStatus


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"
    VERIFY = "verify"  # decodes only, some with draft tokens to verify


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # tokens with KV before this step (prefix-cache hits included)
    num_new_tokens: int  # draft tokens included
    is_prefill: bool
    num_draft_tokens: int = 0  # the first this many of seq.spec_token_ids, after its last token: verified here

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a token is sampled from its last position (and,
        with drafts, one from each draft's position)."""
        return self.start + self.num_new_tokens - self.num_draft_tokens == len(self.seq)


class HostPrefixTier(Protocol):
    def match(self, seq: Sequence, first_block: int) -> list[int]: ...
    def pin(self, host_ids: list[int]) -> None: ...


class LongContextPolicy(Protocol):
    def wants(self, seq: Sequence) -> bool: ...
    def can_admit(self, seq: Sequence) -> bool: ...
    def admit(self, seq: Sequence) -> None: ...
    def release(self, seq: Sequence) -> None: ...


@dataclass(slots=True)
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # running requests first, then admitted ones
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # with their prefix-cache hits
    num_cached_tokens: int = 0  # prompt tokens the admitted requests take from the prefix cache
    host_hits: list[list[int]] = field(default_factory=list)  # per admitted request: host-tier blocks after its hits
    num_cpu_cached_tokens: int = 0  # prompt tokens the admitted requests take from the host tier
    num_recomputed_tokens: int = 0  # prompt tokens to compute again although their KV was computed once
    long: bool = False  # a step of the long-context request, whose KV lives in host memory
    loads: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (host blocks, device blocks), by apply()

    @property
    def batch_size(self) -> int:
        return len(self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def verifies(self) -> bool:
        """Whether a request verifies draft tokens in this step (a verify step, or a mixed step with prefills)."""
        return any(s.num_draft_tokens for s in self.scheduled)

    @property
    def kind(self) -> StepKind:
        prefill = sum(s.is_prefill for s in self.scheduled)
        if prefill == len(self.scheduled):
            return StepKind.PREFILL
        if prefill:
            return StepKind.MIXED
        return StepKind.VERIFY if self.verifies else StepKind.DECODE


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        prefix_tier: HostPrefixTier | None = None,
        long_context: LongContextPolicy | None = None,
    ):
        self.config = config
        self.block_manager = block_manager
        self.prefix_tier = prefix_tier
        self.long_context = long_context
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self._preempted_tokens: dict[Sequence, int] = {}  # tokens a preempted request had computed
        self._long_turn = False  # whether the next step goes to the long-context request

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def plan(self) -> StepPlan:
        """Decide the next step without changing anything."""
        if self.long_context is not None:
            long_plan = self._plan_long()
            if long_plan is not None and (self._long_turn or not self._has_resident_work()):
                return long_plan
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        free = bm.num_free_blocks
        unref: dict[int, int] = {}  # references the planned preemptions drop, per block
        plan = StepPlan()
        running = [s for s in self.running if not self._is_long(s)]
        num_long = len(self.running) - len(running)

        def release(victim: Sequence) -> int:
            freed = 0
            for block_id in victim.block_table:
                unref[block_id] = unref.get(block_id, 0) + 1
                freed += bm.blocks[block_id].ref_count == unref[block_id]
            return freed

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            # a decode with drafts: its last token and as many drafts as the budget takes, whatever the chunking
            drafts = len(seq.spec_token_ids) if seq.num_uncomputed_tokens == 1 else 0
            if drafts:
                n = min(1 + drafts, budget)
            else:
                n = self._chunk(seq.num_uncomputed_tokens, budget, alone=not plan.scheduled)
            if n == 0:
                i += 1
                continue
            need = bm.num_new_blocks(seq, n)
            if drafts and need > free:  # drafts never cost another request its KV: the plain decode instead
                n, drafts = 1, 0
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
            if drafts:
                plan.scheduled.append(ScheduledSeq(seq, start, n, False, n - 1))
            else:
                plan.scheduled.append(ScheduledSeq(seq, start, n, n > 1 or start < seq.num_prompt_tokens))
            i += 1

        if plan.preempted:
            return plan
        claimed: set[int] = set()
        for seq in self.waiting:
            if budget <= 0 or len(running) + num_long + len(plan.admitted) >= cfg.max_num_seqs:
                break
            if self._is_long(seq):
                break  # first come, first served: it is admitted by a long-context step
            hits = bm.match_prefix(seq)
            host_hits = self.prefix_tier.match(seq, len(hits)) if self.prefix_tier is not None else []
            start = (len(hits) + len(host_hits)) * bm.block_size
            n = self._chunk(len(seq) - start, budget, alone=not plan.scheduled)
            if n == 0:
                break
            reclaimed = sum(1 for b in hits if not bm.is_referenced(b) and b not in claimed)
            loaded = len(host_hits) * bm.block_size
            need = bm.num_new_blocks(seq, loaded + n, num_table_blocks=len(hits)) + reclaimed
            if need > free:
                break
            free -= need
            budget -= n
            claimed.update(hits)
            plan.admitted.append((seq, hits))
            plan.host_hits.append(host_hits)
            plan.num_cached_tokens += len(hits) * bm.block_size
            plan.num_cpu_cached_tokens += loaded
            # tokens computed once already: before a preemption, or in blocks every tier has dropped since
            dropped = bm.num_dropped_blocks(seq, len(hits) + len(host_hits)) * bm.block_size
            plan.num_recomputed_tokens += max(self._preempted_tokens.get(seq, 0) - start, dropped, 0)
            plan.scheduled.append(ScheduledSeq(seq, start, n, n > 1 or start < seq.num_prompt_tokens))
        return plan

    def apply(self, plan: StepPlan) -> None:
        """Carry out a plan from `plan()`: preempt, admit, and give every scheduled request its KV slots."""
        bm = self.block_manager
        for victim in plan.preempted:
            self._preempted_tokens[victim] = max(victim.num_computed_tokens, self._preempted_tokens.get(victim, 0))
            self.running.remove(victim)
            bm.free(victim)
            victim.reset_for_recompute()
            self.waiting.appendleft(victim)
        # claim every admitted request's cache hits before allocating, so no allocation evicts a claimed block
        host_hits = plan.host_hits or [[] for _ in plan.admitted]
        for (seq, hits), loaded in zip(plan.admitted, host_hits, strict=True):
            assert self.waiting[0] is seq
            self.waiting.popleft()
            bm.claim(seq, hits)
            if plan.long:
                self.long_context.admit(seq)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = (len(hits) + len(loaded)) * bm.block_size
            self._preempted_tokens.pop(seq, None)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        # host-tier hits get device blocks now (after every claim) and count as computed: the load precedes the forward
        for (seq, _), loaded in zip(plan.admitted, host_hits):
            if loaded:
                self.prefix_tier.pin(loaded)
                bm.allocate(seq, len(loaded) * bm.block_size)
                plan.loads.append((loaded, seq.block_table[-len(loaded) :]))
                seq.num_computed_tokens += len(loaded) * bm.block_size
        for s in plan.scheduled:
            assert s.seq.num_computed_tokens == s.start
            if not plan.long:
                bm.allocate(s.seq, s.num_new_tokens)
        if self.long_context is not None:
            self._long_turn = not plan.long

    def schedule(self) -> StepPlan:
        plan = self.plan()
        self.apply(plan)
        return plan

    def update_computed(self, plan: StepPlan) -> list[tuple[int, int, tuple[int, ...]]]:
        """Record that the planned tokens now have KV, and publish newly full blocks to the prefix cache.

        Returns the newly published blocks as (block id, hash, tokens).
        """
        published = []
        for s in plan.scheduled:
            if s.seq.is_finished:
                continue  # ended (stopped or aborted) while this step ran: its blocks are gone
            s.seq.num_computed_tokens += s.num_new_tokens
            if not plan.long:
                published += self.block_manager.register_full_blocks(s.seq)
        return published

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a request: free its blocks now and drop it from the queues."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        if self.long_context is not None:
            self.long_context.release(seq)
        self._preempted_tokens.pop(seq, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _is_long(self, seq: Sequence) -> bool:
        return self.long_context is not None and self.long_context.wants(seq)

    def _has_resident_work(self) -> bool:
        """Whether a request other than the long-context one could run a step."""
        if any(not self._is_long(s) for s in self.running):
            return True
        return bool(self.waiting) and not self._is_long(self.waiting[0])

    def _plan_long(self) -> StepPlan | None:
        """The long-context request's next chunk (admitting it first when it waits at the head), or None."""
        cfg = self.config
        seq = next((s for s in self.running if self._is_long(s)), None)
        if seq is None:
            if not (self.waiting and self._is_long(self.waiting[0]) and len(self.running) < cfg.max_num_seqs):
                return None
            seq = self.waiting[0]
            if not self.long_context.can_admit(seq):
                return None
            plan = StepPlan(admitted=[(seq, [])], host_hits=[[]], long=True)
        else:
            plan = StepPlan(long=True)
        start = seq.num_computed_tokens
        # always chunked: the chunk's own attention is computed whole
        n = min(len(seq) - start, cfg.max_num_batched_tokens, cfg.long_prefill_token_threshold or len(seq))
        plan.scheduled.append(ScheduledSeq(seq, start, n, n > 1 or start < seq.num_prompt_tokens))
        return plan

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
