"""The Engine's request API: abort, stop conditions, context limits, step statistics and counters."""

from __future__ import annotations

import numpy as np
import pytest

from infertrace.engine import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def test_abort_frees_blocks_at_once_and_leaves_others_unchanged(make_engine, run_engine, make_prompts):
    prompts = make_prompts([40, 70, 25, 100], seed=11)
    baseline, _ = run_engine(make_engine(kv_cache_tokens=4096), [prompts[0], prompts[2], prompts[3]], GREEDY)

    engine = make_engine(kv_cache_tokens=4096)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    tokens = {f"r{i}": [] for i in range(4)}
    for _ in range(5):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    held = len(engine.scheduler.running[1].block_table)
    assert engine.scheduler.running[1].request_id == "r1" and held >= 5
    used = engine.kv_blocks_used
    final = engine.abort("r1")
    assert engine.kv_blocks_used == used - held
    assert final.finished and final.finish_reason == "abort" and final.num_output_tokens == 5
    assert engine.abort("r1") is None and engine.abort("never-added") is None
    engine.block_manager.check_consistency(list(engine.scheduler.running))
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != "r1"
            tokens[out.request_id] += out.new_token_ids
    assert [tokens["r0"], tokens["r2"], tokens["r3"]] == baseline
    assert engine.kv_blocks_used == 0 and engine.counters["requests_aborted"] == 1


def test_abort_a_waiting_request(make_engine):
    engine = make_engine(kv_cache_tokens=4096, max_num_seqs=1)
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.add_request("b", [4, 5, 6], GREEDY)
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1
    engine.abort("b")
    assert engine.num_waiting == 0


