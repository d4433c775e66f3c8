"""The target a run sends to, made from its config: an HTTP server for --base-url, else the bundled engine; and the
tokenizer that builds prompts for a server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from infertrace.auth import check_url
from infertrace.load.client.timing import TargetError
from infertrace.load.config import BenchConfig
from infertrace.load.workloads.dataset import DatasetError


def resolve_model_dir(model: str | None) -> Path | None:
    return Path(model) if model and Path(model).is_dir() else None


def load_tokenizer(path: str | Path):
    """The tokenizer in a local folder (nothing is downloaded: a name that is no folder is an error)."""
    if not Path(path).is_dir():
        why = "no such folder" if not Path(path).exists() else "not a folder"
        raise DatasetError(f"cannot load a tokenizer from {path}: {why} (--tokenizer takes the local folder of a "
                           "model or its tokenizer)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot load a tokenizer from {path}: {str(e).splitlines()[0]}") from None


def make_target(cfg: BenchConfig, on_info: Callable[[str], None]):
    """The HTTP target for --base-url, else the bundled engine (on the built-in tiny model without --model, or on
    a preset named by --model, made in the cache on first use)."""
    if cfg.base_url is not None:
        return _http_target(cfg)
    from infertrace.load.client.embedded_target import TINY_PRESET, EmbeddedTarget
    from infertrace.modelgen.cached import is_preset, preset_model_dir
    from infertrace.modelgen.presets import PRESETS

    if cfg.model is not None and resolve_model_dir(cfg.model) is None and not is_preset(cfg.model):
        raise TargetError(f"--model {cfg.model} is neither a model directory nor a preset "
                          f"({', '.join(PRESETS)}); the bundled engine loads one from disk")
    model_dir = cfg.model if resolve_model_dir(cfg.model) is not None else preset_model_dir(
        cfg.model or TINY_PRESET, lambda out: on_info(f"building the {cfg.model or 'built-in tiny'} model into "
                                                      f"{out} (first use only)"))
    return EmbeddedTarget(model_dir, cfg.engine_overrides, ignore_eos=cfg.ignore_eos, temperature=cfg.temperature)


def _http_target(cfg: BenchConfig):
    """The server's target, with what its requests carry beyond their prompts (--lora-modules, --structured,
    --images) built from the config: a load worker makes its own target here, so its bodies are the ones one
    process would send, every draw made from the seed and the request's index."""
    from infertrace.load.client.adapters import AdapterMix
    from infertrace.load.client.http_target import (
        AiohttpTransport,
        HttpTarget,
        normalize_base_url,
    )
    from infertrace.load.workloads.structured import structured_plan

    try:
        check_url(cfg.base_url)
        if cfg.metrics_url is not None:
            check_url(cfg.metrics_url, "--metrics-url")
    except ValueError as e:
        raise TargetError(str(e)) from None
    model_dir = resolve_model_dir(cfg.model)
    transport = AiohttpTransport(normalize_base_url(cfg.base_url), cfg.request_timeout_s, cfg.headers)
    target = HttpTarget(cfg.base_url, cfg.endpoint, cfg.served_model_name or cfg.model, transport,
                        model_is_path=model_dir is not None and cfg.served_model_name is None,
                        ignore_eos=cfg.ignore_eos, temperature=cfg.temperature,
                        continuous_usage=cfg.continuous_usage, extra_body=cfg.extra_body,
                        prompt_salt=cfg.prompt_salt, server_metrics=cfg.server_metrics,
                        tokenizer_dir=tokenizer_source(cfg) if cfg.workers > 1 or cfg.ray_address else None)
    target.adapters = AdapterMix.of(cfg.lora_modules, cfg.seed)
    target.structured = structured_plan(cfg)
    if cfg.images:  # encoded now, before the run and off its clock
        from infertrace.load.workloads.images import plan_of

        target.images = plan_of(cfg)
    return target


def check_context(cfg: BenchConfig, max_model_len: int | None) -> None:
    """TargetError before any request when the longest prompt the config builds, with its output, cannot fit the
    target's context (vLLM and SGLang give max_model_len in /v1/models; the bundled engine its own). Random and
    shared-prefix lengths are known from the flags; files and traces are checked request by request."""
    if max_model_len is None or cfg.dataset not in ("random", "shared-prefix"):
        return
    longest_in = int(cfg.input_len * (1 + cfg.range_ratio)) + (cfg.prefix_len if cfg.dataset == "shared-prefix"
                                                               else 0)
    # an embedding is computed over the input alone: nothing is generated after it
    longest_out = 0 if cfg.endpoint == "embeddings" else int(cfg.effective_output_len * (1 + cfg.range_ratio))
    if longest_in + longest_out > max_model_len:
        parts = "--prefix-len + --input-len" if cfg.dataset == "shared-prefix" else "--input-len"
        raise TargetError(f"the longest request is {longest_in} prompt + {longest_out} output tokens, above the "
                          f"target's context of {max_model_len} tokens (max_model_len): lower {parts} or "
                          "--output-len")


def tokenizer_source(cfg: BenchConfig) -> Path | None:
    """Where an HTTP target's tokenizer comes from: --tokenizer, else --model when it is a local directory."""
    return Path(cfg.tokenizer) if cfg.tokenizer else resolve_model_dir(cfg.model)
