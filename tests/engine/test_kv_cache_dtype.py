"""An 8-bit KV cache (`kv_cache_dtype=fp8`) on the torch path: the engine computes exactly the model whose K and V
are rounded to float8 e4m3 on their way into the cache, and holds more tokens in the same memory."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import random_prompts, spy_logits


def _run(model_dir, prompts, **overrides):
    """Greedy tokens and the logits of every sampled row, step by step."""
    from infertrace.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(model_dir, EngineConfig.from_overrides({"device": "cpu", "dtype": "float32", **overrides}))
    seen = spy_logits(engine)
    tokens = {}
    for i, prompt in enumerate(prompts):
        tokens[f"r{i}"] = []
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return list(tokens.values()), seen, engine


def test_fp8_cache_is_the_model_with_its_kv_rounded_through_fp8(tiny_model_dir, monkeypatch):
    # prompts long enough for chunked prefill with a small budget, and a shared prefix for a cache hit
    prompts = random_prompts([40, 75, 9])
    prompts.append(prompts[1][:48] + random_prompts([20], seed=3)[0])
    opts = dict(max_num_batched_tokens=64, kv_cache_tokens=4096)
    fp8_tokens, fp8_logits, engine = _run(tiny_model_dir, prompts, kv_cache_dtype="fp8", **opts)
    assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert engine.decode_path()["kv_cache_dtype"] == "float8_e4m3fn"
    plain_tokens, plain_logits, _ = _run(tiny_model_dir, prompts, **opts)

    import infertrace.engine.attention as attention

    def rounded(cache, slots, x):  # a float32 cache holding exactly the values an 8-bit one would
        cache.index_copy_(0, slots, x.to(torch.float8_e4m3fn).to(x.dtype))

    monkeypatch.setattr(attention, "store", rounded)
    want_tokens, want_logits, _ = _run(tiny_model_dir, prompts, **opts)

    assert fp8_tokens == want_tokens
    assert len(fp8_logits) == len(want_logits) == len(plain_logits)
    for ours, want in zip(fp8_logits, want_logits):
        torch.testing.assert_close(ours, want, rtol=0, atol=0)
    # and the rounding is really there: the float32 cache gives other logits
    assert max((a - b).abs().max().item() for a, b in zip(fp8_logits, plain_logits)) > 1e-4


def test_fp8_cache_holds_four_times_the_float32_tokens(tiny_model_dir):
    from infertrace.engine import Engine, EngineConfig

    blocks = {}
    for dtype in ("auto", "fp8"):
        cfg = EngineConfig(device="cpu", dtype="float32", cpu_kv_cache_gb=0.01, kv_cache_dtype=dtype)
        runner = Engine(tiny_model_dir, cfg).runner
        blocks[dtype] = runner.num_blocks
        assert runner.kv_cache.element_size() == (4 if dtype == "auto" else 1)
    assert blocks["fp8"] // 4 == blocks["auto"]


def test_saturates_like_the_gpu_kernels():
    """Values past float8 e4m3's largest finite value are stored as +-448, as Triton's conversion does, not NaN."""
    from infertrace.engine.attention import store

    cache = torch.zeros(4, 1, 2, dtype=torch.float8_e4m3fn)
    store(cache, torch.tensor([2, 0]), torch.tensor([[[1000.0, -3.0]], [[-500.0, 0.1]]]))
    assert cache.float().view(-1).tolist() == [-448.0, 0.1015625, 0, 0, 448.0, -3.0, 0, 0]


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3"])
def test_names_vllm_accepts(dtype):
    from infertrace.engine import EngineConfig

    assert EngineConfig.from_overrides({"kv_cache_dtype": dtype}).kv_cache_dtype == dtype