def test_stop_token_ids_and_eos(make_engine, run_engine, make_prompts):
    prompt = make_prompts([30], seed=12)
    engine = make_engine(kv_cache_tokens=4096)
    [free], _ = run_engine(engine, prompt, GREEDY)
    third = free[2]
    first = free.index(third)  # greedy loops can repeat a token earlier

    [stopped], _ = run_engine(engine, prompt, SamplingParams(max_tokens=24, stop_token_ids=[third]))
    assert stopped == free[: first + 1]

    engine.eos_token_ids = frozenset({third})
    engine.add_request("eos", prompt[0], SamplingParams(max_tokens=24))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.new_token_ids[0] for o in outs] == free[: first + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    [ignored], _ = run_engine(engine, prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    assert ignored == free


def test_stop_strings_cut_the_text_and_finish(make_engine, run_engine, make_prompts, digit_tokenizer):
    prompt = make_prompts([20], seed=13)[0]
    engine = make_engine(kv_cache_tokens=4096)
    engine.tokenizer = digit_tokenizer
    [free], _ = run_engine(engine, [prompt], GREEDY)
    text = digit_tokenizer.decode(free)
    stop = text[5:7]
    cut = text.index(stop)

    engine.add_request("s", prompt, SamplingParams(max_tokens=24, stop=[stop, "no such text"]))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in outs) == text[:cut]
    # tokens run up to the one that completed the stop string
    assert [o.new_token_ids[0] for o in outs] == free[: cut + len(stop)]


def test_length_limits(make_engine, make_prompts):
    engine = make_engine(kv_cache_tokens=4096, max_model_len=64)
    assert engine.max_model_len == 64
    prompt = make_prompts([60], seed=14)[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=100, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs) == 4 and outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 4
    with pytest.raises(ValueError, match="^prompt has 65 tokens; the maximum context is 64$"):
        engine.add_request("b", make_prompts([65], seed=15)[0], SamplingParams())


def test_kv_budget_caps_the_context(make_engine):
    engine = make_engine(kv_cache_tokens=100, block_size=16)
    assert engine.kv_blocks_total == 6 and engine.max_model_len == 96
    with pytest.raises(ValueError, match="maximum context is 96"):
        engine.add_request("a", list(range(97)), SamplingParams())


def test_bad_requests(make_engine):
    engine = make_engine(kv_cache_tokens=1024)
    engine.add_request("a", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("b", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("c", [151936], SamplingParams())
    for bad in ([1, -1], [1, 2.0], [1, "2"], [1, None], [2**64]):
        with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 151936\)"):
            engine.add_request("d", bad, SamplingParams())
    assert engine.unfinished_request_ids() == ["a"]  # nothing refused was kept


def test_prompt_ids_are_kept_as_python_ints(make_engine):
    """Any integers the caller passes (numpy's too) become plain ints, the type every later step and message
    expects; the prefix cache hashes them alike."""
    engine = make_engine(kv_cache_tokens=1024)
    engine.add_request("a", np.arange(40, dtype=np.int32), SamplingParams())
    engine.add_request("b", list(range(40)), SamplingParams())
    engine.add_request("c", bytes(range(40)), SamplingParams())  # any iterable of ints, as list() reads it
    a, b, c = (engine._requests[r] for r in ("a", "b", "c"))
    assert a.token_ids == b.token_ids == c.token_ids == list(range(40)) and all(type(t) is int for t in a.token_ids)
    assert a.block_hash(1, 16) == b.block_hash(1, 16)


def test_step_stats_and_counters(make_engine, run_engine, make_prompts):
    prompts = make_prompts([10, 30], seed=16)
    engine = make_engine(kv_cache_tokens=4096)
    assert engine.step() == [] and engine.last_step is None
    _, steps = run_engine(engine, prompts, SamplingParams(max_tokens=5, ignore_eos=True))
    assert [s.index for s in steps] == list(range(5))
    first = steps[0]
    assert (first.kind, first.batch_size, first.num_tokens, first.num_prefill_tokens) == ("prefill", 2, 40, 40)
    assert first.duration_s > 0 and first.preemptions == 0
    assert all(s.kind == "decode" and s.num_tokens == 2 and s.num_decode_tokens == 2 for s in steps[1:])
    assert steps[-1].num_running == 0 and steps[-1].kv_blocks_used == 0
    c = engine.counters
    assert (c["prompt_tokens"], c["generation_tokens"], c["steps"], c["requests_finished"]) == (40, 10, 5, 2)
    assert c["prefix_cache_queries"] == 40 and c["prefix_cache_hits"] == 0


def test_string_prompts_are_tokenized_with_the_models_tokenizer(make_engine):
    engine = make_engine(kv_cache_tokens=1024)
    engine.add_request("a", "the model token cache", SamplingParams(max_tokens=1))
    [out] = engine.step()
    assert out.num_prompt_tokens == len(engine.tokenizer.encode("the model token cache"))


def test_offload_modes_build_a_host_tier(tiny_model_dir):
    for mode in ("prefix", "long", "prefix+long"):
        engine = Engine(tiny_model_dir, EngineConfig(offload=mode, kv_cache_tokens=1024, offload_host_gb=0.01,
                                                     offload_chunk_tokens=128))
        assert (engine.offload.prefix is not None, engine.offload.long is not None) == (
            "prefix" in mode, "long" in mode)
    assert Engine(tiny_model_dir, EngineConfig(kv_cache_tokens=1024)).offload is None


def test_random_workload_keeps_blocks_consistent(make_engine, run_engine, make_prompts):
    import random

    rng = random.Random(3)
    shared = make_prompts([24], seed=40)[0]
    prompts = [
        (shared[: rng.randrange(0, 25)] if rng.random() < 0.6 else []) + make_prompts([rng.randrange(1, 40)], seed=100 + i)[0]
        for i in range(24)
    ]
    params = [SamplingParams(max_tokens=rng.randrange(1, 10), ignore_eos=True) for _ in prompts]
    roomy = make_engine(kv_cache_tokens=8192)
    want = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        [want[f"r{i}"]], _ = run_engine(roomy, [p], sp)

    engine = make_engine(kv_cache_tokens=128, block_size=8, max_num_batched_tokens=40, max_num_seqs=6)
    got: dict[str, list[int]] = {}
    pending = list(range(len(prompts)))
    aborted = set()
    while pending or engine.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                i = pending.pop(0)
                engine.add_request(f"r{i}", prompts[i], params[i])
                got[f"r{i}"] = []
        if engine.num_running and rng.random() < 0.08:
            victim = engine.scheduler.running[-1].request_id
            engine.abort(victim)
            aborted.add(victim)
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        engine.block_manager.check_consistency(list(engine.scheduler.running) + list(engine.scheduler.waiting))
    assert engine.kv_blocks_used == 0
    assert engine.counters["preemptions"] > 0 and engine.counters["prefix_cache_hits"] > 0 and aborted
    for request_id, tokens in got.items():
        if request_id not in aborted:
            assert tokens == want[request_id], request_id
