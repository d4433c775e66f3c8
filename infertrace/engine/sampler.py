"""Next-token choice from logits: greedy, or temperature with top-k and top-p, per request."""

from __future__ import annotations

import torch

from infertrace.engine.sampling_params import SamplingParams


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of `logits` [B, V], as a long tensor on their device. Deterministic: every
    tensor-parallel rank, holding the same gathered logits, takes the same tokens."""
    if logits.is_cuda:
        from infertrace.engine.kernels.argmax import argmax_rows

        return argmax_rows(logits)
    return torch.argmax(logits, dim=-1)


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        # requests without their own seed draw from one engine-wide generator, so whole runs repeat too
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.device = device

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """logits [B, V] in the model's dtype; one token id per row, as a long tensor on the logits' device (no host
        sync for greedy rows, so a step's tokens can feed the next step before the host has seen them). Greedy rows
        take the argmax of the logits as they are; a row that samples is widened to float32 first."""
        tokens = greedy_tokens(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            tokens = tokens.clone()
            for i in random_rows:
                tokens[i] = self._sample_row(logits[i].float(), params[i], generators[i] or self.generator)
        return tokens

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        ids, probs = target_probs(logits, p)
        return draw(ids, probs, generator)


def target_probs(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The distribution a sampled row draws from (float32 logits of one row): (token ids, their weights), ids None
    when the weights cover the whole vocabulary. The weights are not normalised once top-p has cut the tail."""
    logits = logits / p.temperature
    top_k = p.top_k_or_none
    if top_k is not None and top_k < logits.numel():
        values, ids = torch.topk(logits, top_k)  # sorted, descending
        probs = torch.softmax(values, dim=-1)  # renormalised over the top k
    elif p.top_p < 1.0:
        # the top-p set is nearly always small: look among the top n first instead of sorting the vocabulary
        full = torch.softmax(logits, dim=-1)
        n = 1024
        while True:
            values, ids = torch.topk(full, min(n, full.numel()))
            if n >= full.numel() or float(values.sum()) >= p.top_p:
                break
            n *= 8
        probs = values
    else:
        ids, probs = None, torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        probs = probs.masked_fill((torch.cumsum(probs, dim=-1) - probs) >= p.top_p, 0.0)
    return ids, probs


def draw(ids: torch.Tensor | None, probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token from `target_probs`' weights (normalised or not)."""
    # argmax of p / Exp(1) noise draws index i with probability p_i / sum(p), and is much cheaper than multinomial
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    choice = torch.argmax(probs / noise)
    return choice if ids is None else ids[choice]
