"""How one request is sampled and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass

SEED_RANGE = (-(2**63), 2**63)  # a signed 64-bit integer, as vLLM and OpenAI take it (torch takes a subset of it)
GREEDY_BELOW = 1e-5  # temperatures under it sample greedily: dividing logits by less overflows to inf (vLLM's eps)


class SamplingParamsError(ValueError):
    """A sampling value out of range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int | None = None  # None, -1 or 0: no top-k filter
    seed: int | None = None  # a per-request generator: same seed, same tokens, whatever the batch
    ignore_eos: bool = False
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    grammar: str | None = None  # llguidance's grammar (JSON text) the output must hold to; None: unconstrained

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if _not_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"max_tokens must be an integer >= 1, got {_show(self.max_tokens)}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError("temperature", f"temperature must be a finite number >= 0, "
                                                     f"got {_show(self.temperature)}")
        if not _is_finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {_show(self.top_p)}")
        if self.top_k is not None and (_not_int(self.top_k) or self.top_k < -1):
            raise SamplingParamsError("top_k", f"top_k must be None, -1, 0 or a positive integer, got {_show(self.top_k)}")
        if self.seed is not None and (_not_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise SamplingParamsError("seed", f"seed must be an integer in [-2**63, 2**63), got {_show(self.seed)}")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingParamsError("stop", f"stop must be a list of non-empty strings, got {_show(self.stop)}")
        if self.stop_token_ids is not None and any(_not_int(t) for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", f"stop_token_ids must be a list of integers, "
                                                        f"got {_show(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def top_k_or_none(self) -> int | None:
        return self.top_k if self.top_k is not None and self.top_k > 0 else None


def _not_int(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _is_finite(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the float range
        return False


def _show(value) -> str:
    text = repr(value)  # values come from requests: a message stays one short line whatever was sent
    return text if len(text) <= 60 else text[:57] + "..."
