"""Sampling: seeded requests repeat exactly, top_k=1 is greedy, filters keep only what they should."""

from __future__ import annotations

import pytest
import torch

from infertrace.engine import SamplingParams
from infertrace.engine.sampler import Sampler


def test_seeded_sampling_repeats_whatever_the_batch(make_engine, run_engine, make_prompts):
    prompts = make_prompts([12, 40, 7, 90], seed=5)
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    engine = make_engine(kv_cache_tokens=4096)
    together, _ = run_engine(engine, prompts, params)
    alone, _ = run_engine(engine, prompts[1:2], params)
    assert together[1] == alone[0]
    again, _ = run_engine(make_engine(kv_cache_tokens=4096, max_num_seqs=2), prompts, params)
    assert again == together
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=99, ignore_eos=True)
    different, _ = run_engine(engine, prompts[1:2], other_seed)
    assert different[0] != alone[0]


def test_unseeded_sampling_follows_the_engine_seed(make_engine, run_engine, make_prompts):
    prompts = make_prompts([10, 20], seed=6)
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    a, _ = run_engine(make_engine(kv_cache_tokens=4096, seed=3), prompts, params)
    b, _ = run_engine(make_engine(kv_cache_tokens=4096, seed=3), prompts, params)
    c, _ = run_engine(make_engine(kv_cache_tokens=4096, seed=4), prompts, params)
    assert a == b and a != c


def test_top_k_one_is_greedy(make_engine, run_engine, make_prompts):
    prompts = make_prompts([3, 33, 130], seed=7)
    engine = make_engine(kv_cache_tokens=4096)
    greedy, _ = run_engine(engine, prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    top1, _ = run_engine(engine, prompts, SamplingParams(max_tokens=32, temperature=1.5, top_k=1, ignore_eos=True))
    assert top1 == greedy


def draws(logits, params, n=400):
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    gen = sampler.make_generator(0)
    return {int(sampler(logits[None], [params], [gen])[0]) for _ in range(n)}


def test_top_k_and_top_p_filters():
    logits = torch.tensor([0.0, 3.0, 2.9, 2.8, -1.0, 1.0])
    assert draws(logits, SamplingParams(temperature=1.0, top_k=2)) == {1, 2}
    # probabilities of 1, 2, 3 are about 0.35, 0.32, 0.29: the smallest set reaching 0.5 is {1, 2}
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.5)) == {1, 2}
    assert draws(logits, SamplingParams(temperature=1.0, top_p=0.01)) == {1}
    assert draws(logits, SamplingParams(temperature=1.0)) >= {0, 1, 2, 3, 5}


def test_greedy_rows_take_the_argmax():
    sampler = Sampler(seed=0, device=torch.device("cpu"))
    logits = torch.tensor([[0.0, 1.0, 0.5], [2.0, 1.0, 0.0]])
    assert sampler(logits, [SamplingParams(), SamplingParams()], [None, None]).tolist() == [1, 0]


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"stop": [""]}],
)
def test_invalid_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
