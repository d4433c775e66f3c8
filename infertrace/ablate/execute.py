"""What `infertrace ablate` does once its options are parsed: load the recipe, run, render, persist.

Returns the exit code; unusable input becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import types
from dataclasses import dataclass, field
from pathlib import Path

from rich.markup import escape

from infertrace.ablate.recipe import PlannedPhase, Recipe, RecipeError, load_recipe
from infertrace.console import err_console, fail, out_console
from infertrace.exits import BAD_INPUT
from infertrace.exits import FAILURE as EXIT_PHASE_FAILED
from infertrace.exits import INTERRUPTED as EXIT_INTERRUPTED
from infertrace.output import OutputError, check_writable


@dataclass(slots=True)
class AblateOptions:
    recipe: Path
    profile: bool | None = None
    profile_steps: int | None = None
    json_path: Path | None = None
    plot_path: Path | None = None
    trace_dir: Path | None = None
    model: str | None = None
    preset: str | None = None
    quick: bool = False
    engine: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)


def _info(message: str) -> None:
    err_console.print(f"[dim]{message}[/]", highlight=False)


def prepare(options: AblateOptions) -> Recipe:
    try:
        return load_recipe(options.recipe).with_changes(
            model=options.model, preset=options.preset, quick=options.quick, workload=options.workload,
            engine=options.engine, profile=options.profile, profile_steps=options.profile_steps)
    except RecipeError as exc:
        fail(str(exc), BAD_INPUT)


def check_recipe(options: AblateOptions) -> int:
    """--check: the recipe and every phase's overrides; the first problem is the one line printed."""
    from infertrace.ablate.models import check_model_dir
    from infertrace.ablate.recipe import check_dataset

    recipe = prepare(options)
    planned = recipe.plan()
    problems = [p.error for p in planned if p.error]
    if problems:
        fail(problems[0] + (f" (and {len(problems) - 1} more phase(s) with problems)" if len(problems) > 1 else ""))
    try:
        if recipe.model is not None:
            check_model_dir(recipe)
        check_dataset(recipe)
        planned = plan_here(recipe)
    except RecipeError as exc:
        fail(str(exc), BAD_INPUT)
    skipped = sum(p.not_applicable is not None for p in planned)
    out_console.print(f"{recipe.path}: usable, {len(planned)} phase(s)"
                      + (f", {skipped} of them not applicable here (not run)" if skipped else ""), highlight=False)
    return 0


def plan_here(recipe: Recipe) -> list[PlannedPhase]:
    """The recipe's phases as this machine can run them, a note on stderr for each that it cannot. RecipeError when
    no phase can run here, or when one's weights and KV cache alone take more memory than the machine has (a run
    would be killed for memory, losing every phase)."""
    from infertrace.ablate.device import Machine, mark_not_applicable, model_shapes, too_big

    machine = Machine.here()
    planned = mark_not_applicable(recipe.plan(), machine)
    skipped = [p for p in planned if p.not_applicable is not None]
    if skipped and all(p.not_applicable is not None or p.error is not None for p in planned):
        first = skipped[0]
        more = f" (and {len(skipped) - 1} more phase(s))" if len(skipped) > 1 else ""
        raise RecipeError(f"{recipe.path}: no phase can run on this machine: phase {first.index + 1} "
                          f"{first.name!r} is not applicable {first.not_applicable}{more}")
    big = too_big([p for p in planned if p.not_applicable is None], model_shapes(recipe), machine)
    if big is not None:
        phase, need = big
        raise RecipeError(f"{recipe.path}: phase {phase.index + 1} {phase.name!r} {need.describe()}; give it a "
                          "smaller model or KV cache (kv_cache_tokens, cpu_kv_cache_gb)")
    for phase in skipped:
        err_console.print(f"[yellow]note:[/] phase {phase.index + 1} {escape(repr(phase.name))} will not run, not "
                          f"applicable {escape(phase.not_applicable)}", highlight=False, soft_wrap=True)
    return planned


