"""The `infertrace analyze` command: explain profiler traces with HTA's breakdowns plus inference phases."""

from __future__ import annotations

from pathlib import Path

import click

from infertrace.console import err_console, fail, out_console
from infertrace.exits import BAD_INPUT
from infertrace.output import write_json, writing

EXIT_CODES = """\b
Exit codes:
  0  the report was produced (files that could not be used are listed as warnings on stderr)
  2  nothing to analyse: the path does not exist, holds no trace files, or none of them is readable; or a
     report given to `diff` is cut short or not a report; or an output file (--json, --csv, --html,
     --perfetto) could not be written"""


DIFF_SCHEMA = "infertrace.analyze-diff/1"  # first, so the comparison is never read back as a trace


class _RunByDefault(click.Group):
    """`infertrace analyze DIR` means `infertrace analyze run DIR`; subcommand names still win."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group(name="analyze", cls=_RunByDefault, help=f"""Explain profiler traces: HTA breakdowns plus inference phases.

\b
  infertrace analyze TRACE_DIR [--json R.json] [--csv DIR] [--html R.html]
  infertrace analyze diff BEFORE AFTER

TRACE_DIR holds one trace per rank: Kineto JSON (`.json`, `.json.gz`) from torch.profiler, vLLM or SGLang, or
Nsight Systems exports (`.sqlite`; `.nsys-rep` is exported with `nsys` when it is on PATH). Subdirectories are
searched; where captures accumulate, files are grouped by capture (vLLM's and SGLang's own file names, else by
directory) and the newest is read unless --capture names another. infertrace's own outputs (analyze reports,
bench results, capture manifests) are never read as traces, whatever their name or place.

{EXIT_CODES}
""")
def analyze() -> None:
    pass


@analyze.command(name="run", help=f"""Analyse the traces in TRACE_DIR (a directory, or one trace file).

Prints HTA's temporal, idle-time, kernel-type, top-kernel and communication-overlap breakdowns (communication
includes collectives not named nccl), launch statistics (graph launches included), GPU time by kernel category,
and inference phases: steps found from `step[PREFILL|DECODE|MIXED ..]` (infertrace), `step[EXTEND|DECODE ..]`
(SGLang) or `execute_context_.._generation_..` (vLLM) annotations, with step time, GPU busy share, kernels per
step, time by kernel category and a CPU-bound verdict. On several ranks (or one rank with collectives): the
critical path of each step through the collectives, the gating rank and kernel, and what the step would save with
that rank at the median rank's speed. A capture without GPU activity gets its CPU operators by self time, in all
and per step. Timestamps are kept to the nanosecond.

Ranks are read and analysed each in its own process (--jobs), or as Ray tasks (--ray). Each file's events, each
rank's analysis and the finished report are cached (--cache-dir): a second run over unchanged traces prints the
cached report (and writes it with --json) without reading them; with --csv, --html or --perfetto it reads the
cached ranks.

