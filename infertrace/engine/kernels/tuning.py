"""Experiments on the kernels' tuning without a setting: INFERTRACE_KERNEL_TUNING names a JSON file, or holds the
JSON itself (a value starting with "{"), read ahead of the rules in the kernels' modules (as vLLM reads its fused-MoE
tilings from per-device JSON files and its VLLM_* switches). Benchmarks try tilings at shapes the rules were not
measured at, and other choices of a rule, in every tensor-parallel rank (spawned processes read the same
environment).

    {"skinny_gemm": {"2560,2048": [64, 128, 4, 4]},         # (N, K): block_n, block_k, split_k, num_stages
     "gate_up_silu": {"9728,2560": [32, 128, 3, 4]},        # (2I, hidden): block_n, block_k, stages, warps; null: two kernels
     "qkv_norm_rope": {"3072,2560": null},                  # (N, K): block_k, stages, warps; null: two kernels
     "rules": {"all_reduce_fusion": "planes"}}              # a rule's value instead of the one it picks (RULES)

A value that cannot be read or parsed is an error naming it (a tiling silently ignored would measure the wrong thing).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ENV = "INFERTRACE_KERNEL_TUNING"

# the rules an experiment may override, each with the values it may take and where the rule lives
RULES: dict[str, tuple] = {
    # allreduce.fusion_rule: what the custom all-reduce takes from a decode step's row-parallel projections
    "all_reduce_fusion": ("planes", "norm", "off"),
    # allreduce_norm.spread_rule: the programs a row of the all-reduce + norm kernel is pushed by
    "all_reduce_spread": (4, 8),
    # allreduce_norm.pull_rule: how that kernel waits for the ranks' parts
    "all_reduce_pull": ("each", "all"),
    # allreduce_norm.payload_rule: the dtype the parts are pushed in
    "all_reduce_payload": ("model", "float32"),
    # allreduce_norm.push_rule: whether the row-parallel projections' GEMMs push their parts themselves
    "all_reduce_push": ("on", "off"),
    # skinny_gemm.early_rule: whether the decode GEMMs copy their first weights before their wait
    "gemm_early_weights": ("on", "off"),
    # attention.flash_prefill_rule: the fewest tokens of a prefill or mixed step `auto` gives to FlashAttention-4
    "flash_prefill_from": (256, 512, 768, 1024, 1280, 1536, 2048, 3072, 4096, 8192, "off"),
}


def _table() -> dict[str, Any]:
    """The variable's JSON object; empty when it is unset."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return {}
    try:
        table = json.loads(value if value.startswith("{") else Path(value).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{ENV}={value}: not a tiling file ({e})") from None
    if not isinstance(table, dict):
        raise ValueError(f"{ENV}={value}: not a tiling file (not a JSON object)")
    return table


def load(kernel: str) -> dict[tuple[int, int], tuple[int, ...] | None]:
    """The tilings for `kernel`, keyed by (N, K); empty when the variable is unset."""
    table = _table()
    try:
        tilings = {}
        for key, value in (table.get(kernel) or {}).items():
            shape = tuple(int(v) for v in key.split(","))
            if len(shape) != 2:
                raise ValueError(f"key {key!r} is not 'N,K'")
            tilings[shape] = None if value is None else tuple(int(v) for v in value)
        return tilings
    except (ValueError, AttributeError, TypeError) as e:
        raise ValueError(f"{ENV}={os.environ[ENV]}: not a tiling file ({e})") from None


_TABLES: dict[str, dict] = {}


def table(kernel: str) -> dict[tuple[int, int], tuple[int, ...] | None]:
    """`load(kernel)` as the one dict the kernel reads at every call, for `set_tilings` to change."""
    return _TABLES.setdefault(kernel, load(kernel))


def set_tilings(kernel: str, tilings: dict[tuple[int, int], tuple[int, ...] | None]) -> None:
    """An experiment's tilings for `kernel` in this process, ahead of the variable's and the rules ({}: theirs
    again), for benchmarks that compare tilings on one engine. A CUDA graph keeps the tilings of its capture."""
    current = table(kernel)
    current.clear()
    current.update(load(kernel) | tilings)


def rules() -> dict[str, Any]:
    """The rules' values an experiment sets instead of what the rules pick (the "rules" object), by rule name;
    empty when the variable is unset. A name that is no rule, or a value the rule cannot take, is an error."""
    return _checked(_table().get("rules") or {})


def with_rules(chosen: dict[str, Any]) -> str:
    """The variable's value with `chosen` added to its rules (a value may be text, as a command line writes it), for
    a benchmark or an ablation phase to put in the environment of the engine it starts (its ranks read it too)."""
    typed = {name: int(value) if isinstance(value, str) and value.isdigit() else value
             for name, value in chosen.items()}
    table = _table()
    table["rules"] = _checked({**(table.get("rules") or {}), **typed})
    return json.dumps(table)


def _checked(chosen: Any) -> dict[str, Any]:
    if not isinstance(chosen, dict):
        raise ValueError(f"{ENV}: \"rules\" must be an object of rule: value, got {chosen!r}")
    for name, value in chosen.items():
        if name not in RULES:
            raise ValueError(f"{ENV}: no rule {name!r}; the rules are {', '.join(RULES)}")
        if value not in RULES[name] or isinstance(value, bool):
            raise ValueError(f"{ENV}: rule {name} takes {', '.join(map(str, RULES[name]))}; got {value!r}")
    return chosen
