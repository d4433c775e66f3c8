"""Greedy tokens match Hugging Face transformers exactly, whatever the batching, chunking, caching or preemption."""

from __future__ import annotations

import pytest

from infertrace.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=64, ignore_eos=True)


def test_one_string_prompt_matches_hf(tiny_model_dir, hf_reference):
    llm = LLM(tiny_model_dir, kv_cache_tokens=2048)
    prompt = "The engine schedules a batch of requests and the kernel computes attention over the cache."
    [out] = llm.generate(prompt, GREEDY)
    prompt_ids = llm.tokenizer.encode(prompt)
    assert len(out.token_ids) == 64 and out.finish_reason == "length"
    hf_reference.assert_matches([prompt_ids], [out.token_ids])
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_sixteen_mixed_prompts_in_one_generate_call(tiny_model_dir, hf_reference, mixed_prompts):
    llm = LLM(tiny_model_dir, kv_cache_tokens=16384)
    outs = llm.generate(mixed_prompts, GREEDY)
    assert [o.num_prompt_tokens for o in outs] == [len(p) for p in mixed_prompts]
    hf_reference.assert_matches(mixed_prompts, [o.token_ids for o in outs])


def test_shared_prefix_hits_the_cache_and_matches_hf(make_engine, run_engine, make_prompts, hf_reference):
    prefix = make_prompts([200], seed=1)[0]
    suffixes = make_prompts([5, 9, 23, 40, 1, 16], seed=2)
    # the prefix itself and its first 12 full blocks exactly: the last token must still be computed
    prompts = [prefix + s for s in suffixes] + [prefix, prefix[:192]]
    engine = make_engine(kv_cache_tokens=8192)
    first, _ = run_engine(engine, prompts[:1], GREEDY)
    assert engine.counters["prefix_cache_hits"] == 0
    rest, steps = run_engine(engine, prompts[1:], GREEDY)
    hits = engine.counters["prefix_cache_hits"]
    assert hits == 6 * 192 + 176  # 12 cached blocks each, 11 for the prompt of exactly 12 blocks
    assert sum(s.prefix_cache_hits for s in steps) == hits
    hf_reference.assert_matches(prompts, first + rest)
    assert engine.kv_blocks_used == 0


def test_prefill_chunks_smaller_than_the_prompts(make_engine, run_engine, hf_reference, mixed_prompts):
    engine = make_engine(kv_cache_tokens=16384, max_num_batched_tokens=64, long_prefill_token_threshold=24)
    tokens, steps = run_engine(engine, mixed_prompts, GREEDY)
    assert max(s.num_tokens for s in steps) <= 64
    assert any(s.kind == "mixed" for s in steps), "chunked prefills never shared a step with decodes"
    # the 300-token prompt needed at least 300/24 steps of prefill
    assert sum(1 for s in steps if s.num_prefill_tokens) >= 13
    hf_reference.assert_matches(mixed_prompts, tokens)


def test_whole_prefills_without_chunking(make_engine, run_engine, hf_reference, mixed_prompts):
    engine = make_engine(kv_cache_tokens=16384, chunked_prefill=False, max_num_batched_tokens=128)
    tokens, steps = run_engine(engine, mixed_prompts, GREEDY)
    # a prompt longer than the budget still runs, in a step of its own
    assert any(s.num_tokens == 300 and s.batch_size == 1 for s in steps)
    hf_reference.assert_matches(mixed_prompts, tokens)


def test_small_kv_budget_forces_preemption(make_engine, run_engine, hf_reference, mixed_prompts):
    engine = make_engine(kv_cache_tokens=768, block_size=16)
    tokens, steps = run_engine(engine, mixed_prompts, GREEDY)
    assert engine.counters["preemptions"] > 0
    assert sum(s.preemptions for s in steps) == engine.counters["preemptions"]
    assert max(s.kv_blocks_used for s in steps) <= 768 // 16
    hf_reference.assert_matches(mixed_prompts, tokens)
    assert engine.kv_blocks_used == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_looped_attention_gives_the_batched_tokens(make_engine, run_engine, hf_reference, mixed_prompts, prefix_caching):
    batched, _ = run_engine(make_engine(kv_cache_tokens=16384, prefix_caching=prefix_caching), mixed_prompts, GREEDY)
    looped, _ = run_engine(
        make_engine(kv_cache_tokens=16384, prefix_caching=prefix_caching, attention="looped"), mixed_prompts, GREEDY
    )
    assert looped == batched
    hf_reference.assert_matches(mixed_prompts, looped)
