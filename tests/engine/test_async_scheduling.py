"""Async scheduling (step N+1 planned and queued before step N's tokens reach the host) changes no output.

On CPU the device work is synchronous, so these tests check the bookkeeping, not the overlap: placeholders,
tokens fed on the device, speculative rows of requests that stopped, aborts while a step is queued.
"""

from __future__ import annotations

import pytest

from infertrace.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=64, ignore_eos=True)


def run(engine, prompts, params):
    """Step to completion; (tokens, texts, finish reasons) per prompt, all outputs seen, in arrival order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"r{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, p)
    tokens = {i: [] for i in ids}
    texts = dict.fromkeys(ids, "")
    reasons = dict.fromkeys(ids)
    while engine.has_unfinished():
        for out in engine.step():
            assert reasons[out.request_id] is None, "output after the request finished"
            tokens[out.request_id] += out.new_token_ids
            texts[out.request_id] += out.new_text
            assert out.num_output_tokens == len(tokens[out.request_id])
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return [tokens[i] for i in ids], [texts[i] for i in ids], [reasons[i] for i in ids]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(kv_cache_tokens=16384),
        dict(kv_cache_tokens=16384, max_num_batched_tokens=64, long_prefill_token_threshold=24),
        dict(kv_cache_tokens=768),  # preemptions
        dict(kv_cache_tokens=16384, max_num_seqs=4),  # requests wait while others decode
    ],
    ids=["plain", "chunked", "preempting", "queued"],
)
def test_async_tokens_match_hf(make_engine, hf_reference, mixed_prompts, overrides):
    engine = make_engine(async_scheduling="on", **overrides)
    tokens, _, reasons = run(engine, mixed_prompts, GREEDY)
    hf_reference.assert_matches(mixed_prompts, tokens)
    assert reasons == ["length"] * len(mixed_prompts)
    assert engine.counters["overlapped_steps"] > 0
    assert engine.counters["generation_tokens"] == 64 * len(mixed_prompts)
    assert engine.kv_blocks_used == 0 and not engine.has_unfinished()


def test_async_stops_where_sync_stops(make_engine, mixed_prompts, digit_tokenizer):
    """Stops the host learns of one step late (stop tokens, stop strings) end the request at the same token."""
    prompts = mixed_prompts[:8]

    def engine(mode):
        e = make_engine(kv_cache_tokens=16384, async_scheduling=mode)
        e.tokenizer = digit_tokenizer  # visible text for every token, so stop strings can match
        return e

    sync_tokens, sync_texts, _ = run(engine("off"), prompts, GREEDY)
    stop_token = sync_tokens[0][10]
    stop_text = sync_texts[1][20:23]
    params = [
        SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=48, ignore_eos=True, stop=[stop_text]),
        SamplingParams(max_tokens=1, ignore_eos=True),
        SamplingParams(max_tokens=2, ignore_eos=True),
        *[SamplingParams(max_tokens=5 + 7 * i, ignore_eos=True) for i in range(4)],
    ]
    want = run(engine("off"), prompts, params)
    overlapped = engine("on")
    got = run(overlapped, prompts, params)
    assert got == want
    assert want[0][0][-1] == stop_token and want[2][:2] == ["stop", "stop"]
    assert len(want[0][1]) <= 23 and stop_text not in want[1][1]  # cut where the stop string completed
    assert [len(t) for t in want[0][2:]] == [1, 2, 5, 12, 19, 26]
    assert overlapped.counters["overlapped_steps"] > 0 and overlapped.kv_blocks_used == 0


def test_seeded_sampling_is_the_same_with_async(make_engine, mixed_prompts):
    params = [SamplingParams(max_tokens=24 + i, temperature=0.8, top_k=50, top_p=0.9, seed=i) for i in range(6)]
    want = run(make_engine(kv_cache_tokens=16384, async_scheduling="off"), mixed_prompts[:6], params)
    got = run(make_engine(kv_cache_tokens=16384, async_scheduling="on"), mixed_prompts[:6], params)
    assert got == want


def test_abort_while_a_step_is_queued(make_engine, hf_reference, mixed_prompts):
    prompts = mixed_prompts[:3]
    engine = make_engine(kv_cache_tokens=16384, async_scheduling="on")
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    tokens = {f"r{i}": [] for i in range(3)}
    for _ in range(6):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    assert engine.counters["overlapped_steps"] > 0
    aborted = engine.abort("r1")
    assert aborted.finished and aborted.finish_reason == "abort"
    assert aborted.num_output_tokens == len(tokens["r1"]), "the token still being sampled was counted"
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != "r1"
            tokens[out.request_id] += out.new_token_ids
    hf_reference.assert_matches([prompts[0], prompts[2]], [tokens["r0"], tokens["r2"]])
    assert engine.kv_blocks_used == 0


def test_async_scheduling_setting_is_checked(make_engine):
    with pytest.raises(ValueError, match="async_scheduling must be one of auto, on, off"):
        make_engine(async_scheduling="sometimes")
