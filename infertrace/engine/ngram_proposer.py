"""N-gram drafting (prompt lookup): the tokens that followed the last time the request's latest n tokens appeared
in its own prompt and output. The longest n in [min_n, max_n] that matches wins, and among its matches the
earliest (vLLM 0.33.0 vllm/v1/spec_decode/ngram_proposer.py chooses the same way)."""

from __future__ import annotations

import numpy as np


class TokenMirror:
    """A request's tokens as a numpy array, kept up to date by copying only the tokens appended since the last
    look: copying the whole request every step was most of a lookup's time (15 of 21 us at 512 tokens). While
    drafting, tokens are only ever appended (async scheduling, whose placeholder tokens are rewritten, is off); a
    request found shorter than the copy is copied again whole."""

    __slots__ = ("array", "filled")

    def __init__(self) -> None:
        self.array = np.empty(256, dtype=np.int64)
        self.filled = 0

    def of(self, token_ids: list[int]) -> np.ndarray:
        total = len(token_ids)
        if total < self.filled:
            self.filled = 0
        if total > self.array.size:
            grown = np.empty(max(total, 2 * self.array.size), dtype=np.int64)
            grown[: self.filled] = self.array[: self.filled]
            self.array = grown
        if total > self.filled:
            self.array[self.filled : total] = token_ids[self.filled : total]
            self.filled = total
        return self.array[:total]


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` draft tokens for a request whose tokens so far are `tokens` (none when no n-gram recurs)."""
    total = tokens.size
    if k < 1 or total < min_n + 1:
        return []
    # where an earlier occurrence of the last token ends a window with a token after it; each is then extended
    # backwards while it matches the tokens before the last (one pass over the request for any n)
    ends = np.flatnonzero(tokens[: total - 1] == tokens[total - 1])
    if not ends.size:
        return []
    matched = np.ones(ends.size, dtype=np.int64)
    for j in range(1, min(max_n, total - 1)):
        before = ends - j
        extends = (matched == j) & (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[total - 1 - j])
        if not extends.any():
            break
        matched += extends
    longest = int(matched.max())
    if longest < min_n:
        return []
    start = int(ends[np.argmax(matched == longest)]) + 1  # the earliest of the longest
    return tokens[start : start + k].tolist()
