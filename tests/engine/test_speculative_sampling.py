"""Sampled requests under speculative decoding: the acceptance rule leaves each token's distribution as plain
sampling makes it (chi-square tests with fixed seeds, whose bound a wrong rule fails)."""

from __future__ import annotations

import pytest
import torch

from infertrace.engine import rejection_sampler
from infertrace.engine.sampler import draw, target_probs
from infertrace.engine.sampling_params import SamplingParams

P_VALUE_FLOOR = 1e-3  # a right rule fails this about once in a thousand seeds; the wrong rules below are far under
TRIALS = 6000


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """P-value of Pearson's goodness of fit (cells expected to hold nothing must hold nothing)."""
    keep = expected > 0
    if (observed[~keep] > 0).any():
        return 0.0
    stat = float((((observed - expected) ** 2) / expected)[keep].sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def contingency_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """P-value of the chi-square test that two count vectors come from one distribution."""
    table = torch.stack([a, b]).double()
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def always_accept(logits, drafts, params, generator):
    """A wrong rule: every draft kept, then a sample at the end."""
    ids, probs = target_probs(logits[len(drafts)].float(), params)
    return [*drafts, int(draw(ids, probs, generator))]


def resample_with_the_draft(logits, drafts, params, generator):
    """A wrong rule: on a rejection, draw from p itself instead of p with the draft removed."""
    out = []
    for j, draft in enumerate(drafts):
        ids, probs = target_probs(logits[j].float(), params)
        p = float(probs[draft] / probs.sum())
        if float(torch.rand(1, generator=generator)) < p:
            out.append(draft)
            continue
        return [*out, int(draw(ids, probs, generator))]
    ids, probs = target_probs(logits[len(drafts)].float(), params)
    return [*out, int(draw(ids, probs, generator))]


LOGITS = torch.tensor([[2.0, 1.5, 0.3, -1.0, 0.9, 0.0, -3.0, 1.1],
                       [0.1, 2.2, -0.5, 1.0, 1.0, 0.4, 0.0, -2.0]])
PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
          SamplingParams(temperature=1.3, top_p=0.8)]


def first_tokens(rule, params: SamplingParams, draft: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the first token `rule` emits over TRIALS verify steps with one draft, and of the second where
    the draft was kept."""
    g = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(8), torch.zeros(8)
    for _ in range(TRIALS):
        out = rule(LOGITS, [draft], params, g)
        first[out[0]] += 1
        if len(out) == 2:
            second[out[1]] += 1
    return first, second


def expected(params: SamplingParams, row: int, n: float) -> torch.Tensor:
    ids, probs = target_probs(LOGITS[row].float(), params)
    full = torch.zeros(8)
    full[ids if ids is not None else torch.arange(8)] = probs / probs.sum()
    return full * n


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7-top4", "t1.3-topp0.8"])
@pytest.mark.parametrize("draft", [0, 4, 6])
def test_the_acceptance_rule_keeps_each_token_distributed_as_p(params, draft):
    """Whatever the draft (likely, middling, or outside top-k/top-p), the first token is distributed as p at its
    position, and the token after an accepted draft as p at the next."""
    first, second = first_tokens(rejection_sampler.accept_sampled, params, draft)
    assert chi_square_p(first, expected(params, 0, TRIALS)) > P_VALUE_FLOOR
    if second.sum() > 100:
        assert chi_square_p(second, expected(params, 1, float(second.sum()))) > P_VALUE_FLOOR


@pytest.mark.parametrize("rule", [always_accept, resample_with_the_draft])
def test_the_bound_fails_a_wrong_rule(rule):
    first, _ = first_tokens(rule, PARAMS[0], 4)
    assert chi_square_p(first, expected(PARAMS[0], 0, TRIALS)) < 1e-6


def test_greedy_acceptance_keeps_drafts_while_they_are_the_argmax():
    accept = rejection_sampler.accept_greedy
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept([5, 9, 7], [5, 6, 7, 8]) == [5, 6]
    assert accept([1], [5, 6]) == [5]
    assert accept([], [5]) == [5]


def _sampled_pairs(model_dir, n: int, speculative: dict | None):
    """The (first, second) output tokens of `n` seeded requests of one prompt (temperature 1, top-k 4), and the
    engine."""
    from infertrace.engine import Engine, EngineConfig

    engine = Engine(model_dir, EngineConfig.from_overrides(
        {"speculative_config": speculative, "max_num_seqs": n, "max_num_batched_tokens": 16384,
         "kv_cache_tokens": 65536}))
    prompt = [11, 22, 33, 44, 55, 66, 11, 22]
    for i in range(n):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=3, temperature=1.0, top_k=4, seed=i,
                                                          ignore_eos=True))
    outs: dict[str, list[int]] = {str(i): [] for i in range(n)}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
    pairs = [tuple(v[:2]) for v in outs.values()]
    return pairs, engine


def test_engine_samples_the_same_distribution_with_drafts(tiny_model_dir, monkeypatch):
    """The model as its own draft proposes its argmax, which is accepted with probability p(argmax): the pairs of
    first and second tokens of seeded requests are distributed alike with and without drafts; with every draft
    accepted they are not."""
    n = 500
    plain, _ = _sampled_pairs(tiny_model_dir, n, None)
    spec = {"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 2}
    drafted, engine = _sampled_pairs(tiny_model_dir, n, spec)
    assert engine.counters["spec_decode_num_drafts"] >= n
    c = engine.counters
    assert 0 < c["spec_decode_num_accepted_tokens"] < c["spec_decode_num_draft_tokens"]
    assert contingency_p(*_counts(plain, drafted)) > P_VALUE_FLOOR
    monkeypatch.setattr(rejection_sampler, "accept_sampled", always_accept)
    wrong, _ = _sampled_pairs(tiny_model_dir, n, spec)
    assert contingency_p(*_counts(plain, wrong)) < 1e-6


def _counts(a: list, b: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of each distinct item of `a` and `b`, over the same cells."""
    index = {cell: i for i, cell in enumerate(sorted(set(a) | set(b)))}
    out = torch.zeros(2, len(index))
    for row, items in enumerate((a, b)):
        for item in items:
            out[row, index[item]] += 1
    return out[0], out[1]
