"""The `infertrace bench` command: its flags (load/options.py) make a BenchConfig, the run goes through load/, the
figures are printed and saved, and the HTML run report is drawn by report/. It is the one module above both load/
and report/, which know nothing of each other's callers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import time
from typing import TYPE_CHECKING

import click

from infertrace.console import err_console, fail, out_console
from infertrace.exits import BAD_INPUT as EXIT_BAD_INPUT
from infertrace.exits import FAILURE as EXIT_ALL_FAILED
from infertrace.exits import INTERRUPTED as EXIT_INTERRUPTED
from infertrace.exits import OK as EXIT_OK
from infertrace.load.options import bench_config, bench_options

if TYPE_CHECKING:
    from infertrace.load.config import BenchConfig
    from infertrace.load.results.point import PointRecord

EPILOG = """\b
Examples:
  infertrace bench --model qwen3-0.6b --num-prompts 64 --concurrency 8
  infertrace bench --base-url http://localhost:8000 --tokenizer ./Qwen3-0.6B --request-rate 4 --result-json r.json
  infertrace bench --base-url http://localhost:8000 --dataset trace --dataset-path mooncake.jsonl --report run.html

\b
Exit codes:
  {ok}    the run finished (some requests may have failed: see the table)
  {failure}    every measured request failed, or a load worker was lost
  {bad}    a bad option or input, an unreachable server, an output that cannot be written
  {interrupted}  Ctrl-C: what was measured is saved
