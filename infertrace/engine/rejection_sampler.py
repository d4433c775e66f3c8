"""The verify step's outcome: which drafted tokens a request keeps, and the token after them.

Drafts here are proposed deterministically (n-gram lookup, or a draft model run greedily), so the draft
distribution q is one-hot and the standard rule (accept draft x with probability min(1, p(x) / q(x)); on a
rejection, draw from max(0, p - q) renormalised) becomes: accept x with probability p(x); on a rejection, draw from p
with x removed. Whatever the drafts, each output token is then distributed as plain sampling from p would make it
(vLLM 0.33.0 vllm/v1/sample/rejection_sampler.py has the general case). For a greedy request p is the argmax: drafts
are kept while they equal the target's argmax, then the argmax at the first mismatch (or after the last draft, the
bonus token) follows, exactly the tokens of plain greedy decoding.
"""

from __future__ import annotations

import torch

from infertrace.engine.sampler import Sampler, draw, greedy_tokens, target_probs
from infertrace.engine.sampling_params import SamplingParams


def verify(sampler: Sampler, logits: torch.Tensor, rows: list) -> list[list[int]]:
    """`logits` [sum over `rows` of 1 + drafts, vocab]: each row's (ScheduledSeq's) positions, its last token's
    first and then each draft's. The tokens each row gains: its accepted drafts, then one more."""
    argmax = greedy_tokens(logits).tolist()  # one host sync for the step
    out = []
    offset = 0
    for s in rows:
        n = s.num_draft_tokens
        drafts = s.seq.spec_token_ids[:n]
        if s.seq.params.greedy:
            out.append(accept_greedy(drafts, argmax[offset : offset + n + 1]))
        else:
            out.append(accept_sampled(logits[offset : offset + n + 1], drafts, s.seq.params,
                                      s.seq.generator or sampler.generator))
        offset += n + 1
    return out


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """`targets`: the argmax at the last token and after each draft (one more than `drafts`)."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return targets[: n + 1]


def accept_sampled(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                   generator: torch.Generator) -> list[int]:
    """The standard rule for one-hot drafts over `logits` [1 + drafts, vocab] of one request."""
    out = []
    for j, draft in enumerate(drafts):
        ids, probs = target_probs(logits[j].float(), params)
        at = _index_of(ids, draft)
        p_draft = 0.0 if at is None else float(probs[at] / probs.sum())
        u = float(torch.rand(1, generator=generator, device=generator.device))
        if u < p_draft:
            out.append(draft)
            continue
        if at is not None:
            probs = probs.clone()
            probs[at] = 0.0
        out.append(int(draw(ids, probs, generator)))
        return out
    ids, probs = target_probs(logits[len(drafts)].float(), params)
    out.append(int(draw(ids, probs, generator)))
    return out


def _index_of(ids: torch.Tensor | None, token: int) -> int | None:
    """Where `token` sits among the weights' ids (None: not among them, so p(token) = 0)."""
    if ids is None:
        return token
    hit = (ids == token).nonzero()
    return int(hit[0, 0]) if hit.numel() else None
