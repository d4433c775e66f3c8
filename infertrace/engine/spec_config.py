"""The user's choice of speculative decoding, in vLLM's shape (`--speculative-config JSON`): a method that drafts
tokens (`ngram`: prompt lookup over the request's own tokens; `draft_model`: a smaller model of the same tokenizer,
run greedily) and how many tokens it drafts per step."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SPEC_METHODS = ("ngram", "draft_model")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: the shortest suffix of the request's tokens looked up earlier in them
    prompt_lookup_max: int = 4  # ngram: the longest
    model: str | None = None  # draft_model: a model directory, or a preset's name (`infertrace model init`)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPEC_METHODS)}; "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not _is_int(k) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer >= 1, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not _is_int(lo) or not _is_int(hi) or not 1 <= lo <= hi:
            raise ValueError(f"speculative_config needs integers 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {lo!r} and {hi!r}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config method 'draft_model' needs \"model\": a model directory or "
                                 "a preset's name")
        elif self.model is not None:
            raise ValueError(f"speculative_config \"model\" is for method 'draft_model', not {self.method!r}")

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From the JSON text of `--speculative-config` or the mapping of a recipe; ValueError in one line."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"unknown speculative_config key {unknown[0]!r}; known: {', '.join(_KEYS)}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs \"method\" and \"num_speculative_tokens\"")
        return cls(**value)

    def as_dict(self) -> dict[str, Any]:
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            out |= {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        else:
            out["model"] = self.model
        return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