{EXIT_CODES}
""")
@click.argument("trace_dir", type=click.Path(path_type=Path))
@click.option("--json", "json_path", type=click.Path(path_type=Path), metavar="PATH",
              help="Write the whole report as JSON (readable by `analyze diff`).")
@click.option("--csv", "csv_dir", type=click.Path(path_type=Path), metavar="DIR",
              help="Write one CSV file per table into DIR.")
@click.option("--html", "html_path", type=click.Path(path_type=Path), metavar="PATH",
              help="Write a self-contained HTML report that opens offline: tables and SVG charts, plus the per-step "
                   "timeline with plotly's script inlined (4.8 MB) when there are steps.")
@click.option("--top", "top_kernels", type=click.IntRange(min=1), default=None,
              help="Kernels named per rank and kernel type before the rest are grouped as 'others' [default: 10, "
                   "as HTA].")
@click.option("--capture", "capture_name", metavar="NAME",
              help="Which capture to read where several lie under TRACE_DIR: its name as the notes give it (vLLM "
                   "prefix, SGLang profile id or directory, with @ and the time stamp of its files where one "
                   "directory holds several), or a part of it [default: the newest].")
@click.option("--rank", type=click.IntRange(min=0), help="Read only this rank of the capture.")
@click.option("--perfetto", "perfetto_path", type=click.Path(path_type=Path), metavar="PATH",
              help="Write the capture in Chrome trace format (Perfetto and chrome://tracing open it) with its steps, "
                   "phases and critical path as extra tracks.")
@click.option("--jobs", type=click.IntRange(min=1), default=None,
              help="Processes: ranks analysed at once, each in its own; for a one-rank capture, the processes a "
                   "large JSON trace is decoded in [default: one per core; one file in one process below 4 cores].")
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="Analyse each rank as a Ray task on the cluster at ADDRESS (auto: the one `ray start` made); "
                   "the traces must be at the same path on every node. Needs the [distributed] extra.")
@click.option("--cache-dir", type=click.Path(path_type=Path, file_okay=False), metavar="DIR",
              help="Where decoded events and analysed ranks are cached; a directory of another user's, or one "
                   "others may write into, is not used [default: $INFERTRACE_CACHE_DIR, else "
                   "$INFERTRACE_CACHE/analyze, else ~/.cache/infertrace/analyze].")
@click.option("--no-cache", is_flag=True, help="Neither read nor write the cache.")
@click.option("--quiet", is_flag=True, help="Print no tables (only warnings and the files written).")
def run(trace_dir: Path, json_path: Path | None, csv_dir: Path | None, html_path: Path | None,
        top_kernels: int | None, capture_name: str | None, rank: int | None, perfetto_path: Path | None,
        jobs: int | None, ray_address: str | None, cache_dir: Path | None, no_cache: bool, quiet: bool) -> None:
    from infertrace.analyze.report_cache import (
        default_cache_dir,
        load_report,
        own_cache_root,
        report_key,
        store_report,
    )

    _skip_last_collection()
    outputs = [p for p in (json_path, csv_dir, html_path, perfetto_path) if p is not None]
    cache = None
    if not no_cache:
        cache, why_not = own_cache_root(cache_dir or default_cache_dir())
        if why_not is not None:
            err_console.print(f"[yellow]warning:[/] {why_not}", highlight=False, soft_wrap=True)
    key = doc = report = None
    if cache is not None and csv_dir is None and html_path is None and perfetto_path is None:
        # the finished report, where nothing under the path changed: no trace read, no pandas imported
        key = report_key(trace_dir, {"capture": capture_name, "rank": rank, "top": top_kernels}, outputs)
        doc = load_report(cache, key) if key is not None else None
    if doc is not None:
        run_notes = ["the report from the cache: no trace file under the path changed since it was made"]
    else:
        report = _analysed(trace_dir, top_kernels, capture_name, rank, outputs, jobs, ray_address, cache)
        from infertrace.analyze.persist import report_dict  # pandas: imported by _analysed, without pyarrow

        doc = report_dict(report)
        if key is not None:
            store_report(cache, key, doc)
        run_notes = report.run_notes
    _show(doc, run_notes, quiet)
    if json_path is not None:
        _write(json_path, lambda p: write_json(p, doc, indent=1))
    if report is not None:
        _write_outputs(report, csv_dir, html_path, perfetto_path, cache)


def _analysed(trace_dir: Path, top_kernels: int | None, capture_name: str | None, rank: int | None,
              outputs: list[Path], jobs: int | None, ray_address: str | None, cache: Path | None):
    """The report of the traces at `trace_dir` (analyze_fleet), a capture error as one line and BAD_INPUT."""
    from infertrace.analyze.capture import CaptureError
    from infertrace.analyze.fleet import analyze_fleet, read_ahead

    ahead = read_ahead(trace_dir, capture_name, rank, outputs, jobs, ray_address, cache)  # decodes while we import
    try:
        import_pandas_without_pyarrow()
        from infertrace.analyze.report import AnalyzeConfig

        config = AnalyzeConfig() if top_kernels is None else AnalyzeConfig(top_kernels=top_kernels)
        return analyze_fleet(trace_dir, config, capture_name, rank, outputs, jobs, ray_address, cache, ahead)
    except CaptureError as exc:
        fail(str(exc), code=BAD_INPUT)
    finally:
        if ahead is not None:
            ahead.cancel()  # its processes were joined, or were not needed (the rank came from the cache)


@analyze.command(name="diff", help=f"""Compare two captures, BEFORE and AFTER, by step type and kernel category.

Each side is a trace directory (or file) or a report written by `analyze --json`. Shows step counts, step time
(mean and p99), GPU busy and host-wait shares, kernels per step and verdicts per step type, and GPU time per
kernel category in total and per step, with AFTER's change relative to BEFORE.

