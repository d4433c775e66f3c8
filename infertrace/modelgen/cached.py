"""Presets by name where a model directory is taken (`bench --model tiny`, `serve --model qwen3-0.6b`): each is
written once into the cache folder (infertrace/cache.py) and reused from there."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from infertrace.cache import cache_dir
from infertrace.modelgen.presets import PRESETS


def is_preset(name: str | os.PathLike | None) -> bool:
    """A preset's name that is not also a directory here (a directory of that name wins, as a path)."""
    return name is not None and str(name) in PRESETS and not Path(name).is_dir()


def preset_model_dir(preset: str, on_build: Callable[[Path], None] | None = None) -> Path:
    """The preset's model in the cache, written on first use (`on_build` is told where, before the build). It is
    built beside its final place and renamed into it, so an interrupted build never leaves a directory that looks
    complete."""
    out = cache_dir() / "models" / preset
    if holds_model(out):
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
        if not holds_model(out):
            raise
    return out


def holds_model(path: Path) -> bool:
    """config.json and weights, in one file or sharded (the larger presets)."""
    return (path / "config.json").is_file() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    )
