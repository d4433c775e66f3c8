"""KV offload in the engine: outputs equal offload=off token for token, with the host tier and long mode engaged."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from infertrace.engine import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
HOST_GB = 0.02  # 655 blocks of the tiny model (32 KiB each): about 10k tokens
LONG = {"offload_chunk_tokens": 64, "offload_ring_slots": 2, "max_num_batched_tokens": 128}


class LogitRecorder:
    """Stands in for the runner's sampler and keeps every logits row it was given."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.rows: list[torch.Tensor] = []

    def __call__(self, logits, params, generators):
        self.rows += list(logits.detach().clone())
        return self.sampler(logits, params, generators)


def recording(engine):
    engine.runner.sampler = LogitRecorder(engine.runner.sampler)
    return engine.runner.sampler


def sequential(engine, run_engine, prompts, params=GREEDY):
    """One request at a time; returns the tokens of each and every step's stats."""
    tokens, steps = [], []
    for prompt in prompts:
        out, s = run_engine(engine, [prompt], params)
        tokens += out
        steps += s
    return tokens, steps


def assert_drained(engine):
    engine.offload.poll()
    assert engine.kv_blocks_used == 0
    engine.block_manager.check_consistency([])
    engine.offload.pool.check_consistency()
    assert all(b.ref_count == 0 for b in engine.offload.pool.blocks), "a host block stayed pinned"


@pytest.fixture(scope="module")
def prefixed(make_prompts):
    """Three 160-token prefixes (10 blocks each), used by turns: together 30 blocks against a 16-block pool."""
    prefixes = make_prompts([160, 160, 160], seed=7)
    suffixes = make_prompts([5, 9, 23, 1, 16, 40, 3], seed=8)
    order = [0, 1, 2, 0, 1, 2, 0]
    return [prefixes[i] + s for i, s in zip(order, suffixes)]


def test_prefix_tier_serves_evicted_prefixes_and_matches_offload_off(make_engine, run_engine, prefixed, hf_reference):
    off = make_engine(kv_cache_tokens=256)
    off_logits = recording(off)
    want, off_steps = sequential(off, run_engine, prefixed)

    engine = make_engine(kv_cache_tokens=256, offload="prefix", offload_host_gb=HOST_GB)
    logits = recording(engine)
    got, steps = sequential(engine, run_engine, prefixed)

    assert got == want
    hf_reference.assert_matches(prefixed, got, new_tokens=8)
    assert len(logits.rows) == len(off_logits.rows)
    for a, b in zip(logits.rows, off_logits.rows):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)

    c = engine.counters
    # the last four requests find their prefix evicted from the 16-block pool: off recomputes it, prefix loads it
    assert off.counters["recomputed_tokens"] == 4 * 160 and off.counters["cpu_prefix_cache_hits"] == 0
    assert c["cpu_prefix_cache_hits"] == 4 * 160 and c["recomputed_tokens"] == 0
    assert c["prefix_cache_hits"] == off.counters["prefix_cache_hits"]
    assert sum(s.cpu_prefix_cache_hits for s in steps) == c["cpu_prefix_cache_hits"]
    block_bytes = engine.offload.pool.block_nbytes
    assert c["offload_blocks_loaded"] == 4 * 10 and c["offload_bytes_h2d"] == 40 * block_bytes
    assert c["offload_bytes_d2h"] == c["offload_blocks_stored"] * block_bytes > 0
    assert sum(s.offload_bytes_h2d for s in steps) == c["offload_bytes_h2d"]
    assert sum(s.offload_bytes_d2h for s in steps) == c["offload_bytes_d2h"]
    assert c["offload_transfer_seconds"] > 0
    # fewer tokens computed: only the suffixes of the last four requests
    assert sum(s.num_prefill_tokens for s in steps) == sum(s.num_prefill_tokens for s in off_steps) - 4 * 160
    assert_drained(engine)


