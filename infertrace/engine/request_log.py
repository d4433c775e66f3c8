"""Every request's life on the engine's clock: when it arrived and with how many ahead of it, each step it rode
(with its tokens in it), preemptions, its first token and its end. Always on and bounded.

The hot path keeps one compact record per step (its number, kind, start, duration, and per row the request id,
its tokens and two flags) in a ring bounded by rows, and one small record per request in a ring bounded by
requests; `read` derives each request's steps from the step ring when asked. Times are `time.perf_counter()`
seconds of this host (CLOCK_MONOTONIC on Linux, shared by every process of the host), so the front end's stamps
(received, tokenized, first output, sent) sit on the same clock as the steps.
"""

from __future__ import annotations

import bisect
import time
from itertools import compress
from typing import Any

import msgspec

# The defaults bound memory to a few tens of MB: a row is an id reference, a token count and a flag byte.
DEFAULT_MAX_STEP_ROWS = 1_000_000
PENDING_STAMPS = 4096  # front-end stamps of requests the log has not seen arrive (refused ones), kept at most
FRONTEND_STAMPS = ("received", "tokenized", "first_output", "sent")
# Upper bounds of the JSON of a read's parts, for its byte bound: a request without its step rows (its client's id
# up to 128 characters, ten numbers of up to 20 characters), a step, and one of a request's rows (at most one per
# step of its span). Other requests' rows in those steps are not sent, and the read finds its own among them at C
# speed, so they cost neither bytes nor Python time: at saturation a request's span holds a few hundred steps of
# 256 rows each, and counting those rows too left room for about one request a page, with its steps cut.
REQUEST_JSON_BYTES = 720
STEP_JSON_BYTES = 300
ROW_JSON_BYTES = 32
DRAFT_JSON_BYTES = 28  # with speculative decoding, a row's [step, drafted, accepted] in its request's "drafts"

_KIND_CODE = {"prefill": "P", "decode": "D", "mixed": "M", "verify": "V"}
_KIND_NAME = {v: k for k, v in _KIND_CODE.items()}


# The ring's records are structs the garbage collector does not track (they hold no references that could form a
# cycle: strings, numbers, a dict of floats, tuples, bytes): a full ring is 100,000 requests and their steps, and
# every full collection of the engine process would walk them (36 ms a collection with plain objects, on the
# 2-core development machine).
class _Request(msgspec.Struct, gc=False):
    seq: int
    key: str  # the engine's id of the request, which its steps' rows carry
    request_id: str  # the id its client gave, which a read reports
    arrival: float
    prompt_tokens: int
    waiting_ahead: int
    running: int
    stamps: dict[str, float] = {}
    preempted: tuple[int, ...] = ()  # grown on the rare preemption
    finished: float | None = None
    finish_step: int | None = None
    finish_reason: str | None = None
    output_tokens: int = 0
    cached_tokens: int = 0


class _Step(msgspec.Struct, gc=False):
    number: int
    kind: str
    start: float
    end: float
    duration: float
    ids: tuple[str, ...]
    tokens: tuple[int, ...]  # a tuple of ints, not an array: the collector tracks arrays
    prefill: bytes  # per row: 1 where it computes prompt tokens (or recomputes them after a preemption)
    sampled: bytes  # per row: 1 where a token was sampled from it
    preempted: int
    # a verify step's rows: draft tokens verified, and those accepted (None in other steps)
    drafted: bytes | None = None
    accepted: bytes | None = None


