"""Seeded random Qwen3 weights written as safetensors shards, one shard in memory at a time."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Callable

from infertrace.modelgen.presets import weight_shapes

SHARD_BYTES = 2 * 1024**3


def seeded_tensor(name: str, shape: tuple[int, ...], dtype, seed: int, std: float, device: str = "cpu"):
    """The tensor `name` of a checkpoint drawn from `seed` (norm weights are ones), the same wherever it is drawn."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    # a generator per tensor: the values do not depend on sharding or on which tensors came before
    gen = torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen).cpu()


def write_weights(
    out_dir: Path, config: dict, dtype_name: str, seed: int, on_tensor: Callable[[int], None] | None = None,
    device: str = "cpu",
) -> list[Path]:
    """Write the checkpoint; returns the files written. `on_tensor(nbytes)` reports progress; `device` is where
    the random values are drawn."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, dtype_name)
    std = config["initializer_range"]
    shapes = weight_shapes(config)
    total_bytes = sum(_numel(s) for _, s in shapes) * torch.empty((), dtype=dtype).element_size()
    single = total_bytes <= SHARD_BYTES

    shards: list[dict] = [{}]
    shard_bytes = 0
    files: list[Path] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        index = len(files) + 1
        name = "model.safetensors" if single else f"model-{index:05d}-of-NNNNN.safetensors"
        path = out_dir / name
        save_file(shards[-1], str(path), metadata={"format": "pt"})
        os.chmod(path, new_file_mode())  # safetensors leaves 0600 where config.json and the rest get the umask's
        for key in shards[-1]:
            weight_map[key] = name
        files.append(path)
        shards[-1] = {}

    for name, shape in shapes:
        t = seeded_tensor(name, shape, dtype, seed, std, device)
        nbytes = t.numel() * t.element_size()
        if shards[-1] and shard_bytes + nbytes > SHARD_BYTES:
            flush()
            shard_bytes = 0
        shards[-1][name] = t
        shard_bytes += nbytes
        if on_tensor:
            on_tensor(nbytes)
    flush()

    if not single:
        # the final shard count is known only now: rename to the usual model-0000i-of-0000n form
        n = len(files)
        renamed = {}
        for i, path in enumerate(files, 1):
            final = out_dir / f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(final)
            renamed[path.name] = final.name
            files[i - 1] = final
        weight_map = {k: renamed[v] for k, v in weight_map.items()}
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2)
        )
    return files


def write_single_checkpoint(out: Path, shapes, dtype_name: str, seed: int, std: float) -> None:
    """`out/model.safetensors`: every (name, shape) of `shapes` drawn by `seeded_tensor`, in one file."""
    import torch
    from safetensors.torch import save_file

    tensors = {name: seeded_tensor(name, shape, getattr(torch, dtype_name), seed, std) for name, shape in shapes}
    path = out / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, new_file_mode())


def new_file_mode() -> int:
    """The permissions open() gives a new file here: 0666 less the umask (read by setting it back at once)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
