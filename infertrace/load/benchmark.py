"""One benchmark run (or one per sweep point): warmup, optional profiler window, measured load, figures."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from infertrace.load.client.timing import TargetError, resolve_output_tokens
from infertrace.load.clock import Clock
from infertrace.load.config import DEFAULT_OUTPUT_LEN, BenchConfig
from infertrace.load.observe.observer import Observer
from infertrace.load.observe.server_counters import read_prefix_cache, run_hit_rate
from infertrace.load.records import RequestResult, RequestSpec
from infertrace.load.results.join import join_run, log_cursor
from infertrace.load.results.metrics import compute_metrics, token_count_checks
from infertrace.load.results.point import PointRecord
from infertrace.load.results.steady import steady_state
from infertrace.load.run.fleet import Fleet
from infertrace.load.run.runner import Runner, measured_gc
from infertrace.load.stats import Stats
from infertrace.load.workloads.conversation import ConversationLoad
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
from infertrace.load.workloads.replay import TraceReplay
from infertrace.load.workloads.schedule import arrival_offsets, ramp_up_offsets


class Interrupted(Exception):
    """The user stopped the run (Ctrl-C); what was measured so far is kept."""


class PhaseStopped(Exception):
    """The running phase was ended early on purpose (a --find-max point found saturated); the run goes on."""


class Interrupter:
    """Cancels whatever phase is running when triggered (from a SIGINT handler), once."""

    def __init__(self) -> None:
        self.requested = False
        self._stop_phase = False
        self._task: asyncio.Future | None = None

    def stop_phase(self) -> None:
        """End the running phase early without ending the run: `run` raises PhaseStopped."""
        self._stop_phase = True
        if self._task is not None:
            self._task.cancel()

    def trigger(self) -> None:
        self.requested = True
        if self._task is not None:
            self._task.cancel()

    @contextlib.contextmanager
    def on_sigint(self, announce: Callable[[], None]):
        """While inside, the first Ctrl-C calls `announce` and triggers; a second one gets Python's default."""
        loop = asyncio.get_running_loop()

        def handler() -> None:
            announce()
            self.trigger()
            loop.remove_signal_handler(signal.SIGINT)

        loop.add_signal_handler(signal.SIGINT, handler)
        try:
            yield self
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    async def run(self, coro) -> None:
        if self.requested:
            coro.close()
            raise Interrupted
        self._stop_phase = False
        self._task = asyncio.ensure_future(coro)
        try:
            await self._task
        except asyncio.CancelledError:
            if self.requested:
                raise Interrupted from None
            if self._stop_phase:
                raise PhaseStopped from None
            raise
        finally:
            self._task = None


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


def shaped_load(cfg: BenchConfig, tokenizer, point: int = 0) -> TraceReplay | ConversationLoad | None:
    """Trace replay or multi-turn sessions, built (and so checked) before any load; None for the other datasets."""
    if cfg.dataset == "trace":
        return TraceReplay(cfg, tokenizer)
    if cfg.dataset == "conversation":
        return ConversationLoad(cfg, tokenizer, DEFAULT_OUTPUT_LEN, point)
    return None


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


def trace_files(answer) -> list[str]:
    if isinstance(answer, dict):
        for key in ("trace_files", "files"):
            if isinstance(answer.get(key), list):
                return [str(p) for p in answer[key]]
    return []


@dataclass(slots=True)
class Hooks:
    """What the command layer shows while a run goes on."""

    on_phase: Callable[[str, int | None, float | None], None] = lambda name, total, seconds: None
    on_result: Callable[[RequestResult], None] = lambda r: None
    on_info: Callable[[str], None] = lambda msg: None