class RequestLog:
    """The last `max_requests` requests and the steps of the last `max_step_rows` request rows.

    Requests sit in a ring indexed by their sequence number and steps in a list searched by time, so a read costs
    what it returns however full the log is: a cursor read (`limit=0`) takes constant time, a page its own
    requests and the steps they span."""

    def __init__(self, max_requests: int, max_step_rows: int = DEFAULT_MAX_STEP_ROWS,
                 speculative: bool = False) -> None:
        if max_requests < 1 or max_step_rows < 1:
            raise ValueError("a request log keeps at least one request and one step row")
        self.max_requests = max_requests
        self.speculative = speculative
        self.row_json_bytes = ROW_JSON_BYTES + (DRAFT_JSON_BYTES if speculative else 0)
        self.max_step_rows = max_step_rows
        self._ring: list[_Request] = []  # request number `seq` at index seq % max_requests
        self._live: dict[str, _Request] = {}  # the latest record of each engine id still in the ring
        self._steps: list[_Step] = []  # completion order, in which start and end times never go back
        self._head = 0  # steps before this index were dropped (removed from the list in batches)
        self._rows = 0  # rows of the kept steps
        self._dropped_start: float | None = None  # start of the latest step dropped from the ring
        self._count = 0  # requests ever logged: the next one's sequence number
        self._pending: dict[str, dict[str, float]] = {}
        self._uniform: dict[int, tuple[tuple[int, ...], bytes]] = {}  # per batch size: one token a row, every row sampled

    # ----- written by the engine, between steps -----
    def arrived(self, request_id: str, t: float, prompt_tokens: int, waiting_ahead: int, running: int,
                label: str | None = None) -> None:
        """A request the engine took, under its engine id `request_id`; `label` is the id its client gave (the
        engine id when None), the one a read reports."""
        rec = _Request(self._count, request_id, label or request_id, t, prompt_tokens, waiting_ahead, running)
        pending = self._pending.pop(request_id, None)
        if pending:
            rec.stamps.update(pending)
        if len(self._ring) < self.max_requests:
            self._ring.append(rec)
        else:
            slot = self._count % self.max_requests
            old = self._ring[slot]
            if self._live.get(old.key) is old:
                del self._live[old.key]
            self._ring[slot] = rec
        self._count += 1
        self._live[request_id] = rec

    def step(self, number: int, plan: Any, start: float, duration: float, sampled: list) -> None:
        """One completed step: `plan` is the scheduler's StepPlan it ran, `sampled` its rows' tokens (None where
        a row sampled none)."""
        scheduled = plan.scheduled  # list comprehensions, not generators: this runs every step (about 20% less)
        rows = len(scheduled)
        ids = tuple([s.seq.request_id for s in scheduled])
        prefill = bytes([s.is_prefill for s in scheduled])
        prefill_rows = rows - prefill.count(0)
        verifies = self.speculative and plan.verifies
        # StepPlan.kind's rule, from the flags at hand (the property sums them again: 13 us at batch 256)
        kind = "P" if prefill_rows == rows else "M" if prefill_rows else "V" if verifies else "D"
        # A decode step's rows take one token each, and most steps sample every row: such columns are one shared
        # record per batch size, which costs nothing to build or keep (the hook took 48 us a step at batch 256
        # building them, 23 us without: benchmarks/request_log_cost.py on the 2-core development machine).
        ones, all_sampled = self._uniform.get(rows) or self._uniform_rows(rows)
        tokens = ones if kind == "D" else tuple([s.num_new_tokens for s in scheduled])
        took = all_sampled if None not in sampled else bytes([t is not None for t in sampled])
        drafted = accepted = None
        if verifies:  # a verify row's tokens: its accepted drafts, then one more
            drafted = bytes([s.num_draft_tokens for s in scheduled])
            accepted = bytes([len(t) - 1 if isinstance(t, list) else 0 for t in sampled])
        if plan.preempted:
            self.preempted([seq.request_id for seq in plan.preempted], number)
        steps = self._steps
        steps.append(_Step(number, kind, start, start + duration, duration, ids, tokens, prefill, took,
                           len(plan.preempted), drafted, accepted))
        self._rows += len(ids)
        while self._rows > self.max_step_rows and len(steps) - self._head > 1:
            old = steps[self._head]
            self._head += 1
            self._rows -= len(old.ids)
            self._dropped_start = old.start
        if self._head > 1024 and 2 * self._head > len(steps):  # amortized: each step is moved at most once
            del steps[:self._head]
            self._head = 0

    def _uniform_rows(self, rows: int) -> tuple[tuple[int, ...], bytes]:
        self._uniform[rows] = (1,) * rows, b"\x01" * rows
        return self._uniform[rows]

    def preempted(self, request_ids: list[str], number: int) -> None:
        """Requests preempted at step `number` (also called for a step that scheduled nothing, when every running
        request's KV had to go first)."""
        for request_id in request_ids:
            rec = self._live.get(request_id)
            if rec is not None:
                rec.preempted += (number,)

    def finished(self, request_id: str, t: float, reason: str | None, output_tokens: int, cached_tokens: int,
                 step: int | None = None) -> None:
        rec = self._live.get(request_id)
        if rec is None or rec.finished is not None:
            return
        rec.finished, rec.finish_step, rec.finish_reason = t, step, reason
        rec.output_tokens, rec.cached_tokens = output_tokens, cached_tokens

    # ----- written by the front end (any thread; one dict update) -----
    def stamp(self, request_id: str, times: dict[str, float]) -> None:
        """The front end's times of a request (`FRONTEND_STAMPS`); those of a request not yet arrived wait."""
        times = {k: float(v) for k, v in times.items() if k in FRONTEND_STAMPS and isinstance(v, (int, float))}
        rec = self._live.get(request_id)
        if rec is not None:
            rec.stamps.update(times)
            return
        self._pending[request_id] = times
        while len(self._pending) > PENDING_STAMPS:
            del self._pending[next(iter(self._pending))]

    # ----- read -----
    @property
    def next_seq(self) -> int:
        return self._count

    def read(self, since: int = 0, limit: int | None = None, active_since: float | None = None,
             now: float | None = None, max_bytes: int | None = None) -> dict[str, Any]:
        """Requests numbered `since` and later (at most `limit`, oldest first; with `active_since`, only those
        unfinished then or since), each with the steps it rode, and every step from the first one's arrival to the
        last one's end. With `max_bytes` the page stops before the request that would take its JSON past that
        many bytes (an estimate from above), but holds at least one; when that one alone would, its steps are cut
        there (`steps_complete: false`). `next` is the number after the last request given, or the log's end when
        none is. Times are the server's perf_counter seconds; durations seconds."""
        oldest = self._count - len(self._ring)
        cut = None
        if active_since is not None:
            chosen = [r for r in self._span(oldest, self._count)
                      if r.finished is None or r.finished >= active_since][:limit]
        else:
            first = max(since, oldest)
            stop = self._count if limit is None else min(self._count, first + max(0, limit))
            chosen, cut = self._page(first, stop, max_bytes)
        lo, hi = self._window(chosen)
        if cut is not None:
            hi = min(hi, cut)
        rows: dict[str, list[list]] = {}
        drafts: dict[str, list[list]] = {}
        by_key: dict[str, _Request] = {}
        for rec in chosen:  # a reused id: the later record owns the steps after its arrival
            by_key[rec.key] = rec
        keys = by_key.keys()
        arrivals = {key: rec.arrival - 1e-9 for key, rec in by_key.items()}
        steps_out = []
        for st in self._steps[lo:hi]:
            # Every row of the step is looked at only in C (counts, sums, a set intersection): the Python work is
            # the chosen requests' own rows, what the page sends.
            prefill_rows = st.prefill.count(1)
            prefill_tokens = sum(compress(st.tokens, st.prefill)) if prefill_rows else 0
            ours = keys & st.ids
            if ours:
                # a few rows: a scan in C each; more: one map of the step's rows
                at = st.ids.index if len(ours) < 16 else dict(zip(st.ids, range(len(st.ids)))).__getitem__
                number, start, tokens, prefill, took = st.number, st.start, st.tokens, st.prefill, st.sampled
                for key in ours:
                    if start >= arrivals[key]:
                        i = at(key)
                        rows.setdefault(key, []).append([number, tokens[i], prefill[i], took[i]])
                        if st.drafted is not None and st.drafted[i]:
                            drafts.setdefault(key, []).append([number, st.drafted[i], st.accepted[i]])
            steps_out.append({"step": st.number, "kind": _KIND_NAME[st.kind], "start": st.start,
                              "duration": st.duration, "batch_size": len(st.ids), "num_tokens": sum(st.tokens),
                              "prefill_tokens": prefill_tokens, "prefill_rows": prefill_rows,
                              "preempted": st.preempted,
                              "drafted_tokens": sum(st.drafted) if st.drafted is not None else 0,
                              "accepted_tokens": sum(st.accepted) if st.accepted is not None else 0})
        dropped = self._dropped_start
        requests = []
        for rec in chosen:
            own = rows.get(rec.key, []) if by_key.get(rec.key) is rec else []
            requests.append({
                "request_id": rec.request_id, "seq": rec.seq, **{k: rec.stamps.get(k) for k in FRONTEND_STAMPS},
                "arrival": rec.arrival, "prompt_tokens": rec.prompt_tokens, "waiting_ahead": rec.waiting_ahead,
                "running_at_arrival": rec.running, "preempted": list(rec.preempted), "finished": rec.finished,
                "finish_step": rec.finish_step, "finish_reason": rec.finish_reason,
                "output_tokens": rec.output_tokens, "cached_tokens": rec.cached_tokens,
                # steps before the oldest kept one were dropped from the ring: this request's list misses them
                "steps_complete": (dropped is None or dropped < rec.arrival) and cut is None,
                "steps": own,
                # speculative decoding: [step, draft tokens verified, accepted] per verify step with drafts
                "drafts": drafts.get(rec.key, []) if by_key.get(rec.key) is rec else [],
            })
        return {"clock": "perf_counter", "now": time.perf_counter() if now is None else now,
                "next": chosen[-1].seq + 1 if chosen else self._count,
                "oldest": oldest, "oldest_step": self._steps[self._head].number if len(self._steps) > self._head
                else None, "requests": requests, "steps": steps_out}

    def _span(self, first: int, stop: int) -> list[_Request]:
        ring, size = self._ring, self.max_requests
        return [ring[seq % size] for seq in range(first, stop)]

    def _page(self, first: int, stop: int, max_bytes: int | None) -> tuple[list[_Request], int | None]:
        """Requests `first` to `stop` (excluded), cut where their JSON would pass `max_bytes`; and where the steps
        of the first one are cut when it alone would (None when they are not)."""
        if max_bytes is None:
            return self._span(first, stop), None
        chosen: list[_Request] = []
        lo = hi = self._head
        own = 0  # the chosen requests' rows, at most one per step of each one's span
        for seq in range(first, stop):
            rec = self._ring[seq % self.max_requests]
            rec_lo, rec_hi = self._window([rec])
            new_lo = rec_lo if not chosen else lo  # arrivals come in sequence order: the first one starts it
            new_hi = max(hi, rec_hi)
            if self._size(len(chosen) + 1, new_hi - new_lo, own + rec_hi - rec_lo) > max_bytes:
                if chosen:
                    break
                ends = range(new_lo, new_hi + 1)  # the most of its steps that fit, none if not even one does
                fit = bisect.bisect_right(ends, max_bytes, key=lambda end: self._size(1, end - new_lo, end - new_lo))
                return [rec], new_lo + max(0, fit - 1)
            chosen.append(rec)
            lo, hi, own = new_lo, new_hi, own + rec_hi - rec_lo
        return chosen, None

    def _size(self, requests: int, steps: int, rows: int) -> int:
        """An upper bound of the JSON of `requests` requests with `rows` rows of theirs, and `steps` steps."""
        return REQUEST_JSON_BYTES * requests + STEP_JSON_BYTES * steps + self.row_json_bytes * rows

    def _window(self, chosen: list[_Request]) -> tuple[int, int]:
        """The indices of the steps `chosen` may have ridden: from the first one that ended after the first
        arrival to the last one that began by the latest end (the newest, while one of them is unfinished)."""
        steps, head = self._steps, self._head
        if not chosen:
            return head, head
        lo = bisect.bisect_left(steps, chosen[0].arrival, lo=head, key=_end)
        ends = [r.finished for r in chosen]
        hi = len(steps) if None in ends else bisect.bisect_right(steps, max(ends), lo=lo, key=_start)
        return lo, max(lo, hi)


def _start(step: _Step) -> float:
    return step.start


def _end(step: _Step) -> float:
    return step.end
