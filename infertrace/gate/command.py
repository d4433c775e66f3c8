"""The `infertrace gate` command: check benchmark results against a baseline and exit 0, 1 or 2 for CI."""

from __future__ import annotations

from pathlib import Path

import click

from infertrace.console import err_console, fail, out_console
from infertrace.exits import BAD_INPUT, FAILURE
from infertrace.gate.bounds import Bound, Kind, higher_is_better, parse_bounds
from infertrace.gate.check import MAX_RESAMPLES, MIN_RESAMPLES, GateConfig, evaluate
from infertrace.gate.render import failure_markdown, markdown, table
from infertrace.gate.results import (
    ResultError,
    Run,
    config_differences,
    hardware_differences,
    load_runs,
    write_baseline,
)
from infertrace.output import OutputError, check_writable

DEFAULTS = GateConfig()


def _bounds_of(kind: Kind):
    def callback(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[Bound]:
        try:
            return parse_bounds(kind, value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None

    return callback


@click.command(name="gate")
@click.argument("results", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--baseline", type=click.Path(path_type=Path),
              help="Baseline: a result file, or a baseline written by --update-baseline (may hold several runs).")
@click.option("--max-drop", "max_drop", multiple=True, metavar="METRIC=LIMIT", callback=_bounds_of(Kind.MAX_DROP),
              help="Fail when METRIC falls more than LIMIT below the baseline: N% or an absolute N[unit].")
@click.option("--max-rise", "max_rise", multiple=True, metavar="METRIC=LIMIT", callback=_bounds_of(Kind.MAX_RISE),
              help="Fail when METRIC rises more than LIMIT above the baseline: N% or an absolute +N[unit].")
@click.option("--min", "floor", multiple=True, metavar="METRIC=VALUE", callback=_bounds_of(Kind.MIN),
              help="Fail when METRIC is below VALUE (no baseline needed).")
@click.option("--max", "ceiling", multiple=True, metavar="METRIC=VALUE", callback=_bounds_of(Kind.MAX),
              help="Fail when METRIC is above VALUE (no baseline needed).")
@click.option("--confidence", type=float, default=DEFAULTS.confidence, show_default=True,
              help="Confidence level of the bootstrap interval over repeated runs.")
@click.option("--resamples", type=click.IntRange(MIN_RESAMPLES, MAX_RESAMPLES), default=DEFAULTS.resamples,
              show_default=True, help=f"Bootstrap resamples ({MIN_RESAMPLES:,} to {MAX_RESAMPLES:,}).")
@click.option("--seed", type=int, default=DEFAULTS.seed, show_default=True,
              help="Seed of the bootstrap, so that the same files always give the same verdict.")
@click.option("--allow-config-change", is_flag=True,
              help="Compare results whose model or workload differ (the differences are printed as warnings).")
@click.option("--ignore-config", multiple=True, metavar="KEY",
              help="A configuration key (dotted, e.g. seed or target.base_url) that may differ; repeatable.")
@click.option("--summary", type=click.Path(path_type=Path), metavar="PATH",
              help="Append the verdict as Markdown to PATH (e.g. $GITHUB_STEP_SUMMARY).")
@click.option("--update-baseline", is_flag=True,
              help="Write RESULTS as the new --baseline instead of checking them, and exit 0.")
def gate(
    results: tuple[Path, ...],
    baseline: Path | None,
    max_drop: list[Bound],
    max_rise: list[Bound],
    floor: list[Bound],
    ceiling: list[Bound],
    confidence: float,
    resamples: int,
    seed: int,
    allow_config_change: bool,
    ignore_config: tuple[str, ...],
    summary: Path | None,
    update_baseline: bool,
) -> None:
    """Gate benchmark RESULTS against a baseline: exit 0 within bounds, 1 on a regression, 2 on unusable input.

    RESULTS are `infertrace bench --result-json` files (`vllm bench serve --save-result` files work too).
    Give several repeats of one run: the gate compares their median with the baseline's and draws a bootstrap
    interval around the change; a bound fails only when the whole interval lies beyond it ("regression"). A
    median past the bound whose interval still reaches back inside is reported "within noise" and passes.

    \b
    Bounds (repeat an option, or join METRIC=LIMIT pairs with commas):
      --max-drop output_throughput=5%        at most 5% below the baseline
      --max-drop output_throughput=20tok/s   at most 20 tok/s below the baseline
      --max-rise p99_ttft_ms=10%             at most 10% above the baseline
      --max-rise p99_ttft_ms=+20ms           at most 20 ms above the baseline (also s, us)
      --min output_throughput=100            at least 100, whatever the baseline
      --max failed=0                         at most 0

    METRIC is any numeric top-level key of a result: output_throughput, median_tpot_ms, p99_e2el_ms, ...
    A unit, where given, must fit the metric. cpu_ms_per_output_token (CPU time of the benchmark process per
    output token, derived from an infertrace result of the bundled engine in-process; refused for a --base-url
    result, where it would be the load generator's CPU) is the figure to gate on a shared CPU machine, where
    wall-clock figures move too much from run to run.

    Results from another model or workload than the baseline's are refused (exit 2) unless
    --allow-config-change. Record a baseline with `--update-baseline --baseline BASE.json`.
    """
    bounds = [*max_drop, *max_rise, *floor, *ceiling]
    _check_outputs(summary, baseline if update_baseline else None)
    try:
        current = _load_all(results)
        _require_same_config(current, current, allow_config_change, ignore_config)
        if update_baseline:
            _write_baseline(current, bounds, baseline)
            return
        if not bounds:
            raise click.UsageError("no bounds given: add --max-drop, --max-rise, --min or --max")
        before = _load_baseline(baseline, bounds)
        if before:
            _require_same_config(before, before, allow_config_change, ignore_config)
            _require_same_config(before, current, allow_config_change, ignore_config)
            for line in hardware_differences(before, current)[:1]:
                _warn(f"the baseline ran on other hardware ({line}): a change may not be the code's")
        _warn_about(current, bounds)
        config = GateConfig(confidence, resamples, seed)
        report = evaluate(current, before, bounds, config)
    except (ResultError, ValueError) as exc:
        if summary is not None:
            _append(summary, failure_markdown(str(exc)))
        fail(str(exc), code=BAD_INPUT)
    out_console.print(table(report))
    if summary is not None:
        _append(summary, markdown(report))
    if report.regressed:
        raise SystemExit(FAILURE)


def _check_outputs(summary: Path | None, new_baseline: Path | None) -> None:
    """Output paths are tried before any work, so that a verdict never ends with nowhere to go (exit 2)."""
    if summary is not None:
        try:
            check_writable(summary, "the summary")  # its folder made, as every output's is
            with summary.open("a"):  # appending nothing leaves an existing summary as it was
                pass
        except OutputError as exc:
            fail(str(exc), code=BAD_INPUT)
        except OSError as exc:
            fail(f"cannot write the summary {summary}: {exc.strerror or exc}", code=BAD_INPUT)
    if new_baseline is not None:
        try:
            check_writable(new_baseline, "the baseline")
        except OutputError as exc:
            fail(str(exc), code=BAD_INPUT)


def _load_all(paths: tuple[Path, ...]) -> list[Run]:
    return [run for path in paths for run in load_runs(path)]


def _load_baseline(baseline: Path | None, bounds: list[Bound]) -> list[Run]:
    if baseline is not None:
        return load_runs(baseline)
    needing = sorted({bound.metric for bound in bounds if bound.needs_baseline})
    if needing:
        raise click.UsageError(f"--max-drop/--max-rise on {', '.join(needing)} need --baseline")
    return []


def _require_same_config(runs: list[Run], others: list[Run], allow: bool, ignore: tuple[str, ...]) -> None:
    differences = config_differences(runs, others, ignore)
    if not differences:
        return
    if not allow:
        raise ResultError(
            f"results come from a different model or workload ({differences[0]}"
            + (f"; and {len(differences) - 1} more" if len(differences) > 1 else "")
            + "): pass --allow-config-change to compare them anyway"
        )
    for line in differences:
        _warn(f"configuration differs: {line}")


def _write_baseline(runs: list[Run], bounds: list[Bound], baseline: Path | None) -> None:
    if baseline is None:
        raise click.UsageError("--update-baseline needs --baseline PATH to write")
    for bound in bounds:  # a baseline the next gate cannot use is caught now, not in the next build
        for run in runs:
            run.metric(bound.metric)
    try:
        write_baseline(runs, baseline)
    except OSError as exc:
        fail(f"cannot write the baseline {baseline}: {exc.strerror or exc}", code=BAD_INPUT)
    err_console.print(f"wrote a baseline of {len(runs)} run{'s' if len(runs) != 1 else ''} to {baseline}")


def _warn_about(current: list[Run], bounds: list[Bound]) -> None:
    for bound in bounds:
        better_higher = higher_is_better(bound.metric)
        if bound.kind is Kind.MAX_DROP and better_higher is False:
            _warn(f"--max-drop on {bound.metric}, which is better when lower: did you mean --max-rise?")
        if bound.kind is Kind.MAX_RISE and better_higher is True:
            _warn(f"--max-rise on {bound.metric}, which is better when higher: did you mean --max-drop?")
    for run in current:
        failed = run.data.get("failed")
        if isinstance(failed, int) and failed > 0:
            _warn(f"{run.source}: {failed} failed requests")
    if len(current) == 1:
        _warn("one run only: no interval to tell noise from a regression; pass repeated runs")


def _warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


def _append(path: Path, text: str) -> None:
    try:
        with path.open("a") as out:
            out.write(text + "\n")
    except OSError as exc:
        fail(f"cannot write the summary {path}: {exc.strerror or exc}", code=BAD_INPUT)
