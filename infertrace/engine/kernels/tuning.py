"""Tilings read from a JSON file named by INFERTRACE_KERNEL_TUNING, ahead of the rules in the kernels' modules (as
vLLM reads its fused-MoE tilings from per-device JSON files): benchmarks try tilings at shapes the rules were not
measured at, in every tensor-parallel rank (spawned processes read the same environment).

    {"skinny_gemm": {"2560,2048": [64, 128, 4, 4]},         # (N, K): block_n, block_k, split_k, num_stages
     "gate_up_silu": {"9728,2560": [32, 128, 3, 4]},        # (2I, hidden): block_n, block_k, stages, warps; null: two kernels
     "qkv_norm_rope": {"3072,2560": null}}                  # (N, K): block_k, stages, warps; null: two kernels

A file that cannot be read or parsed is an error naming it (a tiling silently ignored would measure the wrong thing).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "INFERTRACE_KERNEL_TUNING"


def load(kernel: str) -> dict[tuple[int, int], tuple[int, ...] | None]:
    """The file's tilings for `kernel`, keyed by (N, K); empty when the variable is unset."""
    path = os.environ.get(ENV)
    if not path:
        return {}
    try:
        table = json.loads(Path(path).read_text()).get(kernel, {})
        tilings = {}
        for key, value in table.items():
            shape = tuple(int(v) for v in key.split(","))
            if len(shape) != 2:
                raise ValueError(f"key {key!r} is not 'N,K'")
            tilings[shape] = None if value is None else tuple(int(v) for v in value)
        return tilings
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise ValueError(f"{ENV}={path}: not a tiling file ({e})") from None
