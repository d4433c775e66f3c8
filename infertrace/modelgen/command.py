"""The `infertrace model` commands."""

from __future__ import annotations

from pathlib import Path

import click

from infertrace.console import SuggestingGroup, err_console, fail, out_console
from infertrace.exits import BAD_INPUT

PRESET_NAMES = ("tiny", "qwen3-0.6b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen2.5-vl-tiny",
                "blip2-qwen3-tiny")


@click.group(cls=SuggestingGroup)
def model() -> None:
    """Make model directories for tests and benchmarks (no model hub needed)."""


@model.command("init")
@click.option("--preset", type=click.Choice(PRESET_NAMES), required=True,
              help="Qwen3 shapes to use: tiny (CPU tests) or a real model's shapes; qwen2.5-vl-tiny is a "
              "vision-language model (Qwen2.5-VL's layout, scaled down) for servers that take images; "
              "blip2-qwen3-tiny is BLIP-2 with the tiny Qwen3 as its language model (vLLM serves it without torchvision).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Directory to write the model into (created if missing).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the random weights and the tokenizer corpus.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
              help="Weight dtype [default: float32 for tiny, bfloat16 otherwise].")
@click.option("--lora", "lora_count", type=int, default=0, show_default=True, metavar="N",
              help="Also write N LoRA adapters (PEFT format, seeded random weights on q/k/v/o_proj) into "
              "OUT/loras/lora-1 ... lora-N, for `vllm serve --enable-lora --lora-modules`.")
@click.option("--lora-rank", type=int, default=8, show_default=True, help="The rank of each --lora adapter.")
def init(preset: str, out_dir: Path, seed: int, dtype: str | None, lora_count: int, lora_rank: int) -> None:
    """Write a Hugging Face Qwen3 model directory: config.json, seeded random
    safetensors weights and a locally trained byte-level BPE tokenizer with
    Qwen's special tokens and chat template. A real checkpoint loads the same way."""
    if lora_count < 0 or lora_rank < 1:
        fail(f"--lora must be >= 0 and --lora-rank >= 1, got {lora_count} and {lora_rank}", code=BAD_INPUT)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from infertrace.modelgen import PRESETS, hf_config, init_model, parameter_count
    from infertrace.modelgen.blip2 import BLIP2_PRESETS, blip2_parameter_count
    from infertrace.modelgen.presets import parameter_label
    from infertrace.modelgen.vl import VL_PRESETS, vl_parameter_count

    if preset not in PRESETS and lora_count:
        fail(f"--lora writes adapters for the Qwen3 presets, not {preset}", code=BAD_INPUT)
    if preset in VL_PRESETS:
        n_params = vl_parameter_count(preset)
    elif preset in BLIP2_PRESETS:
        n_params = blip2_parameter_count(preset)
    else:
        n_params = parameter_count(hf_config(PRESETS[preset], dtype or PRESETS[preset].dtype))
    with Progress(TextColumn("[bold]writing weights"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task("weights", total=None)

        def on_progress(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        try:
            path = init_model(preset, out_dir, seed=seed, dtype=dtype, on_progress=on_progress)
        except (ValueError, OSError) as e:
            fail(str(e), code=BAD_INPUT)
    out_console.print(f"wrote {preset} ({parameter_label(n_params)} parameters) to {path}")
    if lora_count:
        from infertrace.modelgen.lora import init_adapters

        try:
            adapters = init_adapters(path, lora_count, lora_rank, seed=seed)
        except (ValueError, OSError) as e:
            fail(str(e), code=BAD_INPUT)
        out_console.print(f"wrote {lora_count} LoRA adapter(s) of rank {lora_rank} to {adapters[0].parent}")
