"""LoRA adapters for a model directory, in PEFT's format (adapter_config.json + adapter_model.safetensors), with
seeded random weights: what `vllm serve --enable-lora --lora-modules name=DIR` loads."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from infertrace.modelgen.weights import new_file_mode

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")  # the attention projections every LoRA server takes
MAX_ADAPTERS = 64


def adapter_shapes(config: dict, rank: int) -> list[tuple[str, tuple[int, int]]]:
    """(tensor name, shape) of every LoRA A and B matrix, named as PEFT saves them for a causal LM: A maps the
    projection's input to the rank, B the rank to its output."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    dims = {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out), "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden)}
    out = []
    for layer in range(config["num_hidden_layers"]):
        for module in TARGET_MODULES:
            fan_in, fan_out = dims[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            out += [(f"{prefix}.lora_A.weight", (rank, fan_in)), (f"{prefix}.lora_B.weight", (fan_out, rank))]
    return out


def adapter_config(rank: int, base_model: str) -> dict:
    """adapter_config.json as PEFT writes it for a LoRA of `rank` (alpha twice the rank, its common choice)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": list(TARGET_MODULES), "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "inference_mode": True,
    }


def init_adapters(model_dir: str | Path, count: int, rank: int, seed: int = 0,
                  out_dir: str | Path | None = None) -> list[Path]:
    """Write `count` adapters of `rank` for the model in `model_dir`, as `lora-1`, `lora-2`, ... under `out_dir`
    (default: `model_dir/loras`); each adapter's weights are drawn from its own seed, so that no two are alike.
    ValueError names what is wrong."""
    import torch
    from safetensors.torch import save_file

    if not 1 <= count <= MAX_ADAPTERS:
        raise ValueError(f"--lora must be between 1 and {MAX_ADAPTERS}, got {count}")
    if rank < 1:
        raise ValueError(f"--lora-rank must be at least 1, got {rank}")
    model = Path(model_dir)
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{model} holds no readable config.json ({e}): write the model first") from None
    base = Path(out_dir) if out_dir is not None else model / "loras"
    written = []
    for i in range(1, count + 1):
        path = base / f"lora-{i}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, shape in adapter_shapes(config, rank):
            gen = torch.Generator().manual_seed((seed * 1_000_003 + i) * 7919 + zlib.crc32(name.encode()))
            # B is not zero (PEFT's initial value) so that each adapter changes the model's output
            tensors[name] = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
        weights = path / "adapter_model.safetensors"
        save_file(tensors, str(weights), metadata={"format": "pt"})
        os.chmod(weights, new_file_mode())
        (path / "adapter_config.json").write_text(json.dumps(adapter_config(rank, str(model)), indent=2))
        written.append(path)
    return written
