"""Command-line options generated from EngineConfig: one per field, its default read from the dataclass.

Options default to "not given" (None); only given ones reach `EngineConfig.from_overrides`, so each default is
declared once, in EngineConfig. vLLM's spellings are accepted beside ours where they mean the same thing.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import click

PARAM_PREFIX = "engine__"

# What a field means, for --help (the defaults come from EngineConfig itself).
FIELD_HELP = {
    "block_size": "Tokens per KV-cache block.",
    "kv_cache_dtype": "KV-cache dtype: auto (the model's) or fp8 (float8 e4m3, scale 1.0; also fp8_e4m3).",
    "kv_cache_tokens": "KV-cache size in tokens; unset: sized from memory.",
    "gpu_memory_utilization": "Share of GPU memory the engine may use, KV cache included.",
    "cpu_kv_cache_gb": "KV-cache budget in GB on a CPU device when --kv-cache-tokens is unset.",
    "max_num_seqs": "Most requests in one running batch.",
    "max_num_batched_tokens": "Token budget of one engine step.",
    "max_model_len": "Context length; unset: the model's max_position_embeddings (capped by the KV cache).",
    "chunked_prefill": "Split long prefills across steps and batch them with decodes.",
    "long_prefill_token_threshold": "Most prefill tokens of one request per step; 0: no limit.",
    "prefix_caching": "Reuse KV blocks of shared prompt prefixes.",
    "scheduling_policy": "Scheduling policy.",
    "async_scheduling": "Plan and queue the next step while the current one runs: auto (on for CUDA), on or off.",
    "pdl": "Programmatic dependent launch of the Triton kernels (Hopper and later): each starts while the one "
           "before drains.",
    "decode_longest_first": "Decode attention launches its requests' programs longest context first (Triton "
                            "backend).",
    "skinny_gemm": "Projections of small decode steps as weight-streaming Triton GEMMs (CUDA, 16-bit, fused norm).",
    "fused_projections": "With --skinny-gemm: the qkv projection with its q/k norm and RoPE, and the gate/up "
                         "projection with SiLU, as one kernel each where measured faster (qwen3-4b's shapes).",
    "attention": "batched: one attention kernel for the batch; looped: one request at a time (ablation).",
    "attention_backend": "Attention kernels: auto, torch, triton or flash_attn.",
    "cuda_graphs": "Capture decode steps in CUDA graphs per batch-size bucket (no effect on CPU).",
    "cuda_graph_batch_sizes": "Batch-size buckets captured in CUDA graphs, comma-separated.",
    "prefill_cuda_graphs": "Capture prefill and mixed steps in CUDA graphs per token-count bucket, the attention "
                           "inside them (CUDA, one rank; no effect on CPU).",
    "cuda_graph_token_sizes": "Token-count buckets of the prefill and mixed-step graphs, comma-separated (capped "
                              "at --max-num-batched-tokens, which is always one).",
    "offload": "CPU KV offload: off, prefix or long.",
    "offload_host_gb": "Pinned host memory for offloaded KV, in GB.",
    "dtype": "Weight and activation dtype; auto: the checkpoint's.",
    "device": "auto, cpu, cuda or cuda:N.",
    "seed": "Engine random seed (requests may carry their own).",
}

# vLLM spellings of the same switches, for people who have them in their fingers.
VLLM_FLAG_ALIASES = {
    "prefix_caching": "enable-prefix-caching",
    "chunked_prefill": "enable-chunked-prefill",
}


def engine_config_options(reserved: set[str] = frozenset()) -> list[click.Option]:
    """One click option per EngineConfig field whose flag is not in `reserved` (server options)."""
    from infertrace.engine.config import EngineConfig  # torch-free: keeps `infertrace --help` fast

    hints = typing.get_type_hints(EngineConfig)
    options = [
        click.Option(["engine_opt", "--engine-opt"], multiple=True, metavar="KEY=VALUE",
                     help="An engine config field by name, e.g. --engine-opt attention=looped (repeatable, as in "
                          "`infertrace bench`); the flags below win over it."),
        click.Option(["enforce_eager", "--enforce-eager"], is_flag=True, default=False,
                     help="Same as --no-cuda-graphs --no-prefill-cuda-graphs: every step eager (vLLM's name)."),
    ]
    for f in dataclasses.fields(EngineConfig):
        flag = f.name.replace("_", "-")
        if flag in reserved:
            continue
        options.append(_option(f, hints[f.name], flag))
    return options


def engine_overrides(params: dict[str, Any]) -> dict[str, Any]:
    """The EngineConfig overrides among a command's parameters: the options that were given.
    ValueError for a malformed --engine-opt."""
    overrides: dict[str, Any] = {}
    for pair in params.get("engine_opt") or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--engine-opt takes KEY=VALUE, got {pair!r}")
        overrides[key.strip().replace("-", "_")] = value  # a string: from_overrides parses it by the field's type
    overrides.update({name[len(PARAM_PREFIX):]: value for name, value in params.items()
                      if name.startswith(PARAM_PREFIX) and value is not None})
    if params.get("enforce_eager"):
        overrides["cuda_graphs"] = overrides["prefill_cuda_graphs"] = False
    return overrides


def _option(f: dataclasses.Field, hint: Any, flag: str) -> click.Option:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
    help_text = FIELD_HELP.get(f.name, f"Engine setting {f.name}.")
    if default is not None:
        help_text += f"  [default: {shown}]"
    name = PARAM_PREFIX + f.name
    allowed = _allowed(hint)
    if allowed == {bool}:
        decls = [name, f"--{flag}/--no-{flag}"]
        if f.name in VLLM_FLAG_ALIASES:
            alias = VLLM_FLAG_ALIASES[f.name]
            decls.append(f"--{alias}/--no-{alias}")
        return click.Option(decls, default=None, help=help_text)
    if allowed <= {int, type(None)}:
        kind = click.INT
    elif allowed <= {float, int, type(None)}:
        kind = click.FLOAT
    else:  # strings and tuples: EngineConfig.from_overrides parses and validates them
        kind = click.STRING
    return click.Option([name, f"--{flag}"], type=kind, default=None, help=help_text)


def _allowed(hint: Any) -> set[type]:
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return {typing.get_origin(a) or a for a in args}

