"""Multi-turn sessions: each turn goes over chat with the whole history, the assistant turns being the server's
own replies, so every turn's prompt grows by the previous reply and the next question, as a user's does.

Sessions come from ShareGPT multi-turn files (the human turns, in order; each reply's length as that turn's
max_tokens) or are synthetic (`--turns N`, `--turn-input-len L`). A session's turns are strictly in order; a turn
that fails ends its session (counted), never the run.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from infertrace.load.clock import Clock
from infertrace.load.records import RequestResult, RequestSpec, input_tokens
from infertrace.load.stats import Stats
from infertrace.load.workloads.dataset import (
    DatasetError,
    PromptMaker,
    is_text,
    length_range,
    read_sharegpt,
    seeded_rng,
)
from infertrace.load.workloads.schedule import arrival_offsets


@dataclass(frozen=True, slots=True)
class Turn:
    user: str  # the user's message
    output_len: int  # max_tokens for the reply
    pause_s: float = 0.0  # before this turn, after the previous reply, beside --think-time (an agent's tool time)


@dataclass(frozen=True, slots=True)
class Session:
    index: int
    turns: tuple[Turn, ...]


def synthetic_sessions(maker: PromptMaker, n: int, turns: int, turn_input_len: int, output_len: int,
                       range_ratio: float = 0.0) -> list[Session]:
    """`n` sessions of `turns` user messages of about `turn_input_len` tokens each (exact in the tokenizer)."""
    if turns < 1:
        raise DatasetError(f"--turns must be at least 1, got {turns}")
    rng = maker.rng
    in_lo, in_hi = length_range(turn_input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    sessions = []
    for s in range(n):
        in_lens = rng.integers(in_lo, in_hi + 1, turns)
        out_lens = rng.integers(out_lo, out_hi + 1, turns)
        sessions.append(Session(s, tuple(Turn(maker.exact(int(i))[0], int(o)) for i, o in zip(in_lens, out_lens))))
    return sessions


def sharegpt_sessions(path: str | Path, n: int, rng: np.random.Generator, tokenizer, output_len: int | None,
                      default_output_len: int, max_turns: int | None = None) -> list[Session]:
    """Conversations with at least one human turn answered; shuffled with the seed, cycled when fewer than `n`."""
    records = read_sharegpt(path)
    conversations: list[tuple[Turn, ...]] = []
    for rec in records:
        messages = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(messages, list):
            continue
        turns = []
        for ask, reply in zip(messages[::2], messages[1::2]):
            if not (isinstance(ask, dict) and isinstance(reply, dict)):
                break
            if ask.get("from") not in ("human", "user") or not is_text(ask.get("value")) or \
                    not ask["value"] or not is_text(reply.get("value")):
                break
            out = output_len
            if out is None:
                out = max(1, len(tokenizer.encode(reply["value"], add_special_tokens=False))) if tokenizer else \
                    default_output_len
            turns.append(Turn(ask["value"], out))
            if max_turns is not None and len(turns) == max_turns:
                break
        if turns:
            conversations.append(tuple(turns))
    if not conversations:
        raise DatasetError(f"{path}: no conversation with a human turn followed by a reply")
    order = rng.permutation(len(conversations))
    return [Session(i, conversations[order[i % len(order)]]) for i in range(n)]


@dataclass(slots=True)
class SessionOutcome:
    index: int
    turns_done: int = 0
    failed_turn: int | None = None  # the turn whose failure ended the session
    results: list[RequestResult] = field(default_factory=list)


Send = Callable[[RequestSpec, float], Awaitable[RequestResult]]


class SessionDriver:
    """Plays sessions through `send(spec, scheduled)` (the runner's one measuring path); numbers requests
    across sessions in the order they are sent."""

    def __init__(self, send: Send, clock: Clock, think_time_s: float = 0.0) -> None:
        self.send = send
        self.clock = clock
        self.think_time_s = think_time_s
        self.outcomes: list[SessionOutcome] = []
        self._next_index = 0

    async def play(self, session: Session, scheduled: float | None = None) -> SessionOutcome:
        outcome = SessionOutcome(session.index)
        self.outcomes.append(outcome)
        history: list[dict[str, str]] = []
        ready = self.clock.now() if scheduled is None else scheduled
        for k, turn in enumerate(session.turns):
            history.append({"role": "user", "content": turn.user})
            spec = RequestSpec(self._next_index, turn.user, turn.output_len, messages=list(history),
                               session=session.index, turn=k)
            self._next_index += 1
            result = await self.send(spec, ready)
            outcome.results.append(result)
            if result.error is not None:
                outcome.failed_turn = k
                return outcome
            outcome.turns_done += 1
            history.append({"role": "assistant", "content": result.text or ""})
            pause = self.think_time_s + (session.turns[k + 1].pause_s if k + 1 < len(session.turns) else 0.0)
            ready = self.clock.now() + pause
            if k + 1 < len(session.turns) and pause > 0:
                await self.clock.sleep_until(ready)
        return outcome

    def record(self, results: list[RequestResult]) -> None:
        """Outcomes rebuilt from the records of sessions another driver played (a worker process's)."""
        by_session: dict[int, SessionOutcome] = {}
        for r in sorted(results, key=lambda r: (r.session, r.turn)):
            if r.session is None:
                continue
            outcome = by_session.setdefault(r.session, SessionOutcome(r.session))
            outcome.results.append(r)
            if r.error is not None and outcome.failed_turn is None:
                outcome.failed_turn = r.turn
            elif r.error is None:
                outcome.turns_done += 1
        self.outcomes = list(by_session.values())

    def summary(self) -> dict:
        ended = [o for o in self.outcomes if o.failed_turn is not None]
        return {"sessions": len(self.outcomes), "sessions_completed": len(self.outcomes) - len(ended),
                "sessions_ended_by_failure": len(ended),
                "turns_sent": sum(len(o.results) for o in self.outcomes)}


def per_turn(results: list[RequestResult]) -> list[dict]:
    """TTFT and input tokens by turn index (input tokens: the target's count, else our tokenizer's)."""
    by_turn: dict[int, list[RequestResult]] = {}
    for r in results:
        if r.turn is not None:
            by_turn.setdefault(r.turn, []).append(r)
    out = []
    for k in sorted(by_turn):
        rs = by_turn[k]
        done = [r for r in rs if r.success]
        ttft = Stats.of([r.ttft for r in done if r.ttft is not None])
        counted = [input_tokens(r) for r in done if input_tokens(r)]
        out.append({"turn": k, "requests": len(rs), "completed": len(done),
                    "mean_ttft_ms": ttft.mean, "median_ttft_ms": ttft.median, "p99_ttft_ms": ttft.p99,
                    "mean_input_tokens": sum(counted) / len(counted) if counted else None})
    return out


class ConversationLoad:
    """`--dataset conversation`: --num-prompts sessions (from a ShareGPT multi-turn file, else synthetic), played
    by --concurrency users in a closed loop, or started at --request-rate sessions per second in an open loop."""

    reads_prefix_cache = True  # the run's own hit rate: each turn resends its history

    def __init__(self, cfg, tokenizer, default_output_len: int, point: int = 0) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.default_output_len = default_output_len
        self.point = point
        self.sessions = self._sessions(seeded_rng(cfg.seed, "measure", point), cfg.num_prompts)
        self.driver: SessionDriver | None = None

    def _sessions(self, rng: np.random.Generator, n: int) -> list[Session]:
        cfg, tokenizer, default_output_len = self.cfg, self.tokenizer, self.default_output_len
        if cfg.dataset_path:
            return sharegpt_sessions(cfg.dataset_path, n, rng, tokenizer, cfg.output_len, default_output_len)
        if tokenizer is None:
            raise DatasetError("synthetic sessions have user turns of exact token length and need the target's "
                               "tokenizer: pass --tokenizer DIR (or --model DIR), or a ShareGPT file with "
                               "--dataset-path")
        return synthetic_sessions(PromptMaker(tokenizer, rng), n, cfg.turns, cfg.turn_input_len,
                                  cfg.output_len or default_output_len, cfg.range_ratio)

    @property
    def total(self) -> int | None:
        return None  # turns per session are known, but a failed turn ends its session early

    def warmup_specs(self, n: int) -> list[RequestSpec]:
        """The first turn of `n` sessions of their own, each a one-message chat."""
        sessions = self._sessions(seeded_rng(self.cfg.seed, "warmup", self.point), n)
        return [RequestSpec(i, s.turns[0].user, s.turns[0].output_len,
                            messages=[{"role": "user", "content": s.turns[0].user}]) for i, s in enumerate(sessions)]

    def phase(self, runner, clock: Clock, window: float | None):
        cfg = self.cfg
        self.driver = SessionDriver(runner.send, clock, cfg.think_time_s)
        if cfg.request_rate is not None:
            offsets = arrival_offsets(cfg.request_rate, cfg.burstiness, seeded_rng(cfg.seed, "arrivals", self.point),
                                      len(self.sessions), None)
            return runner.open_sessions(self.sessions, offsets, self.driver.play)
        deadline = clock.now() + window if window else None
        return runner.closed_sessions(self.sessions, self.cfg.effective_concurrency, self.driver.play, deadline)

    def figures(self, results: list[RequestResult], target) -> dict:
        summary = self.driver.summary() if self.driver is not None else {}
        return {**summary, "per_turn": per_turn(results)}