async def run_point(cfg: BenchConfig, target, clock: Clock, interrupter: Interrupter, hooks: Hooks,
                    point: int = 0) -> PointRecord:
    """Warmup (excluded), profiler start, the measured load, profiler stop, then the figures."""
    max_len = getattr(target, "max_model_len", None)
    tokenizer = target.tokenizer
    load = shaped_load(cfg, tokenizer, point)
    specs = build_specs(cfg, tokenizer, cfg.num_prompts, "measure", point, max_len) if load is None else []
    cache_before = None
    concurrency = cfg.effective_concurrency
    interrupted = stopped_early = False
    warm = Runner(target, clock, hooks.on_result)
    log_at = await log_cursor(target)  # where the server's request log stands before this point's first request
    if n_warm := cfg.effective_warmup:
        warm_specs = load.warmup_specs(n_warm) if load is not None else \
            build_specs(cfg, tokenizer, n_warm, "warmup", point, max_len)
        hooks.on_phase("warmup", len(warm_specs), None)
        try:
            await interrupter.run(warm.closed_loop(warm_specs, min(concurrency or n_warm, n_warm)))
        except Interrupted:
            interrupted = True

    observer = Observer(cfg.scrape_interval_s, cfg.metrics_url, cfg.base_url, cfg.headers, clock,
                        telemetry=bool(cfg.report) or cfg.base_url is not None)
    observed = await observer.start()
    profile = None
    if cfg.profile and not interrupted:
        profile_started = clock.now()
        answer = await target.start_profile(cfg.profile_steps)
        profile = {"num_steps": cfg.profile_steps, "seconds": cfg.profile_seconds, "start_response": answer}
        hooks.on_info(f"profiler started{f' for {cfg.profile_steps} steps' if cfg.profile_steps else ''}")
        for note in (answer.get("notes") or []) if isinstance(answer, dict) else []:
            hooks.on_info(f"note: {note}")

    # --profile-seconds bounds the sending window like --duration, so the profiler's stop (which writes the
    # trace and stalls the server) happens after the last measured request, never inside the measured window.
    window = min((s for s in (cfg.duration_s, cfg.profile_seconds) if s), default=None)
    runner = Runner(target, clock, hooks.on_result) if cfg.workers == 1 and cfg.ray_address is None \
        else Fleet(cfg, clock, hooks.on_result, cfg.ray_address)
    if not interrupted:
        total = load.total if load is not None else None if cfg.duration_s else cfg.num_prompts
        hooks.on_phase("measure", total, window)
        if load is not None:
            cache_before = await read_prefix_cache(target)  # the server's counters now: the run's own hit rate
            phase = load.phase(runner, clock, window)
        elif cfg.ramp_up_strategy is not None:
            offsets = ramp_up_offsets(cfg.ramp_up_strategy, cfg.ramp_up_start_rps, cfg.ramp_up_end_rps,
                                      cfg.burstiness, seeded_rng(cfg.seed, "arrivals", point), cfg.num_prompts)
            phase = runner.open_loop(specs, offsets, cfg.concurrency)
        elif cfg.open_loop:
            rate = cfg.request_rate
            count = cfg.num_prompts if cfg.duration_s is None or math.isinf(rate) else None
            offsets = arrival_offsets(rate, cfg.burstiness, seeded_rng(cfg.seed, "arrivals", point), count, window)
            phase = runner.open_loop(numbered_cycle(specs), offsets, cfg.concurrency)
        else:
            deadline = clock.now() + window if window else None
            phase = runner.closed_loop(numbered_cycle(specs) if cfg.duration_s else specs, concurrency, deadline)
        try:
            with measured_gc():
                await interrupter.run(phase)
        except Interrupted:
            interrupted = True
        except PhaseStopped:
            stopped_early = True

    if profile is not None:
        try:
            status, answer = await target.stop_profile()
        except TargetError as e:  # the measured figures stand; say why there are no trace files
            status, answer = None, str(e)
        profile.update(stop_status=status, stop_response=answer, trace_files=trace_files(answer))
        observed.profile_window = (profile_started, clock.now())
        where = answer.get("writes_to") if isinstance(answer, dict) else None
        hooks.on_info(f"profiler stopped: {len(profile['trace_files'])} trace file(s)"
                      + (f" (the server writes to {where})" if where and not profile["trace_files"] else ""))

    await observer.stop()
    joined = await join_run(target, log_at, runner.results, warm.results)  # each request's life on the server
    results = runner.results
    workload = runner.figures() if isinstance(runner, Fleet) else None
    if load is not None:
        workload = {**(workload or {}), **load.figures(results, target),
                    **run_hit_rate(cache_before, await read_prefix_cache(target))}
    resolve_output_tokens(results, tokenizer, check_usage=target.kind == "http")
    resolve_output_tokens(warm.results, tokenizer)
    metrics = compute_metrics(results, cfg.request_slo)
    duration = metrics.duration
    cpu = runner.cpu_window  # over the same window as the duration
    compare_prompts = target.kind == "http" and cfg.endpoint == "completions"
    return PointRecord(
        config=cfg, results=results, warmup_results=warm.results, metrics=metrics, request_log=joined,
        token_checks=token_count_checks(results, compare_prompts),
        client_cpu=cpu[0] / duration if cpu and duration > 0 else None,
        process_cpu=cpu[1] / duration if cpu and duration > 0 else None,
        client_lag=Stats.of([max(0.0, r.schedule_lag - r.slot_wait) for r in results]),
        interrupted=interrupted, profile=profile, workload=workload, stopped_early=stopped_early, observed=observed,
        steady=steady_state(results, None if cfg.open_loop else cfg.effective_concurrency))


async def run_benchmark(cfg: BenchConfig, target, clock: Clock, interrupter: Interrupter,
                        hooks: Hooks) -> list[PointRecord]:
    """Every sweep point in order (one point without a sweep); stops early when interrupted."""
    records = []
    for i, point_cfg in enumerate(cfg.points()):
        if cfg.sweep_param is not None:
            hooks.on_info(f"sweep point {i + 1}/{len(cfg.sweep_values)}: "
                          f"{cfg.sweep_param.replace('_', '-')}={getattr(point_cfg, cfg.sweep_param)}")
        record = await run_point(point_cfg, target, clock, interrupter, hooks, i)
        records.append(record)
        if record.interrupted:
            break
    return records
