"""LLM.generate: prompt shapes, per-prompt params, the optional progress bar."""

from __future__ import annotations

import pytest

from infertrace.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, kv_cache_tokens=2048, block_size=8)


def test_prompt_shapes_and_per_prompt_params(llm):
    [single] = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(single.token_ids) == 3 and single.num_prompt_tokens == 3
    outs = llm.generate(
        ["the model", [5, 6, 7]],
        [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True)],
        progress=True,
    )
    assert [len(o.token_ids) for o in outs] == [2, 3]
    assert outs[1].token_ids == single.token_ids
    assert outs[1].num_cached_tokens == 0  # 3 tokens: no full block to reuse
    assert llm.engine.kv_blocks_used == 0


def test_errors_leave_no_request_behind(llm):
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="maximum context"):
        llm.generate([[1, 2], list(range(3000))], SamplingParams(max_tokens=1))
    assert not llm.engine.has_unfinished()


def test_unknown_config_field(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown engine config field"):
        LLM(tiny_model_dir, kv_tokens=10)