""".format(ok=EXIT_OK, failure=EXIT_ALL_FAILED, bad=EXIT_BAD_INPUT, interrupted=EXIT_INTERRUPTED)


@click.command("bench", epilog=EPILOG)
@bench_options
def bench(**options) -> None:
    """Load-test an OpenAI-compatible server or the bundled engine.

    Measures TTFT, TPOT, ITL, E2EL, throughput and goodput exactly as docs/bench.md defines them, and
    reports the client's own headroom (schedule lag, CPU). Without --base-url it runs the bundled engine
    in-process, on a built-in tiny model unless --model is given.
    """
    try:
        cfg = resolve_salt(bench_config(options))
    except ValueError as e:
        fail(str(e), EXIT_BAD_INPUT)
    raise SystemExit(execute(cfg))


def _info(message: str) -> None:
    err_console.print(f"[dim]{message}[/]", highlight=False)


async def _run(cfg: BenchConfig) -> tuple[list[PointRecord], object]:
    from infertrace.load.benchmark import Hooks, Interrupter, run_benchmark
    from infertrace.load.client.targets import check_context, load_tokenizer, make_target, tokenizer_source
    from infertrace.load.clock import MonotonicClock
    from infertrace.load.results.render import progress_for

    target = make_target(cfg, _info)
    interrupter = Interrupter()

    def announce() -> None:
        err_console.print("[yellow]interrupted: finishing up and saving partial results (Ctrl-C again to abort)[/]")

    await _open(target)
    try:
        await target.preflight()
        if target.tokenizer is None and (source := tokenizer_source(cfg)) is not None:
            target.tokenizer = await asyncio.to_thread(load_tokenizer, source)
        check_context(cfg, target.max_model_len)
        await _prepare_cache(cfg, target)
        with interrupter.on_sigint(announce), progress_for(err_console) as progress:
            hooks = Hooks(progress.on_phase, progress.on_result, progress.on_info)
            if cfg.find_max is not None:
                from infertrace.load.capacity import run_capacity

                records = await run_capacity(cfg, target, MonotonicClock(), interrupter, hooks)
            else:
                async with span_receiver(cfg) as receiver:
                    records = await run_benchmark(cfg, target, MonotonicClock(), interrupter, hooks, receiver)
    finally:
        await target.close()
    return records, target


@contextlib.asynccontextmanager
async def span_receiver(cfg: BenchConfig):
    """--otlp-receiver listening over the whole run (every sweep point), or None."""
    if not cfg.otlp_receiver:
        yield None
        return
    from infertrace.load.client.timing import TargetError
    from infertrace.load.observe.otlp_receiver import SpanReceiver
    from infertrace.load.results.peer_logs import VLLM_SPAN, vllm_proto_record

    receiver = SpanReceiver(cfg.otlp_receiver, VLLM_SPAN, vllm_proto_record)
    try:
        await receiver.start()
    except ValueError as e:
        raise TargetError(str(e)) from None
    _info(f"receiving the server's OTLP spans at {', '.join(cfg.otlp_receiver)}")
    try:
        yield receiver
    finally:
        await receiver.close()


async def _open(target) -> None:
    """Open the target; the bundled engine takes seconds to load its model, so say so meanwhile (a spinner on a
    terminal, a line before and after elsewhere)."""
    if (message := target.open_message) is None:
        await target.open()
        return
    started = time.monotonic()
    if err_console.is_terminal:
        with err_console.status(f"{message} ..."):
            await target.open()
    else:
        _info(f"{message} ...")
        await target.open()
    _info(f"engine ready in {time.monotonic() - started:.1f} s")


async def _prepare_cache(cfg: BenchConfig, target) -> None:
    """--reset-prefix-cache and --prompt-salt, before any request (warm-up included)."""
    from infertrace.load.client.timing import TargetError

    if cfg.prompt_salt and target.tokenizer is None and cfg.dataset == "random":
        raise TargetError("--prompt-salt puts a line of text before each prompt, but without a tokenizer random "
                          "prompts are sent as token ids: pass --tokenizer DIR")
    if cfg.prompt_salt:
        _info(f"prompt salt: {cfg.prompt_salt!r} before every prompt"
              + (" (the bundled engine starts with an empty prefix cache anyway)" if target.starts_with_empty_cache
                 else ""))
    if not cfg.reset_prefix_cache:
        return
    if target.starts_with_empty_cache:
        _info(f"--reset-prefix-cache: {await target.reset_prefix_cache()}")
        return
    _info(f"prefix cache emptied (POST {await target.reset_prefix_cache()})")


def resolve_salt(cfg: BenchConfig) -> BenchConfig:
    """`--prompt-salt random` becomes a salt of its own for this run, kept in the result's config (and sent to
    every load worker as it is)."""
    if cfg.prompt_salt != "random":
        return cfg
    return dataclasses.replace(cfg, prompt_salt=f"run {secrets.token_hex(6)}")


def execute(cfg: BenchConfig) -> int:
    """Run, render, persist; the exit code. The run's machinery is imported here, when a run starts, so that
    `infertrace --help` and the other commands do not load it."""
    from infertrace.load.client.fdlimit import OpenFileLimitError, ensure_open_files
    from infertrace.load.client.timing import TargetError
    from infertrace.load.results.render import summary_table, sweep_table
    from infertrace.load.results.result import result_document, write_requests_jsonl
    from infertrace.load.workloads.dataset import DatasetError
    from infertrace.output import OutputError, check_writable, write_json

    try:
        for flag, path in cfg.output_paths().items():
            check_writable(path, flag)
        check_tracing(cfg)
        streams = cfg.max_in_flight or (cfg.num_prompts if cfg.duration_s is None else 0)
        if cfg.base_url is not None and streams:
            ensure_open_files(-(-streams // (cfg.workers or 1)))  # each worker process opens its own share
    except (OutputError, OpenFileLimitError, ValueError) as e:
        fail(str(e), EXIT_BAD_INPUT)
    try:
        records, target = asyncio.run(_run(cfg))
    except (TargetError, DatasetError) as e:
        fail(str(e), EXIT_BAD_INPUT)
    except KeyboardInterrupt:  # before the load started, or a second Ctrl-C: nothing is saved
        fail("interrupted; no result was saved", EXIT_INTERRUPTED)
    if cfg.find_max is not None:
        return finish_capacity(records, cfg, target)
    if cfg.sweep_param is None:
        out_console.print(summary_table(records[0]))
        if figures := (records[0].workload or {}).get("per_adapter"):
            from infertrace.load.results.adapters import adapter_table

            out_console.print(adapter_table(figures))
        if figures := (records[0].workload or {}).get("structured"):
            from infertrace.load.results.structured import refusal_line, structured_table

            out_console.print(structured_table(figures))
            if line := refusal_line(figures):
                err_console.print(f"[yellow]{line}[/]", highlight=False)
        if figures := (records[0].workload or {}).get("images"):
            from infertrace.load.results import images

            out_console.print(images.image_table(figures))
            if line := images.refusal_line(figures):
                err_console.print(f"[yellow]{line}[/]", highlight=False)
    else:
        out_console.print(sweep_table(records, cfg.sweep_param))
    print_warnings(records)
    print_findings(records, cfg)
    paths = cfg.output_paths()
    try:
        if cfg.result_json:
            path = write_json(cfg.result_json, result_document(records, cfg.to_json(), target))
            _info(f"result: {path}")
        if cfg.requests_jsonl:
            _info(f"requests: {write_requests_jsonl(cfg.requests_jsonl, records)}")
        if "--plot" in paths and records:
            from infertrace.load.results.plot import plot_sweep

            _info(f"plot: {plot_sweep(records, cfg.sweep_param, paths['--plot'])}")
        if cfg.report and records:
            _info(f"report: {write_run_report(cfg.report, records[-1])}")
    except (OSError, OutputError) as e:  # checked before the run; the disk can still fill up or vanish meanwhile
        fail(f"cannot save the results: {e}", EXIT_BAD_INPUT)
    code = exit_code(records)
    for line in lost_workers(records):
        err_console.print(f"[bold red]error:[/] {line}", highlight=False)
    if code == EXIT_ALL_FAILED and not lost_workers(records):
        err_console.print("[bold red]error:[/] every measured request failed (reasons under 'failed requests')",
                          highlight=False)
    return code


def check_tracing(cfg: BenchConfig) -> None:
    """ValueError, before any request, for a --peer-log that cannot be read or an OTLP protocol bench does not
    speak."""
    if cfg.peer_log:
        from infertrace.load.results.peer_logs import check_readable

        check_readable(cfg.peer_log)
    if cfg.otlp_traces_endpoint:
        from infertrace.load.results.spans_out import protocol

        protocol()


def print_findings(records: list[PointRecord], cfg: BenchConfig) -> None:
    """The last run's findings under its table: the telemetry's with --report (which reads the profiled window),
    and the tail's whenever the server's request log was joined, as the result file and the HTML hold them."""
    if not records:
        return
    from infertrace.load.observe.findings import findings_table
    from infertrace.load.results.tail import tail_findings

    findings = []
    if cfg.report:
        from infertrace.load.observe.observer import run_findings

        findings += run_findings(records[-1])
    if records[-1].request_log is not None:
        findings += tail_findings(records[-1].results)
    if findings:
        err_console.print(findings_table(findings))


def print_warnings(records: list[PointRecord]) -> None:
    """Each run's headroom warnings, then the token-count warnings of all runs together, once: a sweep or a
    search repeats the same cause at every point."""
    from infertrace.load.results.metrics import sum_token_checks, token_count_warnings

    lines = [w for record in records for w in record.headroom_warnings + record.prefix_cache["prefix_cache_warnings"]
             + record.request_log_warnings]
    lines = once_per_kind(lines, len(records))
    lines += token_count_warnings(sum_token_checks([r.token_checks for r in records]),
                                  any(r.metrics.output_token_sources.get("chunks") for r in records))
    for warning in lines:
        err_console.print(f"[yellow]warning:[/] {warning}", highlight=False)


def once_per_kind(lines: list[str], runs: int) -> list[str]:
    """Each warning once: runs of a sweep or a search that say the same thing with other figures give its first
    wording and how many runs said it."""
    import re

    first: dict[str, str] = {}
    count: dict[str, int] = {}
    for line in lines:
        kind = re.sub(r"\d[\d,.]*", "#", line)
        first.setdefault(kind, line)
        count[kind] = count.get(kind, 0) + 1
    return [line + (f" (in {count[kind]} of {runs} runs; the first shown)" if count[kind] > 1 else "")
            for kind, line in first.items()]


def write_run_report(path: str, record: PointRecord):
    from infertrace.load.report import write_report
    from infertrace.load.report.run import run_report_document
    from infertrace.load.results.result import point_result

    return write_report(path, run_report_document(record, point_result(record)))


def finish_capacity(capacity, cfg: BenchConfig, target) -> int:
    """The search's table, warnings, result file and plot; the exit code of all its runs."""
    from infertrace.load.results.plot import plot_capacity
    from infertrace.load.results.render import capacity_table
    from infertrace.load.results.result import capacity_document
    from infertrace.output import OutputError, write_json

    out_console.print(capacity_table(capacity))
    print_warnings(capacity.records)
    try:
        if cfg.result_json:
            _info(f"result: {write_json(cfg.result_json, capacity_document(capacity, cfg.to_json(), target))}")
        if cfg.requests_jsonl:
            from infertrace.load.results.result import write_requests_jsonl

            _info(f"requests: {write_requests_jsonl(cfg.requests_jsonl, capacity.records)}")
        if capacity.trials:
            _info(f"plot: {plot_capacity(capacity, cfg.output_paths()['--plot'])}")
    except (OSError, OutputError) as e:
        fail(f"cannot save the results: {e}", EXIT_BAD_INPUT)
    return exit_code(capacity.records)


def lost_workers(records: list[PointRecord]) -> list[str]:
    """One line for each load worker (--workers, --ray) that ended without reporting all it sent."""
    return [line for r in records for line in (r.workload or {}).get("lost_workers") or []]


def exit_code(records: list[PointRecord]) -> int:
    """130 when interrupted; 1 when every measured request of the run failed (all sweep points), or a load worker
    was lost (what it never reported counts as failed); else 0."""
    if any(r.interrupted for r in records):
        return EXIT_INTERRUPTED
    if lost_workers(records):
        return EXIT_ALL_FAILED
    if any(r.results for r in records) and not any(r.metrics.completed for r in records):
        return EXIT_ALL_FAILED
    return 0
