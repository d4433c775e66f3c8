"""The target a run sends to, made from its config: an HTTP server for --base-url, else the bundled engine; and the
tokenizer that builds prompts for a server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from infertrace.load.client.timing import TargetError
from infertrace.load.config import BenchConfig
from infertrace.load.workloads.dataset import DatasetError


def resolve_model_dir(model: str | None) -> Path | None:
    return Path(model) if model and Path(model).is_dir() else None


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot load a tokenizer from {path}: {str(e).splitlines()[0]}") from None


def make_target(cfg: BenchConfig, on_info: Callable[[str], None]):
    """The HTTP target for --base-url, else the bundled engine (on the built-in tiny model without --model)."""
    if cfg.base_url is not None:
        from infertrace.load.client.http_target import (
            AiohttpTransport,
            HttpTarget,
            normalize_base_url,
        )

        model_dir = resolve_model_dir(cfg.model)
        transport = AiohttpTransport(normalize_base_url(cfg.base_url), cfg.request_timeout_s, cfg.headers)
        return HttpTarget(cfg.base_url, cfg.endpoint, cfg.served_model_name or cfg.model, transport,
                          model_is_path=model_dir is not None and cfg.served_model_name is None,
                          ignore_eos=cfg.ignore_eos, temperature=cfg.temperature,
                          continuous_usage=cfg.continuous_usage, extra_body=cfg.extra_body)
    from infertrace.load.client.embedded_target import EmbeddedTarget, default_model_dir

    if cfg.model is not None and resolve_model_dir(cfg.model) is None:
        raise TargetError(f"--model {cfg.model} is not a model directory (the bundled engine loads one from disk)")
    model_dir = cfg.model or default_model_dir(
        lambda out: on_info(f"building the built-in tiny model into {out} (first use only)"))
    return EmbeddedTarget(model_dir, cfg.engine_overrides, ignore_eos=cfg.ignore_eos, temperature=cfg.temperature)


def tokenizer_source(cfg: BenchConfig) -> Path | None:
    """Where an HTTP target's tokenizer comes from: --tokenizer, else --model when it is a local directory."""
    return Path(cfg.tokenizer) if cfg.tokenizer else resolve_model_dir(cfg.model)
