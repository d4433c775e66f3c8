"""--lora-modules: the LoRA adapter each request names as its model, drawn by the adapters' shares from the seed and
the request's index alone, so that the body sent and the request's record name the same adapter."""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from itertools import accumulate


@dataclass(frozen=True, slots=True)
class AdapterMix:
    names: tuple[str, ...]
    bounds: tuple[float, ...]  # the adapters' cumulative shares, the last exactly 1
    seed: int

    @classmethod
    def of(cls, shares: dict[str, float], seed: int) -> AdapterMix | None:
        """The mix of --lora-modules' shares; None without adapters."""
        if not shares:
            return None
        total = sum(shares.values())
        bounds = [c / total for c in accumulate(shares.values())]
        bounds[-1] = 1.0
        return cls(tuple(shares), tuple(bounds), seed)

    def pick(self, index: int) -> str:
        """The adapter of request `index`: a uniform draw of its own (seeded by a hash of seed and index), so any
        process that knows the index knows the adapter, in whatever order requests go out."""
        draw = random.Random(f"lora:{self.seed}:{index}").random()  # in [0, 1): below the last bound
        return self.names[bisect.bisect_right(self.bounds, draw)]
