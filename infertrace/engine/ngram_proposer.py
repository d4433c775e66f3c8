"""N-gram drafting (prompt lookup): the tokens that followed the last time the request's latest n tokens appeared
in its own prompt and output. The longest n in [min_n, max_n] that matches wins, and among its matches the
earliest (vLLM 0.33.0 vllm/v1/spec_decode/ngram_proposer.py chooses the same way)."""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` draft tokens for a request whose tokens so far are `token_ids` (none when no n-gram recurs)."""
    total = len(token_ids)
    if k < 1 or total < min_n + 1:
        return []
    tokens = np.fromiter(token_ids, np.int64, total)
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
    return token_ids[start : start + k]
