"""In-process capture of the bundled engine with torch.profiler (and cudaProfilerStart/Stop for nsys).

torch.profiler records the operators of the thread that started it only, so `start()` and `stop()` must
run on the thread that runs the engine steps: with `AsyncEngine`, `await aeng.call(session.start)`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from infertrace.capture.manifest import CaptureManifest, StepRecord, device_info, runtime_versions
from infertrace.capture.nsys import NSYS_OUTPUT_ENV
from infertrace.engine.rank_profiler import TRACE_SUFFIX
from infertrace.output import check_writable_dir

ACTIVITIES = ("CPU", "GPU", "MEM", "CUDA_PROFILER")
MANIFEST_SUFFIX = ".manifest.json"
# What Kineto's C++ side prints on stderr at a profiler's start and stop that says nothing wrong (torch 2.13):
# USDT probe markers and stage notes from SyncActivityProfilerHandler.cpp, and a thread check that fires when the
# profiler first starts on another thread than the one that imported torch, which is where the server's engine
# thread and ablate's run start it. These lines leaked into ablate's output and the server log.
KINETO_CHATTER = re.compile(
    rb"^(USDT:|STAGE:|ERROR: External init callback must run in same thread as registerClient \(-?\d+ != -?\d+\))")


@contextlib.contextmanager
def kineto_chatter_filtered():
    """Run the block with file descriptor 2 sent to a temporary file, then write back to stderr every line but
    Kineto's chatter (KINETO_CHATTER). C++ output can only be caught at the descriptor; anything else printed
    meanwhile, by any thread, still reaches stderr whole, after the block."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True) if not KINETO_CHATTER.match(line)]
            if kept:
                os.write(2, b"".join(kept))


