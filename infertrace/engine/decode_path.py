"""What the engine resolved at start-up for its steps, once: the kernels, fusions and all-reduce a step takes. The
model runner makes it, the model follows it, and a run's provenance reports it (`Engine.decode_path()`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DecodePath:
    attention_backend: str  # "triton (batched)": the backend and its mode
    fused_norm: bool
    skinny_gemm: bool
    fused_projections: bool
    pdl: bool
    gemm_early_weights: bool  # the decode GEMMs copy their first weights before their wait
    kv_cache_dtype: str
    all_reduce: str = "none"  # with more ranks: "nccl" (torch.distributed's) or "custom" (peer memory)
    all_reduce_note: str | None = None  # why all_reduce=auto did not take the custom one
    # the custom all-reduce's tuning (kernels/tuning.py RULES); "off" and None without it
    all_reduce_fusion: str = "off"
    all_reduce_spread: int | None = None
    all_reduce_pull: str | None = None
    all_reduce_payload: str | None = None
    all_reduce_push: str = "off"
    logits_gather: str = "none"  # how a decode step's vocabulary-parallel logits reach every rank

    @property
    def norm_fusion(self) -> bool:
        """The all-reduce + residual add + RMSNorm kernel takes the decode projections' partial sums."""
        return self.all_reduce_fusion == "norm"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
