"""N-gram drafting (prompt lookup): the tokens that followed the last time the request's latest n tokens appeared
in its own prompt and output. The longest n in [min_n, max_n] that matches wins, and among its matches the
earliest (vLLM 0.33.0 vllm/v1/spec_decode/ngram_proposer.py chooses the same way)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` draft tokens for a request whose tokens so far are `token_ids` (none when no n-gram recurs)."""
    total = len(token_ids)
    if k < 1 or total < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        # windows that start early enough to have a token after them, compared with the last n tokens
        windows = sliding_window_view(tokens[: total - 1], n)
        hits = np.flatnonzero((windows == tokens[total - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return token_ids[start : start + k]
    return []