def test_concurrent_requests_share_host_hits(make_engine, run_engine, make_prompts, hf_reference):
    prefixes = make_prompts([160] * 5, seed=11)
    first = [p + s for p, s in zip(prefixes, make_prompts([4] * 5, seed=12))]
    # then four at once, on the prefixes the 32-block pool evicted first
    second = [prefixes[i] + s for i, s in zip([0, 1, 0, 2], make_prompts([7, 30, 2, 19], seed=13))]
    results = {}
    for mode in ("off", "prefix"):
        engine = make_engine(kv_cache_tokens=512, offload=mode, offload_host_gb=HOST_GB, max_num_batched_tokens=96)
        tokens, _ = sequential(engine, run_engine, first)
        more, steps = run_engine(engine, second, GREEDY)
        results[mode] = (tokens + more, engine, steps)
    assert results["prefix"][0] == results["off"][0]
    hf_reference.assert_matches(first + second, results["prefix"][0], new_tokens=8)
    engine, steps = results["prefix"][1], results["prefix"][2]
    assert results["off"][1].counters["recomputed_tokens"] > 0 and engine.counters["recomputed_tokens"] == 0
    # prefixes 0, 1 and 2 come back from the host (a leading block may still be on the device); the second
    # request on prefix 0 then hits the blocks the first one loaded
    assert engine.counters["cpu_prefix_cache_hits"] >= 3 * 160 - 16
    assert any(s.cpu_prefix_cache_hits and s.batch_size > 1 for s in steps)
    assert_drained(engine)


def test_long_context_request_beyond_the_gpu_pool_matches_offload_off(make_engine, run_engine, make_prompts):
    prompt = make_prompts([700], seed=21)[0]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    off = make_engine(kv_cache_tokens=2048, max_num_batched_tokens=128)
    off_logits = recording(off)
    want, _ = run_engine(off, [prompt], params)

    engine = make_engine(kv_cache_tokens=256, offload="long", offload_host_gb=HOST_GB, **LONG)
    # the ring of 2 slots x 64 tokens per layer takes 64 of the 256 tokens of device KV
    assert engine.kv_blocks_total * 16 == 192 < len(prompt)
    logits = recording(engine)
    got, steps = run_engine(engine, [prompt], params)

    assert got == want
    assert len(logits.rows) == len(off_logits.rows) == 12
    for a, b in zip(logits.rows, off_logits.rows):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert all(s.long_context for s in steps) and len(steps) == 6 + 11  # 700 tokens in chunks of 128, 11 decodes
    c = engine.counters
    assert c["long_context_requests"] == 1 and c["long_context_steps"] == len(steps)
    assert engine.max_model_len > engine.kv_blocks_total * 16
    # every token's K/V of every layer went to the host once; earlier chunks came back for each later step
    kv_bytes_per_token = engine.runner.kv_bytes_per_token
    assert c["offload_bytes_d2h"] == (700 + 11) * kv_bytes_per_token
    assert c["offload_bytes_h2d"] > c["offload_bytes_d2h"]
    assert sum(s.offload_bytes_h2d for s in steps) == c["offload_bytes_h2d"]
    assert engine.block_manager.num_used_blocks == 0  # it never held a device block
    assert_drained(engine)


def test_long_request_alternates_with_short_ones(make_engine, run_engine, make_prompts):
    prompts = make_prompts([40, 500, 90, 17, 130], seed=31)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want, _ = run_engine(make_engine(kv_cache_tokens=4096, max_num_batched_tokens=128), prompts, params)
    engine = make_engine(kv_cache_tokens=256, offload="long", offload_host_gb=HOST_GB, **LONG)
    got, steps = run_engine(engine, prompts, params)
    assert got == want
    kinds = [s.long_context for s in steps]
    assert any(kinds) and not all(kinds)
    # while short requests run, a long step is followed by a step of theirs
    assert any(a and not b for a, b in itertools.pairwise(kinds))
    assert engine.counters["long_context_requests"] == 1
    assert_drained(engine)


def test_prefix_and_long_together(make_engine, run_engine, make_prompts, prefixed):
    long_prompt = make_prompts([600], seed=41)[0]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    workload = prefixed[:4] + [long_prompt] + prefixed[4:]
    results = {}
    for mode, kv in (("off", 4096), ("prefix+long", 320)):  # 256 tokens left beside the ring
        engine = make_engine(kv_cache_tokens=kv, offload=mode, offload_host_gb=HOST_GB, **LONG)
        results[mode] = sequential(engine, run_engine, workload, params)[0]
    assert results["prefix+long"] == results["off"]
    assert engine.counters["long_context_requests"] == 1 and engine.counters["cpu_prefix_cache_hits"] > 0
    assert_drained(engine)


