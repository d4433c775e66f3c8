"""`--dataset random|shared-prefix|sharegpt|jsonl` as a load of the same shape as trace replay and conversations:
the prompts, built (and so checked) before any request, sent in a closed loop, an open loop at --request-rate, or
a ramp."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator

from infertrace.load.clock import Clock
from infertrace.load.config import DEFAULT_OUTPUT_LEN, BenchConfig
from infertrace.load.records import RequestResult, RequestSpec
from infertrace.load.workloads.dataset import (
    DatasetError,
    PromptMaker,
    jsonl_specs,
    random_id_specs,
    random_specs,
    seeded_rng,
    shared_prefixes,
    sharegpt_specs,
)
from infertrace.load.workloads.schedule import arrival_offsets, ramp_up_offsets


def build_specs(cfg: BenchConfig, tokenizer, n: int, stream: str, point: int = 0,
                max_model_len: int | None = None) -> list[RequestSpec]:
    """`n` requests from the configured dataset; the same (seed, stream, point) gives the same bytes."""
    rng = seeded_rng(cfg.seed, stream, point)
    if cfg.dataset == "random" and tokenizer is None and cfg.base_url is not None:
        if cfg.endpoint == "chat":
            raise DatasetError("--dataset random without a tokenizer sends token ids, which only /v1/completions "
                               "takes: pass --tokenizer DIR for chat")
        return random_id_specs(rng, n, cfg.input_len, cfg.effective_output_len, cfg.range_ratio)
    if cfg.dataset in ("random", "shared-prefix"):
        if tokenizer is None:
            raise DatasetError(f"--dataset {cfg.dataset} builds prompts of exact token length and needs the "
                               "target's tokenizer: pass --tokenizer DIR (or --model DIR)")
        maker = PromptMaker(tokenizer, rng)
        prefixes = shared_prefixes(maker, cfg.num_prefixes, cfg.prefix_len) if cfg.dataset == "shared-prefix" \
            else None
        return random_specs(maker, n, cfg.input_len, cfg.effective_output_len, cfg.range_ratio, prefixes)
    if cfg.dataset == "sharegpt":
        return sharegpt_specs(cfg.dataset_path, n, rng, tokenizer, cfg.output_len, DEFAULT_OUTPUT_LEN,
                              max_model_len)
    return jsonl_specs(cfg.dataset_path, n, tokenizer, cfg.output_len, DEFAULT_OUTPUT_LEN)


class numbered_cycle:  # noqa: N801 - used as the generator it replaces
    """The prompts over and over, each send with its own index (for --duration runs); `base` is the list cycled,
    for load workers that cycle their own share."""

    def __init__(self, specs: list[RequestSpec]) -> None:
        self.base = specs
        self._it = (dataclasses.replace(spec, index=i) for i, spec in enumerate(itertools.cycle(specs)))

    def __iter__(self) -> Iterator[RequestSpec]:
        return self

    def __next__(self) -> RequestSpec:
        return next(self._it)


class PromptLoad:
    """--num-prompts prompts of the configured dataset (cycled for --duration): --concurrency users in a closed
    loop, arrivals drawn up front at --request-rate, or a --ramp-up-strategy ramp."""

    reads_prefix_cache = False  # no hit rate of the run's own is read for independent prompts

    def __init__(self, cfg: BenchConfig, tokenizer, point: int = 0, max_model_len: int | None = None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.point = point
        self.max_model_len = max_model_len
        self.specs = build_specs(cfg, tokenizer, cfg.num_prompts, "measure", point, max_model_len)

    @property
    def total(self) -> int | None:
        return None if self.cfg.duration_s else self.cfg.num_prompts

    def warmup_specs(self, n: int) -> list[RequestSpec]:
        return build_specs(self.cfg, self.tokenizer, n, "warmup", self.point, self.max_model_len)

    def phase(self, runner, clock: Clock, window: float | None):
        cfg = self.cfg
        arrivals = seeded_rng(cfg.seed, "arrivals", self.point)
        if cfg.ramp_up_strategy is not None:
            offsets = ramp_up_offsets(cfg.ramp_up_strategy, cfg.ramp_up_start_rps, cfg.ramp_up_end_rps,
                                      cfg.burstiness, arrivals, cfg.num_prompts)
            return runner.open_loop(self.specs, offsets, cfg.concurrency)
        if cfg.open_loop:
            rate = cfg.request_rate
            count = cfg.num_prompts if cfg.duration_s is None or math.isinf(rate) else None
            offsets = arrival_offsets(rate, cfg.burstiness, arrivals, count, window)
            return runner.open_loop(numbered_cycle(self.specs), offsets, cfg.concurrency)
        deadline = clock.now() + window if window else None
        specs = numbered_cycle(self.specs) if cfg.duration_s else self.specs
        return runner.closed_loop(specs, cfg.effective_concurrency, deadline)

    def figures(self, results: list[RequestResult], target) -> dict:
        return {}