class CaptureSession:
    """One capture window over engine steps: `start()`, `on_step()` after each step, `stop()`.

    With `engine` running on several tensor-parallel ranks, every rank records its own trace (the engine's
    start_profile/stop_profile), named `{label}.{ns}.rank{r}.pt.trace.json.gz` and tagged with distributedInfo."""

    def __init__(self, out_dir: Path, activities=("CPU", "GPU"), record_shapes: bool = False,
                 with_stack: bool = False, num_steps: int | None = None, label: str = "infertrace", engine=None):
        activities = tuple(a.upper() for a in activities)
        unknown = [a for a in activities if a not in ACTIVITIES]
        if unknown:
            raise ValueError(f"unknown capture activity {unknown[0]!r}; choose from {', '.join(ACTIVITIES)}")
        if not activities:
            raise ValueError("no capture activity given; choose from " + ", ".join(ACTIVITIES))
        if num_steps is not None and num_steps < 1:
            raise ValueError(f"num_steps must be at least 1, got {num_steps}")
        if not label or "/" in label or os.sep in label:
            raise ValueError(f"label {label!r} must be a plain file-name prefix")
        self.out_dir = Path(out_dir)
        self.activities_requested = activities
        self.record_shapes = record_shapes
        self.with_stack = with_stack
        self.num_steps = num_steps
        self.label = label
        self.engine = engine if getattr(engine, "other_ranks", None) is not None else None  # only when TP > 1
        self._profiler = None
        self._cuda_profiler = False
        self._active = False
        self._notes: list[str] = []
        self._activities: list[str] = []
        self._steps: list[StepRecord] = []
        self._request_ids: dict[str, None] = {}  # insertion-ordered set
        self._start_ns = 0
        self._start_perf = 0.0
        self._nsys_output: str | None = None

    @property
    def active(self) -> bool:
        return self._active

    def start(self) -> None:
        """Open the window. ValueError when the output directory cannot be written."""
        if self._active:
            raise RuntimeError("a capture is already in progress")
        check_writable_dir(self.out_dir, "traces to")
        import torch

        activities = self._effective_activities(torch.cuda.is_available())
        self._steps, self._request_ids = [], {}
        profiler_activities = []
        if "CPU" in activities:
            profiler_activities.append(torch.profiler.ProfilerActivity.CPU)
        if "GPU" in activities:
            profiler_activities.append(torch.profiler.ProfilerActivity.CUDA)
        if profiler_activities and self.engine is not None:
            self._start_ns = time.time_ns()
            kineto = tuple(a for a in activities if a in ("CPU", "GPU"))
            with kineto_chatter_filtered():
                self.engine.start_profile(self.out_dir, kineto, self.record_shapes, self.with_stack,
                                          stem=f"{self.label}.{self._start_ns}")
            self._profiler = self.engine
            if "MEM" in activities:
                self._notes.append("MEM is not recorded on tensor-parallel ranks")
        elif profiler_activities:
            self._profiler = torch.profiler.profile(
                activities=profiler_activities, record_shapes=self.record_shapes,
                with_stack=self.with_stack, profile_memory="MEM" in activities)
            with kineto_chatter_filtered():
                self._profiler.start()
        if "CUDA_PROFILER" in activities:
            try:
                torch.cuda.profiler.start()  # cudaProfilerStart: opens nsys's cudaProfilerApi capture range
            except Exception:
                if self._profiler is not None:
                    self._profiler.stop()
                    self._profiler = None
                raise
            self._cuda_profiler = True
        # the window opens once the profiler is running (its first start takes about a second)
        self._start_ns = self._start_ns if self._profiler is self.engine and self.engine else time.time_ns()
        self._start_perf = time.perf_counter()
        self._activities = activities
        self._active = True

    def on_step(self, step_stats=None, request_ids=None) -> bool:
        """Record one finished engine step; True once `num_steps` steps were seen in the window."""
        if not self._active:
            return False
        if step_stats is not None:
            self._steps.append(_step_record(step_stats))
            request_ids = request_ids or _field(step_stats, "request_ids")
        else:
            self._steps.append(StepRecord(len(self._steps), None, None, None, None))
        for rid in request_ids or ():
            self._request_ids[str(rid)] = None
        return self.num_steps is not None and len(self._steps) >= self.num_steps

    def add_request_ids(self, request_ids) -> None:
        """Note requests that ran inside the window (for callers whose step record has no ids)."""
        if self._active:
            for rid in request_ids:
                self._request_ids[str(rid)] = None

    def stop(self) -> list[Path]:
        """Close the window; write the trace and its manifest; return their paths (trace first)."""
        if not self._active:
            raise RuntimeError("no capture in progress")
        import torch

        self._active = False
        stem = f"{self.label}.{self._start_ns}"
        paths: list[Path] = []
        try:
            if "GPU" in self._activities or self._cuda_profiler:
                torch.cuda.synchronize()  # kernels still in flight would be missing from the trace
            if self._cuda_profiler:
                torch.cuda.profiler.stop()
            if self._profiler is self.engine and self.engine is not None:
                with kineto_chatter_filtered():
                    paths.extend(Path(p) for p in self.engine.stop_profile())  # one trace per rank, rank order
            elif self._profiler is not None:
                with kineto_chatter_filtered():
                    self._profiler.stop()
            stopped_ns, duration_s = time.time_ns(), time.perf_counter() - self._start_perf
            if self._profiler is not None and self._profiler is not self.engine:
                trace = self.out_dir / f"{stem}{TRACE_SUFFIX}"
                self._profiler.export_chrome_trace(str(trace))  # a .gz name makes torch gzip it
                paths.append(trace)
        finally:
            self._profiler = None
            self._cuda_profiler = False
        manifest = CaptureManifest(
            label=self.label,
            trace=paths[0].name if paths else None,
            traces=[p.name for p in paths],
            activities_requested=list(self.activities_requested),
            activities=list(self._activities),
            record_shapes=self.record_shapes,
            with_stack=self.with_stack,
            num_steps=self.num_steps,
            started_at=_iso(self._start_ns),
            stopped_at=_iso(stopped_ns),
            duration_s=round(duration_s, 6),
            steps=self._steps,
            request_ids=list(self._request_ids),
            notes=self._notes,
            nsys_output=self._nsys_output,
            versions=runtime_versions(),
            device=device_info(),
        )
        paths.append(manifest.write(self.out_dir / f"{stem}{MANIFEST_SUFFIX}"))
        return paths

    def _effective_activities(self, has_cuda: bool) -> list[str]:
        self._notes = []
        self._nsys_output = os.environ.get(NSYS_OUTPUT_ENV) or None
        requested = list(self.activities_requested)
        if self._nsys_output:
            # Kineto and nsys both subscribe to CUPTI; under nsys only the capture range is opened.
            self._notes.append(f"running under nsys ({self._nsys_output}): torch.profiler activities "
                               "replaced by CUDA_PROFILER")
            requested = ["CUDA_PROFILER"]
        if not has_cuda:
            if "CUDA_PROFILER" in requested:
                raise ValueError("the CUDA_PROFILER activity needs a CUDA device and none is available")
            if "GPU" in requested:
                self._notes.append("GPU activity requested but CUDA is not available: CPU only")
                requested.remove("GPU")
        if not any(a in requested for a in ("CPU", "GPU", "CUDA_PROFILER")):
            requested.insert(0, "CPU")  # MEM alone is a modifier of the CPU/GPU profiler
        return requested


def _field(stats, *names):
    for name in names:
        value = stats.get(name) if isinstance(stats, dict) else getattr(stats, name, None)
        if value is not None:
            return value
    return None


def _step_record(stats) -> StepRecord:
    kind = _field(stats, "kind")
    kind = getattr(kind, "value", kind)  # an enum or a plain string
    duration_s = _field(stats, "duration_s")
    return StepRecord(
        index=_field(stats, "index"),
        kind=None if kind is None else str(kind).lower(),
        bs=_field(stats, "batch_size", "bs"),
        toks=_field(stats, "num_tokens", "toks"),
        duration_ms=None if duration_s is None else round(duration_s * 1e3, 3),
    )


def _iso(time_ns: int) -> str:
    return dt.datetime.fromtimestamp(time_ns / 1e9, tz=dt.timezone.utc).isoformat(timespec="microseconds")
