"""Reading a Hugging Face model directory: config, checkpoint files, and weights into packed parameters."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_model_dir(model_dir: str | Path) -> Path:
    """Raise one FileNotFoundError naming everything a usable model directory lacks."""
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not checkpoint_files(path):
        missing.append("*.safetensors weights")
    missing += [name for name in TOKENIZER_FILES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"model directory {path} is missing {', '.join(missing)}")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        absent = sorted({f for f in json.loads(index.read_text())["weight_map"].values() if not (path / f).is_file()})
        if absent:
            raise FileNotFoundError(f"model directory {path} is missing checkpoint shard(s) {', '.join(absent)}")
    return path


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def load_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Copy every checkpoint tensor into `model`, packing q/k/v and gate/up; fail on anything missing or unknown.

    A layer with a `weight_loader` (the parallel layers) picks the destination rows and this rank's shard of the
    tensor; the others take the tensor whole.
    """
    from safetensors import safe_open

    params = dict(model.named_parameters())
    rows_left = {name: p.shape[0] for name, p in params.items()}
    packed = getattr(model, "packed_modules", {})
    tied = getattr(model, "lm_head", None) is None
    with torch.no_grad():
        for file in checkpoint_files(model_dir):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                        continue
                    target, part = _target(name, packed)
                    if target not in params:
                        raise ValueError(f"{file.name}: weight {name!r} has no place in {type(model).__name__}")
                    param = params[target]
                    tensor = f.get_tensor(name)
                    loader = getattr(model.get_submodule(target.rpartition(".")[0]), "weight_loader", None)
                    try:
                        dest, src = loader(param.data, tensor, part) if loader else (param.data, tensor)
                        if tuple(src.shape) != tuple(dest.shape):
                            raise ValueError(f"expected {tuple(dest.shape)}")
                    except ValueError as exc:
                        raise ValueError(
                            f"{file.name}: weight {name!r} has shape {tuple(tensor.shape)}, which does not fit "
                            f"{target} of shape {tuple(param.shape)}: {exc}"
                        ) from None
                    dest.copy_(src)
                    rows_left[target] -= dest.shape[0]
    missing = sorted(name for name, left in rows_left.items() if left)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint in {model_dir} lacks weights for {shown}")


def _target(name: str, packed: dict) -> tuple[str, int | None]:
    """The parameter a checkpoint tensor goes to, and its part index there when several tensors are packed into it."""
    for part, (packed_name, index) in packed.items():
        needle = f".{part}."
        if needle in name:
            return name.replace(needle, f".{packed_name}."), index
    return name, None

