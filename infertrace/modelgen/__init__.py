"""`infertrace model init`: Hugging Face Qwen3 model directories with real shapes and seeded random weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from infertrace.modelgen.presets import PRESETS, hf_config, parameter_count, weight_shapes

__all__ = ["PRESETS", "init_model", "hf_config", "parameter_count", "weight_shapes"]

DTYPES = ("bfloat16", "float16", "float32")


def init_model(
    preset: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    device: str = "cpu",
) -> Path:
    """Write a model directory for `preset` into `out_dir` and return its path.

    `on_progress(done_bytes, total_bytes)` is called as weights are written. `device="cuda"` draws the random
    weights on the GPU (seconds instead of minutes for 14B parameters; other values than the CPU's for one seed).
    """
    from infertrace.modelgen.blip2 import BLIP2_PRESETS, write_blip2_model
    from infertrace.modelgen.tokenizer import write_tokenizer
    from infertrace.modelgen.vl import VL_PRESETS, write_vl_model
    from infertrace.modelgen.weights import write_weights

    multimodal = {**VL_PRESETS, **BLIP2_PRESETS}
    if preset not in PRESETS and preset not in multimodal:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join([*PRESETS, *multimodal])}")
    dtype = dtype or (PRESETS[preset].dtype if preset in PRESETS else multimodal[preset]["dtype"])
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    if preset in VL_PRESETS:  # a vision-language model for servers that read images; the bundled engine does not
        write_vl_model(preset, out, seed, dtype)
        return out
    if preset in BLIP2_PRESETS:
        write_blip2_model(preset, out, seed, dtype)
        return out
    spec = PRESETS[preset]

    config = hf_config(spec, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(out, seed=seed, model_max_length=spec.max_position_embeddings)

    total = parameter_count(config) * (4 if dtype == "float32" else 2)
    done = 0

    def on_tensor(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if on_progress:
            on_progress(done, total)

    write_weights(out, config, dtype, seed, on_tensor, device=device)
    return out
