"""What `infertrace bench` does once its options are parsed: run, render, persist; returns the exit code."""

from __future__ import annotations

import asyncio
from pathlib import Path

from infertrace.console import err_console, fail, out_console
from infertrace.load.benchmark import (
    Hooks,
    Interrupter,
    PointRecord,
    load_tokenizer,
    make_target,
    run_benchmark,
    tokenizer_source,
)
from infertrace.load.clock import MonotonicClock
from infertrace.load.config import BenchConfig
from infertrace.load.dataset import DatasetError
from infertrace.load.render import LiveProgress, summary_table, sweep_table
from infertrace.load.timing import TargetError

EXIT_INTERRUPTED = 130


def _info(message: str) -> None:
    err_console.print(f"[dim]{message}[/]", highlight=False)


async def _run(cfg: BenchConfig) -> tuple[list[PointRecord], object]:
    target = make_target(cfg, _info)
    interrupter = Interrupter()

    def announce() -> None:
        err_console.print("[yellow]interrupted: finishing up and saving partial results (Ctrl-C again to abort)[/]")

    await target.open()
    try:
        await target.preflight()
        if target.kind == "http" and (source := tokenizer_source(cfg)) is not None:
            target.tokenizer = await asyncio.to_thread(load_tokenizer, source)
        with interrupter.on_sigint(announce), LiveProgress(err_console) as progress:
            hooks = Hooks(progress.on_phase, progress.on_result, progress.on_info)
            records = await run_benchmark(cfg, target, MonotonicClock(), interrupter, hooks)
    finally:
        await target.close()
    return records, target


def execute(cfg: BenchConfig) -> int:
    from infertrace.load.result import result_document, write_json, write_requests_jsonl

    try:
        records, target = asyncio.run(_run(cfg))
    except (TargetError, DatasetError) as e:
        fail(str(e), 2)
    except KeyboardInterrupt:  # before the load started, or a second Ctrl-C: nothing is saved
        fail("interrupted; no result was saved", EXIT_INTERRUPTED)
    interrupted = any(r.interrupted for r in records)
    if cfg.sweep_param is None:
        out_console.print(summary_table(records[0]))
    else:
        out_console.print(sweep_table(records, cfg.sweep_param))
    for record in records:
        for warning in record.warnings:
            err_console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    if cfg.result_json:
        path = write_json(cfg.result_json, result_document(records, cfg.to_json(), target))
        _info(f"result: {path}")
    if cfg.requests_jsonl:
        _info(f"requests: {write_requests_jsonl(cfg.requests_jsonl, records)}")
    if cfg.sweep_param is not None and records:
        from infertrace.load.plot import plot_sweep

        default = Path(cfg.result_json).with_suffix(".png") if cfg.result_json else Path("bench-sweep.png")
        _info(f"plot: {plot_sweep(records, cfg.sweep_param, cfg.plot or default)}")
    return EXIT_INTERRUPTED if interrupted else 0
