"""The 8-bit KV cache on the GPU path (Triton kernels, fused K/V write, decode and token-count graphs) against the
torch reference attention over the same 8-bit cache, in float32 (GPU only)."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu


def _run(path, prompts, **overrides):
    from infertrace.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(path, EngineConfig.from_overrides({"kv_cache_tokens": 16384, "kv_cache_dtype": "fp8",
                                                       **overrides}))
    assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    seen = []
    sampler = engine.runner.sampler

    def spy(rows, sampling, generators):
        seen.append(rows.float().cpu())
        return sampler(rows, sampling, generators)

    engine.runner.sampler = spy
    tokens = {}
    for i, p in enumerate(prompts):
        tokens[f"r{i}"] = []
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=24, ignore_eos=True))
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    torch.cuda.synchronize()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return list(tokens.values()), seen


def test_triton_fp8_cache_gives_the_torch_reference_tokens(tmp_path):
    from infertrace.modelgen import init_model
    from tests.engine.conftest import random_prompts

    path = init_model("qwen3-0.6b", tmp_path / "m", seed=0, dtype="float32")
    prompts = random_prompts([200, 9, 64, 513, 3])
    prompts.append(prompts[3][:320] + prompts[0][:40])  # a prefix-cache hit over 8-bit blocks
    got, got_logits = _run(path, prompts, max_num_batched_tokens=256)  # chunked prefill too
    want, want_logits = _run(path, prompts, max_num_batched_tokens=256, attention_backend="torch")
    assert got == want
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
