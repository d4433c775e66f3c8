"""Every request's life on the engine's clock: when it arrived and with how many ahead of it, each step it rode
(with its tokens in it), preemptions, its first token and its end. Always on and bounded.

The hot path keeps one compact record per step (its number, kind, start, duration, and per row the request id,
its tokens and two flags) in a ring bounded by rows, and one small record per request in a ring bounded by
requests; `read` derives each request's steps from the step ring when asked. Times are `time.perf_counter()`
seconds of this host (CLOCK_MONOTONIC on Linux, shared by every process of the host), so the front end's stamps
(received, tokenized, first output, sent) sit on the same clock as the steps.
"""

from __future__ import annotations

import collections
import time
from array import array
from typing import Any

# The defaults bound memory to a few tens of MB: a row is an id reference, a 4-byte token count and a flag byte.
DEFAULT_MAX_STEP_ROWS = 1_000_000
PENDING_STAMPS = 4096  # front-end stamps of requests the log has not seen arrive (refused ones), kept at most
FRONTEND_STAMPS = ("received", "tokenized", "first_output", "sent")

_KIND_CODE = {"prefill": "P", "decode": "D", "mixed": "M"}
_KIND_NAME = {v: k for k, v in _KIND_CODE.items()}


class _Request:
    __slots__ = ("seq", "request_id", "arrival", "prompt_tokens", "waiting_ahead", "running", "stamps",
                 "preempted", "finished", "finish_step", "finish_reason", "output_tokens", "cached_tokens")

    def __init__(self, seq: int, request_id: str, arrival: float, prompt_tokens: int, waiting_ahead: int,
                 running: int) -> None:
        self.seq = seq
        self.request_id = request_id
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.waiting_ahead = waiting_ahead
        self.running = running
        self.stamps: dict[str, float] = {}
        self.preempted: list[int] = []
        self.finished: float | None = None
        self.finish_step: int | None = None
        self.finish_reason: str | None = None
        self.output_tokens = 0
        self.cached_tokens = 0


class _Step:
    __slots__ = ("number", "kind", "start", "duration", "ids", "tokens", "prefill", "sampled", "preempted")

    def __init__(self, number: int, kind: str, start: float, duration: float, ids: tuple[str, ...],
                 tokens: array, prefill: bytes, sampled: bytes, preempted: int) -> None:
        self.number = number
        self.kind = kind
        self.start = start
        self.duration = duration
        self.ids = ids
        self.tokens = tokens
        self.prefill = prefill  # per row: 1 where it computes prompt tokens (or recomputes them after a preemption)
        self.sampled = sampled  # per row: 1 where a token was sampled from it
        self.preempted = preempted