def test_aborting_a_long_request_gives_its_host_blocks_back(make_engine, make_prompts):
    engine = make_engine(kv_cache_tokens=256, offload="long", offload_host_gb=HOST_GB, **LONG)
    pool = engine.offload.pool
    engine.add_request("long", make_prompts([700], seed=51)[0], SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert pool.num_free_blocks == pool.num_blocks - -(-750 // 16)
    engine.abort("long")
    assert not engine.has_unfinished() and pool.num_free_blocks == pool.num_blocks
    assert_drained(engine)


def test_offload_ranges_in_the_profiler_trace(make_engine, run_engine, prefixed, make_prompts, tmp_path):
    engine = make_engine(kv_cache_tokens=256, offload="prefix+long", offload_host_gb=HOST_GB, **LONG)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sequential(engine, run_engine, prefixed[:4] + make_prompts([300], seed=61), SamplingParams(max_tokens=2))
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("step[")]
    for name in ("offload.load", "offload.store"):
        ranges = [e for e in events if e["name"] == name]
        assert ranges, name
        assert all(any(s["ts"] <= r["ts"] and r["ts"] + r["dur"] <= s["ts"] + s["dur"] for s in steps) for r in ranges)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"offload": "prefix", "offload_host_gb": 1e6}, r"offload_host_gb=1e\+06 asks for .* only .* GiB is available"),
        ({"offload": "long", "kv_cache_tokens": 64, **LONG}, "offload=long streams KV through 2 GPU slots"),
        ({"offload": "long", "kv_cache_tokens": 256, "max_model_len": 4000, "offload_host_gb": 0.001, **LONG},
         r"max_model_len=4000 does not fit the host KV pool \(512 tokens\)"),
    ],
)
def test_bad_offload_settings_give_one_clear_error(tiny_model_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        Engine(tiny_model_dir, EngineConfig.from_overrides({"offload_host_gb": HOST_GB, **overrides}))


def test_bad_offload_config_values():
    with pytest.raises(ValueError, match="offload_ring_slots must be at least 2"):
        EngineConfig(offload="long", offload_ring_slots=1)
    with pytest.raises(ValueError, match="needs prefix_caching=true"):
        EngineConfig(offload="prefix", prefix_caching=False)
    with pytest.raises(ValueError, match="offload_chunk_tokens must be at least 1"):
        EngineConfig(offload_chunk_tokens=0)
    assert EngineConfig.from_overrides({"offload": "prefix+long"}).offload_long


def test_long_mode_caps_the_context_by_the_host_pool(make_engine):
    engine = make_engine(kv_cache_tokens=256, offload="long", offload_host_gb=0.001, **LONG)
    capacity = engine.offload.pool.num_blocks * 16
    assert engine.max_model_len == capacity < 4096
    with pytest.raises(ValueError, match="maximum context"):
        engine.add_request("x", list(range(capacity + 1)))


def test_preemption_counts_recomputed_tokens(make_engine, run_engine, make_prompts):
    engine = make_engine(kv_cache_tokens=256, block_size=16)
    prompts = make_prompts([100, 100, 100], seed=71)
    _, steps = run_engine(engine, prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    assert engine.counters["preemptions"] > 0 and engine.counters["recomputed_tokens"] > 0
    assert sum(s.recomputed_tokens for s in steps) == engine.counters["recomputed_tokens"]


def test_random_workload_with_aborts_matches_offload_off(make_engine, make_prompts):
    import random

    seed = 2  # a workload in which host-tier hits, long requests and aborts all occur
    rng = random.Random(seed)
    prefixes = make_prompts([32, 64, 100, 150], seed=81)
    prompts, params = [], []
    for i, n in enumerate(make_prompts([rng.choice([2, 9, 30, 300, 450]) for _ in range(14)], seed=82)):
        prompts.append((rng.choice(prefixes) if i % 3 else []) + n)
        params.append(SamplingParams(max_tokens=rng.randrange(1, 10), ignore_eos=True))

    def run(engine, abort_rate):
        rng = random.Random(seed + 1)
        tokens: dict[str, list[int]] = {}
        todo, aborted = list(enumerate(prompts)), set()
        while todo or engine.has_unfinished():
            for _ in range(rng.randrange(3)):
                if todo:
                    i, p = todo.pop(0)
                    engine.add_request(f"r{i}", p, params[i])
                    tokens[f"r{i}"] = []
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            if rng.random() < abort_rate and engine.unfinished_request_ids():
                request_id = rng.choice(engine.unfinished_request_ids())
                engine.abort(request_id)
                aborted.add(request_id)
        return {k: v for k, v in tokens.items() if k not in aborted}

    want = run(make_engine(kv_cache_tokens=4096, max_num_batched_tokens=100), 0.0)
    engine = make_engine(kv_cache_tokens=224, offload="prefix+long", offload_host_gb=0.003, offload_chunk_tokens=48,
                         offload_ring_slots=3, max_num_batched_tokens=100, max_num_seqs=6)
    got = run(engine, 0.08)
    assert len(got) < len(want) and all(got[k] == want[k] for k in got)
    c = engine.counters
    assert c["long_context_requests"] > 0 and c["cpu_prefix_cache_hits"] > 0 and c["requests_aborted"] > 0
    assert_drained(engine)
