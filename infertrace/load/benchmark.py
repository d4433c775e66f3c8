"""One benchmark run (or one per sweep point): warmup, optional profiler window, measured load, figures."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from infertrace.load.client import trace_context
from infertrace.load.client.adapters import AdapterMix
from infertrace.load.client.target import Target
from infertrace.load.client.timing import TargetError, resolve_output_tokens
from infertrace.load.clock import Clock
from infertrace.load.config import DEFAULT_OUTPUT_LEN, BenchConfig
from infertrace.load.observe import otlp_receiver
from infertrace.load.observe.observer import Observer
from infertrace.load.observe.server_counters import engine_spec_growth, read_prefix_cache, run_hit_rate
from infertrace.load.records import RequestResult
from infertrace.load.results import response_metrics, spans_out
from infertrace.load.results.adapters import gate_keys, per_adapter
from infertrace.load.results.join import join
from infertrace.load.results.metrics import compute_metrics, token_count_checks
from infertrace.load.results.peer_logs import PeerLog, join_results, read_peer_log
from infertrace.load.results.point import PointRecord
from infertrace.load.results.steady import steady_state
from infertrace.load.run.fleet import Fleet
from infertrace.load.run.runner import Runner, measured_gc
from infertrace.load.stats import Stats
from infertrace.load.workloads.conversation import ConversationLoad
from infertrace.load.workloads.prompts import PromptLoad
from infertrace.load.workloads.replay import TraceReplay, cache_block_tokens


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

    async def run(self, coro):
        """`coro`'s result, unless a trigger cancels it (Interrupted) or stop_phase does (PhaseStopped)."""
        if self.requested:
            coro.close()
            raise Interrupted
        self._stop_phase = False
        self._task = asyncio.ensure_future(coro)
        try:
            return await self._task
        except asyncio.CancelledError:
            if self.requested:
                raise Interrupted from None
            if self._stop_phase:
                raise PhaseStopped from None
            raise
        finally:
            self._task = None


def make_load(cfg: BenchConfig, tokenizer, point: int = 0,
              max_model_len: int | None = None) -> PromptLoad | TraceReplay | ConversationLoad:
    """What a run sends, built (and so checked) before any load: prompts, a trace's requests, or sessions."""
    if cfg.dataset == "trace":
        return TraceReplay(cfg, tokenizer, max_model_len)
    if cfg.dataset == "conversation":
        return ConversationLoad(cfg, tokenizer, DEFAULT_OUTPUT_LEN, point)
    if cfg.dataset == "agent-trace":
        from infertrace.load.workloads.agent_trace import AgentTraceLoad

        return AgentTraceLoad(cfg, tokenizer, point)
    if cfg.endpoint == "embeddings":
        from infertrace.load.workloads.embedding_batches import EmbeddingLoad

        return EmbeddingLoad(cfg, tokenizer, point, max_model_len)
    return PromptLoad(cfg, tokenizer, point, max_model_len)


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


