"""What each phase of a recipe can do on this machine, found before anything runs.

A CPU ignores the CUDA-only switches (CUDA graphs, the Triton fusions, PDL) and cannot run Triton attention or an
NCCL all-reduce; a GPU machine may have fewer GPUs than a phase has ranks. A phase that asks for what the machine
cannot do, or whose changes all take no effect here, is "not applicable" and is not run, so that no change of
tok/s is put down to a switch that did nothing. The memory a phase's weights and KV cache take is set against
what the machine has, so that a run is refused rather than killed for memory half-way.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

GiB = 1024**3
# settings, and kernel rules (engine/kernels/tuning.py RULES), that change nothing on a CPU (engine/config.py and
# the kernels say so of each): a phase that changes only these measures noise there
CUDA_ONLY = ("cuda_graphs", "prefill_cuda_graphs", "cuda_graph_batch_sizes", "cuda_graph_token_sizes", "fused_norm",
             "skinny_gemm", "fused_projections", "pdl", "gemm_early_weights", "decode_longest_first",
             "gpu_memory_utilization")
# the tensor-parallel all-reduce's setting and rules: nothing to do with one rank, and on a CPU the ranks use gloo
ALL_REDUCE = ("all_reduce", "all_reduce_fusion", "all_reduce_spread", "all_reduce_pull", "all_reduce_payload",
              "all_reduce_push")
HOPPER = (9, 0)  # PDL and FlashAttention-4 need compute capability 9.0 or later
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class Machine:
    gpus: int  # CUDA GPUs visible
    capability: tuple[int, int] | None = None  # the first GPU's compute capability
    gpu_bytes: int = 0  # the first GPU's memory
    host_bytes: int = 0  # host memory available now

    @classmethod
    def here(cls) -> Machine:
        import torch

        from infertrace.engine.offload.host_pool import host_available_bytes

        host = host_available_bytes() or 0  # 0: unknown, and then not checked
        if not torch.cuda.is_available():
            return cls(0, host_bytes=host)
        props = torch.cuda.get_device_properties(0)
        return cls(torch.cuda.device_count(), (props.major, props.minor), props.total_memory, host)

    def device(self, config: dict) -> str:
        """Where an engine of this config runs: "cpu" or "cuda" (EngineConfig.device resolved as the engine does)."""
        return "cuda" if config.get("device", "auto") != "cpu" and self.gpus else "cpu"


def mark_not_applicable(planned: list, machine: Machine) -> list:
    """The planned phases, each that cannot be measured on `machine` with its reason (PlannedPhase.not_applicable)."""
    return [dataclasses.replace(phase, not_applicable=reason) if reason else phase
            for phase, reason in zip(planned, not_applicable(planned, machine))]


def not_applicable(planned: list, machine: Machine) -> list[str | None]:
    """For each planned phase, why it cannot be measured on `machine` (None: it can, or it fails anyway with its
    own error). A phase is not applicable when its engine asks for what the machine cannot do, or when, with the
    settings and kernel rules that take no effect here set aside, it runs the same engine as the last phase
    measured before it."""
    from infertrace.engine.config import EngineConfig

    reasons: list[str | None] = []
    measured = None  # what the last phase measured runs, as it takes effect here
    before: tuple[dict, dict] = ({}, {})  # (config, tuning) of the phase before, to name what a phase changed
    for phase in planned:
        if phase.error is not None:
            reasons.append(None)
            continue
        config = dataclasses.asdict(EngineConfig.from_overrides(phase.config))
        device = machine.device(config)
        changed = [k for k in config if before[0] and config[k] != before[0].get(k)]
        changed += [k for k in {**before[1], **phase.tuning} if phase.tuning.get(k) != before[1].get(k)]
        before = (config, phase.tuning)
        cannot = unsupported(config, machine)
        if cannot:
            reasons.append(f"on {device}: {cannot[0]}")
            continue
        effective = _in_effect(config, phase.tuning, device, machine)
        if measured is not None and effective == measured and changed:
            reasons.append(f"on {device}: {_no_effect(changed, config, phase.tuning, device, machine)}")
            continue
        reasons.append(None)
        measured = effective
    return reasons


def unsupported(config: dict, machine: Machine) -> list[str]:
    """What an engine of this full config (every EngineConfig field) asks for that `machine` cannot do."""
    device, ranks = machine.device(config), config["tensor_parallel_size"]
    backend, reduce = config["attention_backend"], config["all_reduce"]
    problems = []
    if device == "cpu":
        if str(config.get("device", "auto")).startswith("cuda"):
            problems.append(f"device={config['device']} needs a CUDA GPU")
        if backend in ("triton", "flash"):
            problems.append(f"attention_backend={backend} needs a CUDA GPU")
        if ranks > 1 and reduce == "nccl":
            problems.append("all_reduce=nccl needs CUDA GPUs (ranks on a CPU all-reduce over gloo)")
        if ranks > 1 and reduce == "custom":
            problems.append("all_reduce=custom needs CUDA GPUs that reach each other's memory")
        return problems
    if ranks > machine.gpus:
        problems.append(f"tensor_parallel_size={ranks} needs {ranks} GPUs; {machine.gpus} visible")
    if backend == "flash":
        if machine.capability is not None and machine.capability < HOPPER:
            problems.append("attention_backend=flash needs a Hopper or later GPU (compute capability 9.0+)")
        elif importlib.util.find_spec("flash_attn") is None:
            problems.append("attention_backend=flash needs flash-attn-4 (pip install 'infertrace[flash]')")
    return problems


def _ignored(config: dict, device: str, machine: Machine) -> dict[str, str]:
    """The settings and kernel rules that take no effect on `device` under `config`, each with why."""
    ignored = {}
    if device == "cpu":
        ignored |= dict.fromkeys(CUDA_ONLY, "takes effect on CUDA GPUs only")
        ignored |= dict.fromkeys(ALL_REDUCE, "takes effect on CUDA GPUs only (ranks on a CPU use gloo)")
    else:
        if machine.capability is not None and machine.capability < HOPPER:
            ignored |= dict.fromkeys(("pdl", "gemm_early_weights"), "takes effect on Hopper and later GPUs only")
        if config["tensor_parallel_size"] == 1:
            ignored |= dict.fromkeys(ALL_REDUCE, "takes effect with more than one rank only")
    return ignored


def _in_effect(config: dict, tuning: dict, device: str, machine: Machine) -> dict:
    """The config and rules as the engine on `device` acts on them: ignored ones left out, "auto" resolved."""
    ignored = _ignored(config, device, machine)
    effective = {k: v for k, v in config.items() if k not in ignored}
    if effective.get("async_scheduling") == "auto":
        effective["async_scheduling"] = "on" if device == "cuda" else "off"
    if effective.get("attention_backend") == "auto":
        effective["attention_backend"] = _auto_attention(config, tuning, machine) if device == "cuda" else "torch"
    effective["kernel rules"] = {k: v for k, v in tuning.items() if k not in ignored}
    return effective


def _auto_attention(config: dict, tuning: dict, machine: Machine) -> str:
    """What `attention_backend=auto` runs on `machine` (engine/attention.py's `make_attention_backend`)."""
    from infertrace.engine.attention import flash_blocker, flash_prefill_rule

    chosen = tuning.get("flash_prefill_from")
    if chosen is None and machine.capability is not None:
        chosen = flash_prefill_rule(machine.capability)
    dtype = None if config["dtype"] == "auto" else config["dtype"]  # the checkpoint's, not read here
    runs_flash = (chosen not in (None, "off") and machine.capability is not None
                  and flash_blocker("cuda", machine.capability, dtype, config["kv_cache_dtype"],
                                    config["attention"]) is None
                  and importlib.util.find_spec("flash_attn") is not None)
    return f"triton, flash for prefill and mixed steps of {chosen}+ tokens" if runs_flash else "triton"


def _no_effect(changed: list[str], config: dict, tuning: dict, device: str, machine: Machine) -> str:
    ignored = _ignored(config, device, machine)
    own = [key for key in changed if key in ignored]
    if own:
        why = ignored[own[0]]
        return f"{', '.join(own)} {why.replace('takes', 'take') if len(own) > 1 else why}"
    values = {**config, **tuning}
    shown = ", ".join(f"{k}={_show(values.get(k))}" for k in changed)
    return f"{shown} is what the engine does here already"


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True, slots=True)
class MemoryNeed:
    """The memory one phase's engine takes at the least, on the memory that holds it (a GPU's, or the host's)."""

    weights: int
    kv_cache: int
    host_offload: int
    where: str  # "a GPU" or "host"
    available: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.host_offload

    def describe(self) -> str:
        parts = [f"weights {self.weights / GiB:.2f} GiB", f"KV cache {self.kv_cache / GiB:.2f} GiB"]
        if self.host_offload:
            parts.append(f"offload {self.host_offload / GiB:.2f} GiB")
        have = ("this machine has" if self.where == "host" else "a GPU here has")
        return (f"needs at least {self.total / GiB:.2f} GiB ({', '.join(parts)}) and {have} "
                f"{self.available / GiB:.2f} GiB{' available' if self.where == 'host' else ''}")