{EXIT_CODES}
""")
@click.argument("before", type=click.Path(path_type=Path))
@click.argument("after", type=click.Path(path_type=Path))
@click.option("--json", "json_path", type=click.Path(path_type=Path), metavar="PATH",
              help="Write the comparison tables as JSON.")
def diff(before: Path, after: Path, json_path: Path | None) -> None:
    from infertrace.analyze.diff import diff_reports
    from infertrace.analyze.persist import table_records
    from infertrace.analyze.render import render_diff

    reports = [_report_of(path) for path in (before, after)]
    tables = diff_reports(*reports)
    out_console.print(render_diff(tables, str(before), str(after), fit=out_console.is_terminal))
    if json_path is not None:
        doc = {"schema": DIFF_SCHEMA, "before": str(before), "after": str(after),
               "tables": {name: table_records(table) for name, table in tables.items()}}
        _write(json_path, lambda p: write_json(p, doc, indent=1))


def _report_of(path: Path):
    from infertrace.analyze.capture import CaptureError, load_capture
    from infertrace.analyze.persist import ReportError, is_report_file, read_json
    from infertrace.analyze.report import build_report

    if is_report_file(path):
        try:
            return read_json(path)
        except ReportError as exc:
            fail(str(exc), code=BAD_INPUT)
    try:
        capture = load_capture(path)
    except CaptureError as exc:
        fail(str(exc), code=BAD_INPUT)
    for problem in capture.problems:
        err_console.print(f"[yellow]warning:[/] {path}: {problem}", highlight=False, soft_wrap=True)
    return build_report(capture)


def _show(doc: dict, run_notes: list[str], quiet: bool) -> None:
    """A report's warnings and notes (with this run's) on stderr and, unless `quiet`, its tables on stdout."""
    from infertrace.analyze.render import render_document

    for problem in doc["problems"]:
        err_console.print(f"[yellow]warning:[/] {problem}", highlight=False, soft_wrap=True)
    for note in [*doc["notes"], *run_notes]:
        err_console.print(f"[dim]note: {note}[/]", highlight=False, soft_wrap=True)
    if not quiet:
        out_console.print(render_document(doc, fit=out_console.is_terminal))


def _write_outputs(report, csv_dir: Path | None, html_path: Path | None, perfetto_path: Path | None,
                   cache: Path | None) -> None:
    from infertrace.analyze.persist import write_csv

    if csv_dir is not None:
        _write(csv_dir, lambda p: write_csv(report, p))
    if html_path is not None:
        from infertrace.analyze.html import write_html  # plotly, a fifth of a second: only for the page

        _write(html_path, lambda p: write_html(report, p))
    if perfetto_path is not None:
        from infertrace.analyze.perfetto import write_perfetto

        _write(perfetto_path, lambda p: write_perfetto(report, p, cache))


def import_pandas_without_pyarrow() -> None:
    """Import pandas with pyarrow hidden from it, then make pyarrow importable again. pandas 3 imports pyarrow
    as it is itself imported, wherever pyarrow is installed, and backs its string columns with it: about 55 MB more
    resident in a cached run and 95 MB more without the cache (523 MB rank, 2-core host), for nothing the analyses
    use; without it they run on pandas' own string arrays, as where pyarrow is absent. Nothing is done where
    pandas or pyarrow is already imported (a process that goes on, a test run)."""
    import sys

    if "pandas" in sys.modules or "pyarrow" in sys.modules:
        return
    sys.modules["pyarrow"] = None  # an import of it raises ImportError (the import system's documented block)
    try:
        import pandas  # noqa: F401
    finally:
        if "pyarrow" in sys.modules and sys.modules["pyarrow"] is None:
            del sys.modules["pyarrow"]


def _skip_last_collection() -> None:
    """At exit, move every object left to the collector's permanent generation, so that the interpreter's last
    collection does not walk them all (0.08-0.1 s after a 500 MB rank, pandas and the analyses' objects): they are
    freed at exit anyway. Done at exit, not now, so a process that goes on (a test run) collects as usual."""
    global _EXIT_FREEZE
    if not _EXIT_FREEZE:
        import atexit
        import gc

        atexit.register(gc.freeze)
        _EXIT_FREEZE = True


_EXIT_FREEZE = False


def _write(path: Path, writer) -> None:
    writing(path, None, writer)
    err_console.print(f"wrote {path}", highlight=False)