async def run_point(cfg: BenchConfig, target: Target, clock: Clock, interrupter: Interrupter, hooks: Hooks,
                    point: int = 0, receiver: otlp_receiver.SpanReceiver | None = None) -> PointRecord:
    """Warmup (excluded), profiler start, the measured load, profiler stop, then the figures. `receiver` is the
    run's OTLP receiver (--otlp-receiver), listening since before the first point."""
    tokenizer = target.tokenizer
    load = make_load(cfg, tokenizer, point, target.max_model_len)
    warm = Runner(target, clock, hooks.on_result)
    log_at = await target.request_log_cursor()  # where the request log stands before this point's first request
    interrupted = stopped_early = False
    if n_warm := cfg.effective_warmup:
        warm_specs = load.warmup_specs(n_warm)
        hooks.on_phase("warmup", len(warm_specs), None)
        try:
            await interrupter.run(warm.closed_loop(warm_specs, min(cfg.effective_concurrency or n_warm, n_warm)))
        except Interrupted:
            interrupted = True

    observer = Observer(cfg.scrape_interval_s, cfg.metrics_url, cfg.base_url, cfg.headers, clock,
                        telemetry=bool(cfg.report) or cfg.base_url is not None)
    observed = await observer.start()
    # --profile-seconds bounds the sending window like --duration, so the profiler's stop (which writes the
    # trace and stalls the server) happens after the last measured request, never inside the measured window.
    window = min((s for s in (cfg.duration_s, cfg.profile_seconds) if s), default=None)
    runner = Runner(target, clock, hooks.on_result) if cfg.workers == 1 and cfg.ray_address is None \
        else Fleet(worker_config(cfg, target), clock, hooks.on_result, cfg.ray_address)
    cache_before = engine_before = None
    epoch_offset_ns = spans_out.epoch_offset_ns()  # the run's clock -> the epoch, for the exported spans
    try:  # the observer's scrapes and session end however the phase does (a lost Ray cluster, a bad input)
        async with profiled_window(cfg, target, clock, hooks, observed, cfg.profile and not interrupted) as profile:
            if not interrupted:
                hooks.on_phase("measure", load.total, window)
                engine_before = target.engine_counters()  # the bundled engine in-process: its own counters
                if load.reads_prefix_cache:
                    # the server's counters now: the run's own hit rate
                    cache_before = await read_prefix_cache(target)
                try:
                    with measured_gc():
                        await interrupter.run(load.phase(runner, clock, window))
                except Interrupted:
                    interrupted = True
                except PhaseStopped:
                    stopped_early = True
    finally:
        await observer.stop()
    joined = None
    if not interrupted:  # each request's life on the server: evidence a Ctrl-C (then or now) does not wait for
        try:
            joined = await interrupter.run(join_request_log(target, log_at, runner.results, warm.results))
        except Interrupted:
            interrupted = True
    if joined is None:  # else the figures vLLM put in each response, read while they streamed
        joined = response_metrics.summary(runner.results, cfg.server_metrics == "on")
    if cfg.base_url is not None:  # a server: each send carried a trace context, kept in its record
        for r in [*warm.results, *runner.results]:
            if r.request_id is not None:
                r.trace_id, r.span_id = trace_context.ids(r.request_id)
    if not interrupted and (receiver is not None or cfg.peer_log):
        try:
            joined = await interrupter.run(join_server_spans(cfg, receiver, runner.results, warm.results, joined))
        except Interrupted:
            interrupted = True

    results = runner.results
    workload = {**(runner.figures() if isinstance(runner, Fleet) else {}), **load.figures(results, target)}
    if salt := target.salt_tokens:  # the line --prompt-salt starts every prompt with
        # a prefix cache finds it only in whole blocks (vLLM's default 16 tokens where the target does not say):
        # a salt shorter than a block is found by no prompt
        block, _ = cache_block_tokens(target)
        workload.update(prompt_salt_tokens=salt, prompt_salt_cached_tokens=salt // block * block)
    if load.reads_prefix_cache:
        workload.update(run_hit_rate(cache_before, await read_prefix_cache(target)))
    if engine_before is not None and (grown := engine_spec_growth(engine_before, target.engine_counters())):
        workload["engine_spec_decode"] = grown  # docs/bench.md, "Speculative decoding": the embedded engine's
    resolve_output_tokens(results, tokenizer, check_usage=target.counts_with_own_tokenizer)
    resolve_output_tokens(warm.results, tokenizer)
    if cfg.lora_modules:  # docs/bench.md, "LoRA adapters"
        workload.update(adapter_figures(cfg, results, warm.results))
    if cfg.structured is not None:  # docs/bench.md, "Structured output and tool calls"
        from infertrace.load.results.structured import structured_figures

        workload.update(structured_figures(target.structured, results))
    if cfg.images:  # docs/bench.md, "Images"
        from infertrace.load.client.images import probe_for
        from infertrace.load.results.images import image_measurement

        first_spec = next(iter(getattr(load, "specs", [])), None)
        workload.update(image_measurement(target.images, results, first_spec, *await probe_for(target, first_spec)))
    if cfg.otlp_traces_endpoint and not interrupted:
        hooks.on_info(await asyncio.to_thread(spans_out.export, cfg.otlp_traces_endpoint, results,
                                              epoch_offset_ns))
    metrics = compute_metrics(results, cfg.request_slo, cfg.endpoint == "embeddings")
    duration = metrics.duration
    cpu = runner.cpu_window  # over the same window as the duration
    compare_prompts = target.counts_with_own_tokenizer and cfg.endpoint in ("completions", "embeddings")
    return PointRecord(
        config=cfg, results=results, warmup_results=warm.results, metrics=metrics, request_log=joined,
        token_checks=token_count_checks(results, compare_prompts),
        client_cpu=cpu[0] / duration if cpu and duration > 0 else None,
        process_cpu=cpu[1] / duration if cpu and duration > 0 else None,
        client_lag=Stats.of([max(0.0, r.schedule_lag - r.slot_wait) for r in results]),
        interrupted=interrupted, profile=profile, workload=workload or None, stopped_early=stopped_early,
        observed=observed, steady=steady_state(results, None if cfg.open_loop else cfg.effective_concurrency))


def adapter_figures(cfg: BenchConfig, results: list[RequestResult], warmup: list[RequestResult]) -> dict:
    """Each request tagged with the adapter its body named (the same draw from its index), and the figures of each
    adapter: a `per_adapter` block and its keys for the gate."""
    mix = AdapterMix.of(cfg.lora_modules, cfg.seed)
    for r in (*warmup, *results):
        r.adapter = mix.pick(r.index)
    figures = per_adapter(results, cfg.lora_modules)
    return {"per_adapter": figures, **gate_keys(figures)}


def worker_config(cfg: BenchConfig, target: Target) -> BenchConfig:
    """The config load workers open their own targets from: they run no preflight, so they ask for the server's
    per-request metrics as this process's preflight decided."""
    if cfg.server_metrics == "auto" and target.asks_server_metrics:
        return dataclasses.replace(cfg, server_metrics="on")
    return cfg


async def join_request_log(target: Target, cursor: int | None, results: list[RequestResult],
                           warmup: list[RequestResult]) -> dict | None:
    """The target's request log since `cursor` joined to `results` and `warmup` (their `server` set); the join's
    summary, or None when the target keeps no log or it cannot be read."""
    if cursor is None or (log := await target.fetch_request_log(cursor)) is None:
        return None
    return join(results, log, warmup)


async def join_server_spans(cfg: BenchConfig, receiver: otlp_receiver.SpanReceiver | None,
                            results: list[RequestResult], warmup: list[RequestResult], joined: dict | None) -> dict | None:
    """The server's spans (the receiver's, or --peer-log's file) joined to the requests; the summary that stands.

    Where the requests were joined already (infertrace serve's request log, vLLM's in-response metrics), each keeps
    at the top the view with more TTFT parts (peer_logs.join_results), and the summary of the source that won
    stands, the other's inside it under its source's name."""
    warnings: list[str] = []
    if receiver is not None:
        records = await receiver.collect({r.request_id for r in results if r.success and r.request_id is not None})
        peer = PeerLog(otlp_receiver.SOURCE, records)
        warnings = receiver.warnings()
    else:
        try:
            peer = await asyncio.to_thread(read_peer_log, cfg.peer_log)
        except ValueError as e:  # read before the run; the server may have rotated or cut it since
            peer = PeerLog("peer_log", [])
            warnings = [f"--peer-log: {e}"]
        if peer.skipped:
            warnings.append(f"--peer-log: {peer.skipped} malformed {peer.source} entr"
                            f"{'ies' if peer.skipped > 1 else 'y'} skipped (the first: {peer.first_problem})")
    summary = join_results(results, peer.records, peer.source, warmup)
    summary["warnings"] = [*warnings, *summary["warnings"]]
    if joined is None:
        return summary
    if not summary["matched"]:
        return {**joined, "warnings": [*joined["warnings"], *summary["warnings"]]}
    if summary["explained"]:
        return {**summary, joined["source"]: joined}
    return {**joined, summary["source"]: summary}


@contextlib.asynccontextmanager
async def profiled_window(cfg: BenchConfig, target, clock: Clock, hooks: Hooks, observed,
                          on: bool) -> AsyncIterator[dict | None]:
    """The server's profiler over the block (`--profile`), its answers kept in the dict yielded (None when off):
    started before the block, stopped after it however it ends, and its window marked on `observed`."""
    if not on:
        yield None
        return
    started = clock.now()
    answer = await target.start_profile(cfg.profile_steps)
    profile = {"num_steps": cfg.profile_steps, "seconds": cfg.profile_seconds, "start_response": answer}
    hooks.on_info(f"profiler started{f' for {cfg.profile_steps} steps' if cfg.profile_steps else ''}")
    for note in (answer.get("notes") or []) if isinstance(answer, dict) else []:
        hooks.on_info(f"note: {note}")
    try:
        yield profile
    finally:
        try:
            status, answer = await target.stop_profile()
        except TargetError as e:  # the measured figures stand; say why there are no trace files
            status, answer = None, str(e)
        profile.update(stop_status=status, stop_response=answer, trace_files=trace_files(answer))
        observed.profile_window = (started, clock.now())
        where = answer.get("writes_to") if isinstance(answer, dict) else None
        hooks.on_info(f"profiler stopped: {len(profile['trace_files'])} trace file(s)"
                      + (f" (the server writes to {where})" if where and not profile["trace_files"] else ""))


async def run_benchmark(cfg: BenchConfig, target, clock: Clock, interrupter: Interrupter,
                        hooks: Hooks, receiver: otlp_receiver.SpanReceiver | None = None) -> list[PointRecord]:
    """Every sweep point in order (one point without a sweep); stops early when interrupted."""
    records = []
    for i, point_cfg in enumerate(cfg.points()):
        if cfg.sweep_param is not None:
            hooks.on_info(f"sweep point {i + 1}/{len(cfg.sweep_values)}: "
                          f"{cfg.sweep_param.replace('_', '-')}={getattr(point_cfg, cfg.sweep_param)}")
        record = await run_point(point_cfg, target, clock, interrupter, hooks, i, receiver)
        records.append(record)
        if record.interrupted:
            break
    return records
