"""KV offload on CUDA: copy streams and events, pinned host memory, fused chunk attention, engine parity."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

GREEDY = {"max_tokens": 12, "ignore_eos": True}


def _prompts(lengths, seed):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(151936) for _ in range(n)] for n in lengths]


def _run(engine, prompts, params):
    ids = [f"r{engine.counters['requests_added'] + i}" for i in range(len(prompts))]
    for request_id, p in zip(ids, prompts):
        engine.add_request(request_id, p, params)
    tokens, steps = {i: [] for i in ids}, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps.append(engine.last_step)
    return [tokens[i] for i in ids], steps


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_chunk_attention_is_used_and_agrees(dtype):
    import torch

    from infertrace.engine.offload import ChunkAttention, attend_chunk_reference

    dt = getattr(torch, dtype)
    attention = ChunkAttention(torch.device("cuda"), dt, 16, 8, 128)
    assert attention.name != "reference", "no fused kernel passed the self-check"
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(300, 16, 128, generator=gen).cuda().to(dt)
    k = torch.randn(4096, 8, 128, generator=gen).cuda().to(dt)
    v = torch.randn(4096, 8, 128, generator=gen).cuda().to(dt)
    tol = 2e-2 if dt == torch.bfloat16 else 1e-4
    for causal, keys in ((False, slice(0, 4096)), (True, slice(3796, 4096))):
        got = attention(q, k[keys], v[keys], 128**-0.5, causal)
        want = attend_chunk_reference(q, k[keys], v[keys], 128**-0.5, causal)
        torch.testing.assert_close(got[0], want[0], atol=tol, rtol=tol)
        torch.testing.assert_close(got[1], want[1], atol=tol, rtol=tol)


def test_transfers_on_copy_streams_with_events():
    import torch

    from infertrace.engine.offload import Transfers
    from infertrace.engine.offload.transfers import D2H, H2D

    transfers = Transfers(torch.device("cuda"))
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    device = torch.empty(1 << 20, device="cuda")
    done = []
    load = transfers.copy(H2D, [(device, host)], on_done=lambda: done.append("load"))
    transfers.wait(load)
    device.mul_(2)  # on the compute stream, after the load
    back = torch.empty_like(host).pin_memory()
    transfers.copy(D2H, [(back, device)], on_done=lambda: done.append("store"))
    transfers.synchronize()
    assert done == ["load", "store"] and torch.equal(back, host * 2)
    assert transfers.bytes_h2d == transfers.bytes_d2h == 4 << 20 and transfers.seconds > 0


def test_engine_offload_matches_offload_off_on_cuda(tiny_model_dir):
    from infertrace.engine import Engine, EngineConfig, SamplingParams

    params = SamplingParams(**GREEDY)
    prefixes = _prompts([160, 160, 160], seed=1)
    shared = [p + s for p, s in zip([prefixes[i] for i in (0, 1, 2, 0, 1)], _prompts([5, 9, 23, 1, 16], seed=2))]
    long_prompt = _prompts([900], seed=3)

    def engine(**overrides):
        return Engine(tiny_model_dir, EngineConfig.from_overrides({"device": "cuda", "dtype": "float32", **overrides}))

    off = engine(kv_cache_tokens=256)
    prefix = engine(kv_cache_tokens=256, offload="prefix", offload_host_gb=0.05)
    want = [_run(off, [p], params)[0][0] for p in shared]
    got = [_run(prefix, [p], params)[0][0] for p in shared]
    assert got == want
    assert prefix.offload.prefix is not None and prefix.counters["cpu_prefix_cache_hits"] >= 2 * 160
    assert prefix.offload.pool.tensor.is_pinned()

    big = engine(kv_cache_tokens=4096, max_num_batched_tokens=256)
    long = engine(kv_cache_tokens=320, offload="long", offload_host_gb=0.05, offload_chunk_tokens=128,
                  max_num_batched_tokens=256)
    want, _ = _run(big, long_prompt, params)
    got, steps = _run(long, long_prompt, params)
    assert got == want and all(s.long_context for s in steps)
    long.offload.transfers.synchronize()
    assert long.counters["offload_bytes_h2d"] > 0
