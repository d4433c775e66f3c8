"""The /start_profile and /stop_profile endpoints: a torch.profiler capture over engine steps, under --profile-dir.

Capture sessions start, count steps and stop on the engine thread (torch.profiler records the thread that
started it), through `AsyncEngine.call` and the step callback.
"""

from __future__ import annotations

import datetime as dt
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infertrace.server.protocol import ApiError, bad_request

DEFAULT_ACTIVITIES = ("CPU", "GPU")
LABEL = "infertrace-serve"


@dataclass(frozen=True, slots=True)
class ProfileRequest:
    """A start request: empty (vLLM) or SGLang's ProfileReqInput fields; unknown fields are ignored."""

    output_dir: str | None = None
    num_steps: int | None = None
    activities: tuple[str, ...] = DEFAULT_ACTIVITIES
    record_shapes: bool = False
    with_stack: bool = False


def parse_profile_request(body: dict | None) -> ProfileRequest:
    body = body or {}
    output_dir = body.get("output_dir")
    if output_dir is not None and (not isinstance(output_dir, str) or not output_dir):
        raise bad_request("output_dir must be a non-empty string", "output_dir")
    num_steps = body.get("num_steps")
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
        raise bad_request(f"num_steps must be a positive integer, got {num_steps!r}", "num_steps")
    activities = body.get("activities")
    if activities is None:
        activities = DEFAULT_ACTIVITIES
    elif not (isinstance(activities, list) and activities and all(isinstance(a, str) for a in activities)):
        raise bad_request("activities must be a non-empty list such as [\"CPU\", \"GPU\"]", "activities")
    flags = {}
    for name in ("record_shapes", "with_stack"):
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"{name} must be a boolean", name)
        flags[name] = bool(value)
    return ProfileRequest(output_dir=output_dir, num_steps=num_steps,
                          activities=tuple(a.upper() for a in activities), **flags)


def resolve_output_dir(profile_dir: Path, output_dir: str | None) -> Path:
    """Where a capture writes: `output_dir` (relative to `profile_dir`, or absolute inside it) or a fresh
    timestamped folder. Paths that leave `profile_dir`, through `..` or a symlink, are refused with 400."""
    root = profile_dir.resolve()
    if output_dir is None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        return root / f"capture-{stamp}"
    target = (root / output_dir).resolve()  # an absolute output_dir replaces root; resolve() follows symlinks
    if not target.is_relative_to(root):
        raise bad_request(f"output_dir {output_dir!r} is outside the server's profile directory {root}",
                          "output_dir", code="output_dir_outside_profile_dir")
    return target


class Profiler:
    """At most one capture at a time. Files of a capture that stopped by itself after `num_steps` are handed
    out by the next /stop_profile."""

    def __init__(self, aeng: Any, profile_dir: Path | None) -> None:
        self.aeng = aeng
        self.profile_dir = profile_dir
        self._lock = threading.Lock()  # the session is touched by the engine thread and the event loop
        self._session: Any = None
        self._out_dir: Path | None = None
        self._finished: dict | None = None  # the result of a capture that stopped by itself

    def _require_enabled(self) -> Path:
        if self.profile_dir is None:
            raise ApiError(404, "profiling is not enabled on this server; start it with --profile-dir DIR",
                           code="profiling_disabled")
        return self.profile_dir

    async def start(self, req: ProfileRequest) -> dict:
        from infertrace.capture.torch_capture import CaptureSession

        out_dir = resolve_output_dir(self._require_enabled(), req.output_dir)
        try:
            session = CaptureSession(out_dir, activities=req.activities, record_shapes=req.record_shapes,
                                     with_stack=req.with_stack, num_steps=req.num_steps, label=LABEL)
        except ValueError as e:
            raise bad_request(str(e)) from None
        with self._lock:
            if self._session is not None:
                raise ApiError(409, f"a capture is already running into {self._out_dir}; POST /stop_profile first",
                               code="capture_running")
            self._session, self._out_dir, self._finished = session, out_dir, None
        try:
            await self.aeng.call(session.start)
        except (ValueError, RuntimeError) as e:
            with self._lock:
                self._session = None
            raise bad_request(f"cannot start the capture: {e}") from None
        return {"status": "started", "output_dir": str(out_dir), "num_steps": req.num_steps,
                "activities": list(req.activities)}

    async def stop(self) -> dict:
        self._require_enabled()
        result = await self.aeng.call(self._stop_in_engine)
        if result is None:
            raise bad_request("no capture is running; POST /start_profile first", code="no_capture")
        return result

    def on_step(self, stats: Any) -> None:
        """Step callback (engine thread): count the step; stop when the window is full."""
        with self._lock:
            session = self._session
        if session is not None and session.on_step(stats):
            self._finished = self._stop_in_engine()

    def _stop_in_engine(self) -> dict | None:
        with self._lock:
            session, out_dir, finished = self._session, self._out_dir, self._finished
            self._session, self._finished = None, None
        if session is None:
            return finished
        paths = [str(p) for p in session.stop()]
        return {"status": "stopped", "output_dir": str(out_dir), "files": paths,
                "trace_files": [p for p in paths if ".pt.trace.json" in p]}
