"""A step's host inputs, computed per request with numpy, against their per-token definition (no GPU needed)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from infertrace.engine.model_runner import ModelRunner
from infertrace.engine.scheduler import StepKind

BLOCK = 16


@dataclass
class _Scheduled:
    seq: SimpleNamespace
    start: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        return self.start + self.num_new_tokens == len(self.seq.token_ids)


def _per_token(plan) -> dict[str, list]:
    """The definition, one token at a time."""
    out = {k: [] for k in ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices")}
    query_start_loc = [0]
    for s in plan.scheduled:
        end = s.start + s.num_new_tokens
        out["input_ids"] += s.seq.token_ids[s.start : end]
        out["positions"] += range(s.start, end)
        out["slot_mapping"] += [s.seq.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(s.start, end)]
        query_start_loc.append(query_start_loc[-1] + s.num_new_tokens)
        out["seq_lens"].append(end)
        if s.samples:
            out["logits_indices"].append(query_start_loc[-1] - 1)
    out["query_start_loc"] = query_start_loc
    width = max(len(s.seq.block_table) for s in plan.scheduled)
    out["block_tables"] = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in plan.scheduled]
    return out


def _random_plan(rng: random.Random) -> SimpleNamespace:
    scheduled = []
    for _ in range(rng.randint(1, 24)):
        length = rng.randint(1, 700)
        seq = SimpleNamespace(token_ids=[rng.randrange(1000) for _ in range(length)],
                              block_table=rng.sample(range(5000), -(-length // BLOCK)))
        if rng.random() < 0.6:  # a decode row
            scheduled.append(_Scheduled(seq, length - 1, 1))
        else:  # a prefill chunk, to the end or not
            start = rng.randrange(length)
            scheduled.append(_Scheduled(seq, start, rng.randint(1, length - start)))
    return SimpleNamespace(scheduled=scheduled, kind=StepKind.MIXED)


def test_host_inputs_match_the_per_token_definition():
    rng = random.Random(0)
    runner = SimpleNamespace(block_size=BLOCK)
    for _ in range(100):
        plan = _random_plan(rng)
        inputs = ModelRunner.host_inputs(runner, plan)
        want = _per_token(plan)
        for name, values in want.items():
            got = getattr(inputs, name)
            assert (got.tolist() if isinstance(got, np.ndarray) else got) == values, name
        assert inputs.query_lens == [s.num_new_tokens for s in plan.scheduled]
        assert all(getattr(inputs, n).dtype == np.int64 for n in ("input_ids", "slot_mapping", "block_tables"))
        assert not inputs.decode


def test_decode_steps_get_a_launch_order_and_others_none():
    """The attention's launch order: a decode step's rows longest context first, then its graph's padding rows;
    none for a step with a longer query, or when the switch is off."""
    runner = SimpleNamespace(_ordered_decode=True)
    decode = SimpleNamespace(query_lens=[1, 1, 1], seq_lens=[40, 900, 120])
    assert ModelRunner._launch_order(runner, decode, 4).tolist() == [1, 2, 0, 3]
    assert ModelRunner._launch_order(runner, SimpleNamespace(query_lens=[1, 7], seq_lens=[40, 900]), 2) is None
    assert ModelRunner._launch_order(SimpleNamespace(_ordered_decode=False), decode, 3) is None
