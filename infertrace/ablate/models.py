"""Where a recipe's model comes from: a directory on disk, or a preset written once into the model cache.

The cache is the one `infertrace bench` uses ($INFERTRACE_CACHE/models/<preset>, default ~/.cache/infertrace), so
the built-in tiny model is shared between the two commands.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from infertrace.ablate.recipe import Recipe, RecipeError


def preset_model_dir(preset: str, on_build: Callable[[Path], None] | None = None) -> Path:
    """The preset's model directory in the cache, written on first use. It is built beside its final place and
    renamed into it, so an interrupted build never leaves a directory that looks complete."""
    from infertrace.load.embedded_target import TINY_PRESET, cache_dir, default_model_dir

    if preset == TINY_PRESET:
        return default_model_dir(on_build)
    out = cache_dir() / "models" / preset
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from infertrace.modelgen import init_model

    if on_build is not None:
        on_build(out)
    tmp = out.with_name(f".{out.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        init_model(preset, tmp, seed=0)
        os.replace(tmp, out)
    except OSError:  # another process finished first, or the disk is full
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "model.safetensors").is_file():
            raise
    return out


def recipe_model_dir(recipe: Recipe, on_build: Callable[[Path], None] | None = None) -> Path:
    """The directory the recipe's phases load. RecipeError when a named directory is not a model."""
    if recipe.model is None:
        return preset_model_dir(recipe.preset, on_build)
    path = Path(recipe.model)
    if not (path / "config.json").is_file():
        raise RecipeError(f"model {path} is not a model directory (no config.json)")
    return path
