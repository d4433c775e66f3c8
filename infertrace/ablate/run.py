"""Runs a recipe's phases one after another, each on a fresh engine with the same workload.

A phase is measured by the load generator's own run (warmup, then the measured requests); with profiling on, a
second, shorter load follows on the same engine with a torch.profiler capture over a window of engine steps, so
the profiler never perturbs the measured figures. A phase that fails is kept as a result with its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from infertrace.ablate.profile import ProfileFigures, analyze_profile
from infertrace.ablate.recipe import PlannedPhase, ProfileSpec, Recipe
from infertrace.load.benchmark import (
    Hooks,
    Interrupted,
    Interrupter,
    run_point,
)
from infertrace.load.clock import MonotonicClock
from infertrace.load.results.point import PointRecord
from infertrace.load.run.runner import Runner
from infertrace.load.workloads.prompts import build_specs


class PhaseStatus(str, Enum):
    OK = "ok"
    FAILED = "failed"
    INTERRUPTED = "interrupted"  # cut short by Ctrl-C: its figures cover the requests that finished
    NOT_RUN = "not run"  # the run was interrupted before this phase started
    NOT_APPLICABLE = "not applicable"  # it cannot be measured on this machine (its error says why): not run


@dataclass(slots=True)
class PhaseResult:
    index: int
    name: str
    overrides: dict  # this phase's own
    config: dict  # the engine overrides it ran with
    status: PhaseStatus
    error: str | None = None  # why it failed (or was cut short)
    note: str | None = None  # what is worth knowing about a phase that did run (some requests failed)
    record: PointRecord | None = None
    engine_config: dict | None = None  # every field of the engine config, as the engine had it
    profile: ProfileFigures | None = None
    profile_error: str | None = None
    trace_dir: str | None = None
    seconds: float = 0.0
    tuning: dict = dataclasses.field(default_factory=dict)  # the kernel rules it ran with
    # speculative decoding over the measured load (warm-up included): the engine's drafts, draft tokens and
    # accepted tokens (SPEC_COUNTERS); None when the phase drafted nothing
    spec_decode: dict | None = None

    @property
    def output_throughput(self) -> float | None:
        if self.record is None or not self.record.metrics.completed:
            return None
        return self.record.metrics.output_throughput


@dataclass(slots=True)
class AblationHooks:
    """What the command layer shows, and saves, while the phases run."""

    on_phase_start: Callable[[PlannedPhase], None] = lambda phase: None
    on_phase_done: Callable[[PhaseResult], None] = lambda result: None
    load: Hooks = dataclasses.field(default_factory=Hooks)


async def run_ablation(recipe: Recipe, model_dir: Path, interrupter: Interrupter, hooks: AblationHooks,
                       trace_root: Path | None = None, planned: list[PlannedPhase] | None = None) -> list[PhaseResult]:
    """Every phase in order (`planned`, default the recipe's plan); once interrupted, the phases left are recorded
    as not run, and a phase not applicable on this machine is recorded without running."""
    cfg = recipe.bench_config()
    results = []
    for phase in planned if planned is not None else recipe.plan():
        if phase.not_applicable is not None:
            result = PhaseResult(phase.index, phase.name, phase.overrides, phase.config, PhaseStatus.NOT_APPLICABLE,
                                 error=phase.not_applicable, tuning=phase.tuning)
        elif interrupter.requested:
            result = PhaseResult(phase.index, phase.name, phase.overrides, phase.config, PhaseStatus.NOT_RUN,
                                 error="the run was interrupted before this phase", tuning=phase.tuning)
        else:
            hooks.on_phase_start(phase)
            trace_dir = trace_root / phase_dir_name(phase) if trace_root is not None else None
            result = await run_phase(phase, cfg, model_dir, recipe.profile, interrupter, hooks.load, trace_dir)
        results.append(result)
        hooks.on_phase_done(result)
    return results


def phase_dir_name(phase: PlannedPhase) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", phase.name.lower()).strip("-") or "phase"
    return f"{phase.index + 1:02d}-{slug}"


async def run_phase(phase: PlannedPhase, cfg, model_dir: Path, profile: ProfileSpec, interrupter: Interrupter,
                    hooks: Hooks, trace_dir: Path | None = None) -> PhaseResult:
    """One phase on its own engine: open, measure, optionally capture, close, then analyze the capture."""
    from infertrace.load.client.embedded_target import EmbeddedTarget

    result = PhaseResult(phase.index, phase.name, phase.overrides, phase.config, PhaseStatus.FAILED,
                         tuning=phase.tuning)
    start = time.perf_counter()
    if phase.error is not None:
        result.error = phase.error
        return result
    target = EmbeddedTarget(model_dir, phase.config, ignore_eos=cfg.ignore_eos, temperature=cfg.temperature)
    captured = False
    rules = contextlib.ExitStack()
    try:
        rules.enter_context(kernel_rules(phase.tuning))
        hooks.on_phase("loading the engine", None, None)
        await target.open()
        result.engine_config = dataclasses.asdict(target.engine.config)
        before = _spec_counters(target.engine)
        record = await run_point(cfg, target, MonotonicClock(), interrupter, hooks)
        result.record = record
        after = _spec_counters(target.engine)
        if after["num_draft_tokens"] > before["num_draft_tokens"]:
            result.spec_decode = {k: after[k] - before[k] for k in SPEC_COUNTERS}
        result.status, result.error, result.note = judge(record)
        if profile.enabled and trace_dir is not None and result.status is PhaseStatus.OK:
            result.trace_dir = str(trace_dir)
            try:
                captured = await capture_phase(target, cfg, profile, trace_dir, interrupter, hooks)
            except Interrupted:
                result.profile_error = "interrupted before the capture finished"
            except Exception as exc:  # noqa: BLE001 - the measured figures stand without their profile
                result.profile_error = one_line(exc)
    except Exception as exc:  # noqa: BLE001 - a bad override, out of memory, an engine fault: the phase fails
        result.status, result.error = PhaseStatus.FAILED, one_line(exc)
    finally:
        await release(target)
        rules.close()
    if captured:
        hooks.on_phase("analyzing the profile", None, None)
        try:
            result.profile = await asyncio.to_thread(analyze_profile, trace_dir)
        except Exception as exc:  # noqa: BLE001 - an unreadable capture costs the phase its profile only
            result.profile_error = one_line(exc)
    result.seconds = time.perf_counter() - start
    return result


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _spec_counters(engine) -> dict[str, int]:
    """The engine's speculative-decoding counters now (read between steps: they are plain ints)."""
    return {k: engine.counters.get(f"spec_decode_{k}", 0) for k in SPEC_COUNTERS}


@contextlib.contextmanager
def kernel_rules(rules: dict):
    """The phase's tuning rules in $INFERTRACE_KERNEL_TUNING while its engine runs, as an experiment sets them (its
    tensor-parallel ranks, started now, read the same environment); the variable as it was afterwards."""
    if not rules:
        yield
        return
    from infertrace.engine.kernels import tuning

    before = os.environ.get(tuning.ENV)
    os.environ[tuning.ENV] = tuning.with_rules(rules)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(tuning.ENV, None)
        else:
            os.environ[tuning.ENV] = before


def judge(record: PointRecord) -> tuple[PhaseStatus, str | None, str | None]:
    """(status, error, note) of a measured phase."""
    m = record.metrics
    total = m.completed + m.failed
    first = next((r.error for r in record.results if r.error), None)
    if record.interrupted:
        return PhaseStatus.INTERRUPTED, f"figures over the {m.completed} request(s) done before Ctrl-C", None
    if m.completed == 0:
        return PhaseStatus.FAILED, first or "no request completed", None
    if m.failed:
        return PhaseStatus.OK, None, f"{m.failed} of {total} requests failed: {first}"
    return PhaseStatus.OK, None, None


DECODE_KINDS = ("decode", "verify")  # a verify step is a decode step with drafts (speculative decoding)


class StepWindow:
    """Opens a capture at the first decode (or verify) step of a full batch and closes it `num_steps` steps later.

    Its methods run on the engine thread (step callbacks and `AsyncEngine.call`), where torch.profiler must be
    started and stopped; an exception here must not reach the engine loop, so it is kept for the caller.
    """

    def __init__(self, session, full_batch: int, on_close: Callable[[], None] = lambda: None) -> None:
        self.session = session
        self.full_batch = full_batch
        self.on_close = on_close  # told once, from the engine thread, when the window has closed
        self.paths: list[Path] = []
        self.error: BaseException | None = None
        self.closed = False

    def on_step(self, stats) -> None:
        if self.closed:
            return
        try:
            if not self.session.active:
                if stats.kind in DECODE_KINDS and stats.batch_size >= self.full_batch:
                    self.session.start()
            elif self.session.on_step(stats):
                self.paths, self.closed = self.session.stop(), True
        except Exception as exc:  # noqa: BLE001 - raised into the engine loop, it would kill the engine
            self.error, self.closed = exc, True
        if self.closed:
            self.on_close()

    def finish(self) -> None:
        """Close a window still open when the load ran out of steps."""
        try:
            if not self.closed and self.session.active:
                self.paths = self.session.stop()
        finally:
            self.closed = True


async def capture_phase(target, cfg, profile: ProfileSpec, trace_dir: Path, interrupter: Interrupter,
                        hooks: Hooks) -> bool:
    """A short load of full batches with a capture of `profile.steps` engine steps; True when a trace was written."""
    from infertrace.capture.torch_capture import CaptureSession

    full = min(cfg.effective_concurrency or cfg.num_prompts, target.engine.config.max_num_seqs)
    decode_steps = max(1, cfg.effective_output_len - 1)  # the first token comes from the prefill
    n = full * (math.ceil((profile.steps + 1) / decode_steps) + 1)
    session = CaptureSession(trace_dir, activities=profile.activities, num_steps=profile.steps, label="ablate",
                             engine=target.engine)
    loop = asyncio.get_running_loop()
    closed = asyncio.Event()
    window = StepWindow(session, full, on_close=lambda: loop.call_soon_threadsafe(closed.set))
    target.aengine.add_step_callback(window.on_step)
    specs = build_specs(cfg, target.tokenizer, n, "profile", 0, target.max_model_len)
    hooks.on_phase(f"profiling {profile.steps} steps", n, None)
    runner = Runner(target, MonotonicClock(), hooks.on_result)
    load = asyncio.ensure_future(runner.closed_loop(specs, full))
    waiter = asyncio.ensure_future(closed.wait())
    try:  # the requests still running when the window closes are of no use: they are cancelled
        await interrupter.run(asyncio.wait({load, waiter}, return_when=asyncio.FIRST_COMPLETED))
    finally:
        for task in (load, waiter):
            task.cancel()
        await asyncio.gather(load, waiter, return_exceptions=True)
        await target.aengine.call(window.finish)
    if window.error is not None:
        raise window.error
    if not window.paths:
        raise RuntimeError(f"no capture: no decode step ran with a full batch of {full}")
    return True


async def release(target) -> None:
    """Shut the engine down and give its memory back before the next phase loads its own."""
    try:
        await target.close()
    except Exception:  # noqa: BLE001, S110 - a dead engine loop has nothing left to shut down
        pass
    target.engine = target.aengine = None
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def one_line(exc: BaseException) -> str:
    """The first line of an error; its type too, unless it is one of the errors written for the user."""
    from infertrace.load.client.timing import TargetError

    text = str(exc).strip().splitlines()
    if text and isinstance(exc, (ValueError, TargetError)):
        return text[0]
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