class RequestLog:
    """The last `max_requests` requests and the steps of the last `max_step_rows` request rows."""

    def __init__(self, max_requests: int, max_step_rows: int = DEFAULT_MAX_STEP_ROWS) -> None:
        if max_requests < 1 or max_step_rows < 1:
            raise ValueError("a request log keeps at least one request and one step row")
        self.max_requests = max_requests
        self.max_step_rows = max_step_rows
        self._requests: collections.deque[_Request] = collections.deque()
        self._live: dict[str, _Request] = {}  # the latest record of each id still in the ring
        self._steps: collections.deque[_Step] = collections.deque()
        self._rows = 0
        self._dropped_start: float | None = None  # start of the latest step dropped from the ring
        self._count = 0  # requests ever logged: the next one's sequence number
        self._pending: dict[str, dict[str, float]] = {}

    # ----- written by the engine, between steps -----
    def arrived(self, request_id: str, t: float, prompt_tokens: int, waiting_ahead: int, running: int) -> None:
        rec = _Request(self._count, request_id, t, prompt_tokens, waiting_ahead, running)
        self._count += 1
        pending = self._pending.pop(request_id, None)
        if pending:
            rec.stamps.update(pending)
        self._requests.append(rec)
        self._live[request_id] = rec
        if len(self._requests) > self.max_requests:
            old = self._requests.popleft()
            if self._live.get(old.request_id) is old:
                del self._live[old.request_id]

    def step(self, number: int, plan: Any, start: float, duration: float, sampled: list) -> None:
        """One completed step: `plan` is the scheduler's StepPlan it ran, `sampled` its rows' tokens (None where
        a row sampled none)."""
        scheduled = plan.scheduled  # list comprehensions, not generators: this runs every step (about 20% less)
        ids = tuple([s.seq.request_id for s in scheduled])
        tokens = array("i", [s.num_new_tokens for s in scheduled])
        prefill = bytes([s.is_prefill for s in scheduled])
        took = bytes([t is not None for t in sampled])
        if plan.preempted:
            self.preempted([seq.request_id for seq in plan.preempted], number)
        self._steps.append(_Step(number, _KIND_CODE[plan.kind.value], start, duration, ids, tokens, prefill, took,
                                 len(plan.preempted)))
        self._rows += len(ids)
        while self._rows > self.max_step_rows and len(self._steps) > 1:
            old = self._steps.popleft()
            self._rows -= len(old.ids)
            self._dropped_start = old.start

    def preempted(self, request_ids: list[str], number: int) -> None:
        """Requests preempted at step `number` (also called for a step that scheduled nothing, when every running
        request's KV had to go first)."""
        for request_id in request_ids:
            rec = self._live.get(request_id)
            if rec is not None:
                rec.preempted.append(number)

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
             now: float | None = None) -> dict[str, Any]:
        """Requests numbered `since` and later (at most `limit`, oldest first; with `active_since`, only those
        unfinished then or since), each with the steps it rode, and every step from the first of them on. Times
        are the server's perf_counter seconds; durations seconds."""
        chosen = [r for r in self._requests if r.seq >= since
                  and (active_since is None or r.finished is None or r.finished >= active_since)]
        if limit is not None:
            chosen = chosen[:max(0, limit)]
        rows: dict[str, list[list]] = {}
        by_id: dict[str, _Request] = {}
        for rec in chosen:  # a reused id: the later record owns the steps after its arrival
            by_id[rec.request_id] = rec
        first_arrival = min((r.arrival for r in chosen), default=None)
        steps_out = []
        oldest_step = self._steps[0].number if self._steps else None
        dropped = self._dropped_start
        window = []  # the steps from the first chosen arrival on, found from the newest back: a recent `since`
        for st in reversed(self._steps):  # costs only its own steps, however full the ring
            if first_arrival is None or st.start + st.duration < first_arrival:
                break
            window.append(st)
        for st in reversed(window):
            prefill_tokens = prefill_rows = 0
            for request_id, n, prefill, took in zip(st.ids, st.tokens, st.prefill, st.sampled):
                if prefill:
                    prefill_tokens += n
                    prefill_rows += 1
                rec = by_id.get(request_id)
                if rec is not None and st.start >= rec.arrival - 1e-9:
                    rows.setdefault(request_id, []).append([st.number, n, prefill, took])
            steps_out.append({"step": st.number, "kind": _KIND_NAME[st.kind], "start": st.start,
                              "duration": st.duration, "batch_size": len(st.ids), "num_tokens": sum(st.tokens),
                              "prefill_tokens": prefill_tokens, "prefill_rows": prefill_rows,
                              "preempted": st.preempted})
        requests = []
        for rec in chosen:
            own = rows.get(rec.request_id, []) if by_id.get(rec.request_id) is rec else []
            requests.append({
                "request_id": rec.request_id, "seq": rec.seq, **{k: rec.stamps.get(k) for k in FRONTEND_STAMPS},
                "arrival": rec.arrival, "prompt_tokens": rec.prompt_tokens, "waiting_ahead": rec.waiting_ahead,
                "running_at_arrival": rec.running, "preempted": list(rec.preempted), "finished": rec.finished,
                "finish_step": rec.finish_step, "finish_reason": rec.finish_reason,
                "output_tokens": rec.output_tokens, "cached_tokens": rec.cached_tokens,
                # steps before the oldest kept one were dropped from the ring: this request's list misses them
                "steps_complete": dropped is None or dropped < rec.arrival,
                "steps": own,
            })
        return {"clock": "perf_counter", "now": time.perf_counter() if now is None else now, "next": self._count,
                "oldest": self._requests[0].seq if self._requests else self._count, "oldest_step": oldest_step,
                "requests": requests, "steps": steps_out}
