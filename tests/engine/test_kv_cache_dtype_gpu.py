"""The 8-bit KV cache on the GPU path (Triton kernels, the K/V write fused into q/k-norm + RoPE, decode and
token-count graphs), in float32 (GPU only). The kernels' own tests check the rounding and the attention bit for bit.
Across two paths whose float32 sums differ in the last bit (graphs pad a step's GEMMs), exact tokens are not to be
expected: a K or V value a hair either side of an 8-bit rounding boundary lands a whole step (1/16) apart, and over
thousands of values some do. So here: the graphs' logits stay within a small distance of the eager path's for
every step, the tokens match for the first steps, and the 8-bit cache moves a prefill's logits by rounding alone."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qwen06_f32(tmp_path_factory):
    from infertrace.modelgen import init_model

    return init_model("qwen3-0.6b", tmp_path_factory.mktemp("fp8") / "m", seed=0, dtype="float32")


def _run(path, prompts, max_tokens=24, **overrides):
    from infertrace.engine import Engine, EngineConfig, SamplingParams
    from tests.engine.conftest import spy_logits

    engine = Engine(path, EngineConfig.from_overrides({"kv_cache_tokens": 16384, "kv_cache_dtype": "fp8",
                                                       "max_num_batched_tokens": 256, **overrides}))
    seen = spy_logits(engine)
    tokens = {}
    for i, p in enumerate(prompts):
        tokens[f"r{i}"] = []
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    torch.cuda.synchronize()
    dtype = engine.runner.kv_cache.dtype
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return list(tokens.values()), seen, dtype


def test_graphs_give_the_eager_tokens_over_an_fp8_cache(qwen06_f32):
    from tests.engine.conftest import random_prompts

    prompts = random_prompts([200, 9, 64, 513, 3])
    prompts.append(prompts[3][:320] + prompts[0][:40])  # a prefix-cache hit over 8-bit blocks
    got, got_logits, dtype = _run(qwen06_f32, prompts, max_tokens=8)  # chunked prefill too (256-token budget)
    assert dtype == torch.float8_e4m3fn
    want, want_logits, _ = _run(qwen06_f32, prompts, max_tokens=8, cuda_graphs=False, prefill_cuda_graphs=False)
    errors = [((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item() for a, b in zip(got_logits, want_logits)]
    print("largest relative logit distance per step:", " ".join(f"{e:.1e}" for e in errors))
    assert len(got_logits) == len(want_logits) and max(errors) < 1e-2, errors
    assert got == want


def test_fp8_cache_moves_a_prefill_by_rounding_alone(qwen06_f32):
    """The first token's logits of a 500-token prompt: near the float32 cache's (random weights: about 6% apart in
    one run), and not equal."""
    from tests.engine.conftest import random_prompts

    prompt = random_prompts([500], seed=9)
    _, fp8, _ = _run(qwen06_f32, prompt, max_tokens=1)
    _, full, dtype = _run(qwen06_f32, prompt, max_tokens=1, kv_cache_dtype="auto")
    assert dtype == torch.float32
    err = ((fp8[0] - full[0]).norm() / full[0].norm()).item()
    assert 1e-3 < err < 0.15, err
