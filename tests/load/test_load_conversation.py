"""Multi-turn sessions: turns in order, history made of the server's own replies, failures end a session."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from infertrace.load.clock import ScriptedClock
from infertrace.load.records import RequestResult
from infertrace.load.run.runner import Runner
from infertrace.load.workloads.conversation import Session, SessionDriver, Turn, sharegpt_sessions, synthetic_sessions
from infertrace.load.workloads.dataset import DatasetError, PromptMaker


class ScriptedChat:
    """A target stand-in at the `send` level: each reply names the turn it answers; one turn may fail."""

    def __init__(self, clock, fail=None, latency=1.0):
        self.clock, self.fail, self.latency = clock, fail or set(), latency
        self.sent = []

    async def send(self, spec, scheduled):
        self.sent.append((self.clock.now(), spec))
        t0 = self.clock.now()
        self.clock.advance(self.latency)
        result = RequestResult(spec.index, scheduled, t0, self.clock.now(), session=spec.session, turn=spec.turn)
        if (spec.session, spec.turn) in self.fail:
            result.error = "HTTP 500"
        else:
            result.text = f"reply to s{spec.session}t{spec.turn}"
        return result


def session(i, n):
    return Session(i, tuple(Turn(f"question {k} of s{i}", 8) for k in range(n)))


def test_history_is_made_of_the_real_replies_and_turns_are_in_order():
    clock = ScriptedClock()
    chat = ScriptedChat(clock)
    driver = SessionDriver(chat.send, clock, think_time_s=2.0)
    outcome = asyncio.run(driver.play(session(0, 3)))
    assert outcome.turns_done == 3 and outcome.failed_turn is None
    specs = [s for _, s in chat.sent]
    assert [s.turn for s in specs] == [0, 1, 2] and [s.index for s in specs] == [0, 1, 2]
    assert specs[2].messages == [
        {"role": "user", "content": "question 0 of s0"}, {"role": "assistant", "content": "reply to s0t0"},
        {"role": "user", "content": "question 1 of s0"}, {"role": "assistant", "content": "reply to s0t1"},
        {"role": "user", "content": "question 2 of s0"}]
    # each turn waits for the previous reply (1 s) and the think time (2 s)
    assert [t for t, _ in chat.sent] == [0.0, 3.0, 6.0]


def test_a_failed_turn_ends_its_session_only():
    clock = ScriptedClock()
    chat = ScriptedChat(clock, fail={(0, 1)})
    driver = SessionDriver(chat.send, clock)

    async def both():
        await driver.play(session(0, 3))
        await driver.play(session(1, 2))

    asyncio.run(both())
    assert [(s.session, s.turn) for _, s in chat.sent] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert driver.summary() == {"sessions": 2, "sessions_completed": 1, "sessions_ended_by_failure": 1,
                                "turns_sent": 4}


def test_users_in_a_closed_loop_each_play_whole_sessions():
    class Target:
        kind = "scripted"

    clock = ScriptedClock()
    chat = ScriptedChat(clock, latency=0.5)
    runner = Runner(Target(), clock)
    driver = SessionDriver(chat.send, clock)
    in_flight = []

    async def play(s, scheduled):
        in_flight.append(s.index)
        await driver.play(s, scheduled)
        await asyncio.sleep(0)

    asyncio.run(runner.closed_sessions([session(i, 2) for i in range(5)], 2, play))
    assert sorted(o.index for o in driver.outcomes) == [0, 1, 2, 3, 4]
    per_session = {}
    for _, spec in chat.sent:
        per_session.setdefault(spec.session, []).append(spec.turn)
    assert all(turns == [0, 1] for turns in per_session.values())


def test_synthetic_sessions_have_exact_turn_lengths(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    maker = PromptMaker(tok, np.random.default_rng(0))
    sessions = synthetic_sessions(maker, 3, turns=4, turn_input_len=20, output_len=7)
    assert len(sessions) == 3 and all(len(s.turns) == 4 for s in sessions)
    assert all(len(tok.encode(t.user, add_special_tokens=False)) == 20 and t.output_len == 7
               for s in sessions for t in s.turns)
    with pytest.raises(DatasetError, match="--turns must be at least 1"):
        synthetic_sessions(maker, 1, turns=0, turn_input_len=5, output_len=5)


def test_sharegpt_multi_turn(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                           {"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]},
        {"conversations": [{"from": "gpt", "value": "no human first"}]},
    ]))
    sessions = sharegpt_sessions(path, 2, np.random.default_rng(0), None, output_len=None, default_output_len=9)
    assert [[t.user for t in s.turns] for s in sessions] == [["a", "c"], ["a", "c"]]
    assert all(t.output_len == 9 for s in sessions for t in s.turns)
    path.write_text("[]")
    with pytest.raises(DatasetError, match="no conversation"):
        sharegpt_sessions(path, 1, np.random.default_rng(0), None, None, 9)


def test_sharegpt_turns_that_cannot_be_sent_end_the_conversation_there(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text('[{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}, '
                    '{"from": "human", "value": "\\ud800"}, {"from": "gpt", "value": "d"}]}, '
                    '{"conversations": [{"from": "human", "value": 7}, {"from": "gpt", "value": "b"}]}]')
    sessions = sharegpt_sessions(path, 1, np.random.default_rng(0), None, output_len=None, default_output_len=9)
    assert [[t.user for t in s.turns] for s in sessions] == [["a"]]
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(DatasetError, match="nested too deeply"):
        sharegpt_sessions(path, 1, np.random.default_rng(0), None, None, 9)