def execute(options: AblateOptions) -> int:
    from infertrace.ablate.models import recipe_model_dir
    from infertrace.ablate.persist import ablation_document, write_json
    from infertrace.ablate.render import table_notes, waterfall_table
    from infertrace.ablate.waterfall import waterfall

    recipe = prepare(options)
    try:
        planned = plan_here(recipe)
    except RecipeError as exc:
        fail(str(exc), BAD_INPUT)
    for phase in planned:
        if phase.error:
            err_console.print(f"[yellow]warning:[/] phase {phase.index + 1} {phase.name!r} will fail: {phase.error}",
                              highlight=False, soft_wrap=True)
    for path in (options.json_path, options.plot_path):
        if path is not None:
            _check_writable(path)
    try:
        model_dir = recipe_model_dir(recipe, lambda out: _info(f"writing the {recipe.preset} model into {out} "
                                                                "(first use only)"))
    except RecipeError as exc:
        fail(str(exc), BAD_INPUT)
    except OSError as exc:
        fail(f"cannot write the {recipe.preset} model: {exc}", BAD_INPUT)
    trace_root = None
    if recipe.profile.enabled:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        trace_root = options.trace_dir or Path("ablate-traces") / f"{recipe.path.stem}-{stamp}"

    results = []

    def save() -> None:
        if options.json_path is not None:
            write_json(options.json_path, ablation_document(recipe, model_dir, results, len(planned),
                                                            _provenance(recipe, model_dir)))

    def on_phase_done(result) -> None:
        results.append(result)
        save()

    crashed = None
    try:
        asyncio.run(_run(recipe, planned, model_dir, trace_root, on_phase_done))
    except KeyboardInterrupt:  # a second Ctrl-C: the phases done so far still count
        err_console.print("[yellow]interrupted[/]")
    except Exception as exc:  # noqa: BLE001 - whatever broke, the phases already measured are shown and kept
        crashed = exc
    subtitle = f"{_model_label(recipe, model_dir)}, {_load_label(recipe)}"
    rows = waterfall(results)
    out_console.print(waterfall_table(f"infertrace ablate: {recipe.name}\n{subtitle}", rows))
    for note in table_notes(rows, recipe.profile.enabled):
        err_console.print(f"[dim]note: {note}[/]", highlight=False)
    if trace_root is not None and any(r.trace_dir for r in results):
        _info(f"traces: {trace_root} (infertrace analyze DIR for the full breakdowns)")
    if options.json_path is not None:
        save()
        _info(f"result: {options.json_path}")
    if options.plot_path is not None and rows:
        from infertrace.ablate.plot import plot_waterfall

        _info(f"plot: {plot_waterfall(recipe.name, rows, options.plot_path, subtitle)}")
    if crashed is not None:
        fail(f"the run stopped: {type(crashed).__name__}: {crashed}; the phases above were kept", EXIT_PHASE_FAILED)
    from infertrace.ablate.run import PhaseStatus

    if len(results) < len(planned) or any(r.status in (PhaseStatus.INTERRUPTED, PhaseStatus.NOT_RUN)
                                          for r in results):
        return EXIT_INTERRUPTED
    return EXIT_PHASE_FAILED if any(r.status is PhaseStatus.FAILED for r in results) else 0


async def _run(recipe: Recipe, planned: list[PlannedPhase], model_dir: Path, trace_root: Path | None,
               on_phase_done) -> None:
    from infertrace.ablate.render import PhaseProgress
    from infertrace.ablate.run import AblationHooks, run_ablation
    from infertrace.load.benchmark import Hooks, Interrupter

    interrupter = Interrupter()

    def announce() -> None:
        err_console.print("[yellow]interrupted: finishing the phase's figures and saving what ran (Ctrl-C again "
                          "to stop now)[/]")

    with interrupter.on_sigint(announce), PhaseProgress(err_console, len(planned)) as progress:
        def done(result) -> None:
            progress.on_phase_done(result)
            on_phase_done(result)

        hooks = AblationHooks(progress.on_phase_start, done,
                              Hooks(progress.on_stage, progress.on_result, progress.on_info))
        await run_ablation(recipe, model_dir, interrupter, hooks, trace_root, planned)


def _check_writable(path: Path) -> None:
    """Output files are checked before the first phase: a run must not end with nowhere to put its result."""
    try:
        check_writable(path)
    except OutputError as exc:
        fail(str(exc), BAD_INPUT)


def _model_label(recipe: Recipe, model_dir: Path) -> str:
    return f"preset {recipe.preset}" if recipe.model is None else str(model_dir)


def _load_label(recipe: Recipe) -> str:
    cfg = recipe.bench_config()
    if cfg.dataset == "trace":  # an open loop on the trace's own times, of the trace's own lengths
        return (f"trace replay of {Path(cfg.dataset_path).name}, its first {cfg.num_prompts} requests at most "
                f"(time x{cfg.time_scale:g}, tokens x{cfg.token_scale:g})")
    shape = f"{cfg.request_rate:g} req/s" if cfg.open_loop else f"concurrency {cfg.effective_concurrency}"
    return (f"{shape}, {cfg.num_prompts} x {cfg.input_len} -> {cfg.effective_output_len} tokens"
            + (f", {cfg.dataset}" if cfg.dataset != "random" else ""))


def _provenance(recipe: Recipe, model_dir: Path) -> dict:
    from infertrace.load.results.result import provenance

    target = types.SimpleNamespace(describe=lambda: {"kind": "embedded", "model_dir": str(model_dir)})
    return provenance(target, recipe.bench_config().seed)
