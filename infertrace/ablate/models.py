"""Where a recipe's model comes from: a directory on disk, or a preset written once into the model cache.

The cache is the one `infertrace bench` uses ($INFERTRACE_CACHE/models/<preset>, default ~/.cache/infertrace), so
the built-in tiny model is shared between the two commands.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from infertrace.ablate.recipe import Recipe, RecipeError


def preset_model_dir(preset: str, on_build: Callable[[Path], None] | None = None) -> Path:
    """The preset's model directory in the cache (shared with bench), written on first use."""
    from infertrace.load.client.embedded_target import default_model_dir

    return default_model_dir(on_build, preset=preset)


def recipe_model_dir(recipe: Recipe, on_build: Callable[[Path], None] | None = None) -> Path:
    """The directory the recipe's phases load. RecipeError when a named directory is not a model."""
    if recipe.model is None:
        return preset_model_dir(recipe.preset, on_build)
    return check_model_dir(recipe)


def check_model_dir(recipe: Recipe) -> Path:
    """The recipe's named model directory, checked without loading it; RecipeError when it is not one. A preset
    always has one (written on first use)."""
    path = Path(recipe.model)
    if not path.is_dir():
        raise RecipeError(f"model {path} is not a model directory (it does not exist)")
    if not (path / "config.json").is_file():
        raise RecipeError(f"model {path} is not a model directory (no config.json)")
    return path
