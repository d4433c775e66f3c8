"""One request as the scheduler sees it: its tokens, how many have KV in the cache, and its block table."""

from __future__ import annotations

import enum
from array import array
from typing import Any

import xxhash

from infertrace.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival: int = 0):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.arrival = arrival
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        # tokens whose KV is in the cache; the tokens after it are computed by the next steps
        self.num_computed_tokens = 0
        # prompt tokens served from the prefix cache when the request was first scheduled
        self.num_cached_tokens: int | None = None
        self.block_table: list[int] = []
        # draft tokens proposed for the next step, which verifies them; never part of token_ids, so that only
        # committed tokens are ever hashed into the prefix cache
        self.spec_token_ids: list[int] = []
        self.token_mirror: Any = None  # n-gram drafting's numpy copy of token_ids (a TokenMirror)
        self.num_registered_blocks = 0  # leading full blocks published to the prefix cache
        self._block_hashes: list[int] = []
        self.generator: Any = None  # torch.Generator for a seeded request
        self.matcher: Any = None  # llguidance's LLMatcher for a request with a grammar, at its committed tokens
        self.detokenizer: Any = None  # set by the engine

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, len={len(self)}, computed={self.num_computed_tokens}, "
            f"status={self.status.value}, blocks={self.block_table})"
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def block_tokens(self, index: int, block_size: int) -> list[int]:
        return self.token_ids[index * block_size : (index + 1) * block_size]

    def block_hash(self, index: int, block_size: int) -> int:
        """Hash of full block `index`, chained with the hashes of all blocks before it. Computed when first asked
        for: a prompt's lookup stops at its first block the cache lacks, and the rest are hashed when published,
        after the step that computes them is queued."""
        hashes = self._block_hashes
        first = len(hashes)
        if first <= index:
            assert (index + 1) * block_size <= len(self.token_ids), "only full blocks are hashed"
            raw = array("q", self.token_ids[first * block_size : (index + 1) * block_size]).tobytes()
            width = 8 * block_size
            prev = hashes[-1] if hashes else 0
            for at in range(0, len(raw), width):
                prev = xxhash.xxh3_64_intdigest(prev.to_bytes(8, "little") + raw[at : at + width])
                hashes.append(prev)
        return hashes[index]

    def reset_for_recompute(self) -> None:
        """Forget KV state after preemption; the tokens stay and are recomputed when rescheduled."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_registered_blocks = 0
        self.spec_token_ids = []
