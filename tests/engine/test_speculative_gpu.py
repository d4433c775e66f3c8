"""Speculative decoding on CUDA: verify steps through the same attention kernels and token-count CUDA graphs as
chunked prefill, greedy output identical to plain decoding with each drafter, sampling unchanged."""

from __future__ import annotations

import gc

import pytest

from tests.engine.conftest import prompt_waves
from tests.engine.test_speculative import NGRAM, repeating_prompts, self_draft
from tests.engine.test_speculative_sampling import P_VALUE_FLOOR, _counts, _sampled_pairs, contingency_p

pytestmark = pytest.mark.gpu

KV = {"kv_cache_tokens": 65536}


@pytest.fixture(scope="module")
def qwen06_float32(tmp_path_factory):
    from infertrace.modelgen import init_model

    return init_model("qwen3-0.6b", tmp_path_factory.mktemp("gpu-models") / "f32", seed=0, dtype="float32")


def _run(path, prompts, max_tokens: int = 48, **overrides):
    """Every prompt's greedy tokens in one batch, the engine's counters, and how many verify steps replayed a
    token-count graph."""
    import torch

    from infertrace.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(path, EngineConfig.from_overrides({**KV, **overrides}))
    assert engine.runner.device.type == "cuda"
    replays = []
    graphs = engine.runner.token_graphs
    if graphs is not None:
        replay = graphs.replay

        def spy(bucket, num_tokens):
            replays.append(bucket)
            return replay(bucket, num_tokens)

        graphs.replay = spy
    out = {str(i): [] for i in range(len(prompts))}
    verify_steps = 0
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        verify_steps += engine.last_step is not None and engine.last_step.kind == "verify"
    counters = dict(engine.counters)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return list(out.values()), counters, len(replays), verify_steps


@pytest.mark.parametrize("drafter", ["ngram", "self", "tiny"])
def test_greedy_parity_with_each_drafter_on_cuda(drafter, qwen06_float32, tiny_model_dir):
    # float32: the verify step's prefill kernels and the decode graphs round alike enough that no token flips
    prompts = repeating_prompts(0, 10) + prompt_waves(1, [[1, 200, 37]])[0]
    plain, _, _, _ = _run(qwen06_float32, prompts)
    spec = {"ngram": NGRAM, "self": self_draft(qwen06_float32), "tiny": self_draft(tiny_model_dir, 4)}[drafter]
    got, c, replays, verify_steps = _run(qwen06_float32, prompts, speculative_config=spec)
    assert got == plain
    assert c["spec_decode_num_draft_tokens"] > 0 and verify_steps > 0
    assert replays >= verify_steps  # every verify step (a step of several tokens a request) replays a graph
    if drafter == "self":
        assert c["spec_decode_num_accepted_tokens"] == c["spec_decode_num_draft_tokens"]


def test_verify_steps_run_eagerly_with_prefill_graphs_off(qwen06_float32):
    prompts = repeating_prompts(2, 6)
    plain, _, _, _ = _run(qwen06_float32, prompts, 32)
    got, c, replays, _ = _run(qwen06_float32, prompts, 32, speculative_config=NGRAM, prefill_cuda_graphs=False)
    assert got == plain and replays == 0 and c["spec_decode_num_drafts"] > 0


def test_sampled_distribution_unchanged_on_cuda(tiny_model_dir):
    n = 500
    plain, _ = _sampled_pairs(tiny_model_dir, n, None)
    drafted, engine = _sampled_pairs(tiny_model_dir, n, self_draft(tiny_model_dir, 2))
    assert engine.runner.device.type == "cuda"
    assert 0 < engine.counters["spec_decode_num_accepted_tokens"] < engine.counters["spec_decode_num_draft_tokens"]
    assert contingency_p(*_counts(plain, drafted)) > P_VALUE_FLOOR
