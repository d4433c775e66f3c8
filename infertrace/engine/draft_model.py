"""Draft-model drafting: a smaller model of the same tokenizer, run greedily for K tokens per request per step.

The draft model is an engine of its own, with its own paged KV and prefix cache: each round hands it every
drafting request's tokens as a new request, whose full blocks it finds cached from the round before, so a round
computes the tokens since the last full block (up to block_size - 1, plus those the target accepted) and then K - 1
decode steps, every request of the round batched together. Its steps are named `step[DRAFT ..]` in a profile.
"""

from __future__ import annotations

from pathlib import Path

from infertrace.engine.sampling_params import SamplingParams
from infertrace.engine.sequence import Sequence


def draft_model_dir(name: str) -> Path:
    """A model directory, or a preset's name (`infertrace model init`), built in the cache on first use."""
    from infertrace.modelgen.cached import is_preset, preset_model_dir

    return preset_model_dir(name) if is_preset(name) else Path(name)


def check_same_vocabulary(target_dir: Path, draft_dir: Path) -> None:
    """ValueError when the draft model's tokenizer differs from the target's: its drafts would be other tokens."""
    from infertrace.engine.models.loader import read_json

    sizes = [read_json(d / "config.json").get("vocab_size") for d in (target_dir, draft_dir)]
    if sizes[0] != sizes[1]:
        raise ValueError(f"the draft model's vocabulary ({sizes[1]} tokens, {draft_dir}) differs from the target "
                         f"model's ({sizes[0]} tokens)")
    files = [d / "tokenizer.json" for d in (target_dir, draft_dir)]
    if all(f.is_file() for f in files) and files[0].read_bytes() != files[1].read_bytes():
        raise ValueError(f"the draft model's tokenizer ({draft_dir}) differs from the target model's")


class DraftModelProposer:
    def __init__(self, engine):
        """`engine`: the draft model's Engine (see engine.py), its steps named DRAFT, its request log off."""
        self.engine = engine
        self._round = 0

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Up to ks[i] greedy draft tokens after each of `seqs`' tokens."""
        engine = self.engine
        self._round += 1
        ids = [f"{seq.request_id}\0{self._round}" for seq in seqs]
        drafts: dict[str, list[int]] = {}
        for rid, seq, k in zip(ids, seqs, ks):
            if len(seq) + k <= engine.max_model_len:  # else: no drafts this step for this request
                engine.add_request(rid, seq.token_ids, SamplingParams(max_tokens=k, ignore_eos=True))
                drafts[rid] = []
        while engine.has_unfinished():
            for out in engine.step():
                drafts[out.request_id] += out.new_token_ids
        return [drafts.get(rid, []) for rid in ids]