def memory_need(config: dict, hf_config: dict, machine: Machine) -> MemoryNeed:
    """A lower bound of what an engine of this full config takes, from the model's shapes: its weights, and the KV
    cache it allocates whole at start (kv_cache_tokens, or on a CPU cpu_kv_cache_gb per rank). On GPUs each rank
    holds its share on its own GPU, within gpu_memory_utilization of it; on a CPU the ranks share the host."""
    from infertrace.modelgen.presets import parameter_count

    device, ranks = machine.device(config), config["tensor_parallel_size"]
    dtype = config["dtype"] if config["dtype"] != "auto" else str(
        hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32").replace("torch.", "")
    if dtype == "float16" and device == "cpu":  # the engine's CPU fallback (model_runner.resolve_dtype)
        dtype = "float32"
    weights = parameter_count(hf_config) * _DTYPE_BYTES.get(dtype, 4)
    kv_bytes = 1 if config["kv_cache_dtype"].startswith("fp8") else _DTYPE_BYTES.get(dtype, 4)
    per_token = 2 * hf_config["num_hidden_layers"] * hf_config["num_key_value_heads"] * hf_config["head_dim"] * kv_bytes
    if config["kv_cache_tokens"] is not None:
        kv = config["kv_cache_tokens"] * per_token  # every rank holds those tokens for its share of the heads
    else:
        kv = int(config["cpu_kv_cache_gb"] * GiB) * ranks if device == "cpu" else 0  # a GPU sizes it to fit
    offload = int(config["offload_host_gb"] * GiB) if config["offload"] != "off" else 0
    if device == "cpu":
        return MemoryNeed(weights, kv, offload, "host", machine.host_bytes)
    usable = int(machine.gpu_bytes * config["gpu_memory_utilization"])
    return MemoryNeed(weights // ranks, kv // ranks, 0, "a GPU", usable)


def too_big(planned: list, hf_config: dict | None, machine: Machine) -> tuple[object, MemoryNeed] | None:
    """The first phase (and its need) whose weights and KV cache alone exceed what the machine has."""
    from infertrace.engine.config import EngineConfig

    if hf_config is None:
        return None
    for phase in planned:
        if phase.error is not None:
            continue
        need = memory_need(dataclasses.asdict(EngineConfig.from_overrides(phase.config)), hf_config, machine)
        if need.available and need.total > need.available:
            return phase, need
    return None


def model_shapes(recipe) -> dict | None:
    """The recipe's model's config.json (a preset's as it is written); None when it cannot be read here."""
    from infertrace import input_files

    if recipe.model is None:
        from infertrace.modelgen.presets import PRESETS, hf_config

        preset = PRESETS[recipe.preset]
        return hf_config(preset, preset.dtype)
    try:
        data = json.loads(input_files.read_text(Path(recipe.model) / "config.json", 1 << 20))
    except (input_files.InputFileError, ValueError):
        return None
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size")
    if not isinstance(data, dict) or not all(isinstance(data.get(k), int) for k in keys):
        return None
    data.setdefault("head_dim", data["hidden_size"] // data["num_attention_heads"])
    data.setdefault("tie_word_embeddings", False)
    return data
