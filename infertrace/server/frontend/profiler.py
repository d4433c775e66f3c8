"""The /start_profile and /stop_profile endpoints: a torch.profiler capture over engine steps, under --profile-dir.

`Profiler` lives where the engine runs (its process, or its thread with --engine-in-process): torch.profiler
records the thread that started it, so capture sessions start, count steps and stop between two engine steps.
The front end only parses the request and forwards it (`EngineServices.command`).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infertrace.server.frontend.protocol import ApiError, bad_request, brief

log = logging.getLogger("infertrace.server")
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
    profile_id: str | None = None  # the capture's name (SGLang's field): its folder is capture-{profile_id}
    frontend: bool = False  # also trace the HTTP front end's Python (infertrace's own field)


# What a path may be before the file system refuses it (ENAMETOOLONG, which surfaced as a 500): Linux's PATH_MAX
# for the whole, NAME_MAX for one name.
MAX_PATH_CHARS = 4096
MAX_NAME_BYTES = 255
# Folders one output_dir may nest: creating them is recursive (Path.mkdir(parents=True)), and 2,040 of them ran
# past Python's recursion limit.
MAX_DEPTH = 64


def parse_profile_request(body: dict | None) -> ProfileRequest:
    body = body or {}
    output_dir = body.get("output_dir")
    if output_dir is not None and (not isinstance(output_dir, str) or not output_dir):
        raise bad_request("output_dir must be a non-empty string", "output_dir")
    if output_dir is not None and "\x00" in output_dir:
        raise bad_request("output_dir must not contain a NUL character", "output_dir")
    if output_dir is not None and (len(output_dir) > MAX_PATH_CHARS
                                   or any(len(part.encode()) > MAX_NAME_BYTES for part in Path(output_dir).parts)):
        raise bad_request(f"output_dir is too long: at most {MAX_PATH_CHARS} characters, {MAX_NAME_BYTES} bytes a "
                          "folder name", "output_dir")
    if output_dir is not None and len(Path(output_dir).parts) > MAX_DEPTH:
        raise bad_request(f"output_dir is too deep: at most {MAX_DEPTH} folders, got {len(Path(output_dir).parts)}",
                          "output_dir")
    num_steps = body.get("num_steps")
    if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
        raise bad_request(f"num_steps must be a positive integer, got {num_steps!r}", "num_steps")
    activities = body.get("activities")
    if activities is None:
        activities = DEFAULT_ACTIVITIES
    elif not (isinstance(activities, list) and activities and all(isinstance(a, str) for a in activities)):
        raise bad_request("activities must be a non-empty list such as [\"CPU\", \"GPU\"]", "activities")
    profile_id = body.get("profile_id")
    if profile_id is not None:
        from infertrace.capture.peers import check_name

        try:
            check_name(profile_id if isinstance(profile_id, str) else "")
        except ValueError as e:
            raise bad_request(f"profile_id: {e}", "profile_id") from None
    flags = {}
    for name in ("record_shapes", "with_stack", "frontend"):
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"{name} must be a boolean", name)
        flags[name] = bool(value)
    return ProfileRequest(output_dir=output_dir, num_steps=num_steps,
                          activities=tuple(a.upper() for a in activities), profile_id=profile_id, **flags)


def resolve_output_dir(profile_dir: Path, output_dir: str | None) -> Path:
    """Where a capture writes: `output_dir` (relative to `profile_dir`, or absolute inside it) or a fresh
    timestamped folder. Paths that leave `profile_dir` through `..` or a symlink are refused with 400, and so are
    paths through a symlink inside it (one could be re-pointed before the capture writes)."""
    root = profile_dir.resolve()
    if output_dir is None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        return root / f"capture-{stamp}"
    try:
        target = (root / output_dir).resolve()  # an absolute output_dir replaces root; resolve() follows symlinks
    except OSError as e:  # a name the file system refuses (too long with root in front, a loop of links)
        raise bad_request(f"output_dir {brief(output_dir)}: {e.strerror or e}", "output_dir") from None
    if not target.is_relative_to(root):
        raise bad_request(f"output_dir {output_dir!r} is outside the server's profile directory {root}",
                          "output_dir", code="output_dir_outside_profile_dir")
    lexical = Path(os.path.normpath(root / output_dir))
    if lexical.is_relative_to(root):
        for part in _below(root, lexical):
            if part.is_symlink():
                raise bad_request(f"output_dir {output_dir!r} goes through the symlink {part}; symlinks inside the "
                                  "profile directory are not followed", "output_dir", code="output_dir_symlink")
    return target


def _below(root: Path, path: Path) -> list[Path]:
    """root/a, root/a/b, ... path: the folders a write to `path` goes through, below root."""
    parts = path.relative_to(root).parts
    return [root.joinpath(*parts[:i]) for i in range(1, len(parts) + 1)]


def _identity(root: Path, out_dir: Path) -> tuple[int, int] | None:
    """(device, inode) of `out_dir`; None when it is gone or a folder between root and it is a symlink."""
    try:
        if any(part.is_symlink() for part in _below(root, out_dir)):
            return None
        st = os.stat(out_dir, follow_symlinks=False)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _remove_created(root: Path, created: list[Path]) -> None:
    """Remove the folders a failed start created, deepest first, if they are still empty."""
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            return


class Profiler:
    """At most one capture at a time, from its start until its files are written. Files of a capture that stopped
    by itself after `num_steps` are handed out by the next /stop_profile. Every method runs between two engine
    steps (the engine's thread), so no lock is needed.

    The output folder is resolved once, at start; at stop the files go to that same folder (same inode, no symlink
    on the way) or nowhere."""

    def __init__(self, engine: Any, profile_dir: Path | None) -> None:
        self.engine = engine
        self.profile_dir = profile_dir
        self._session: Any = None
        self._out_dir: Path | None = None
        self._dir_id: tuple[int, int] | None = None  # (device, inode) of the output folder once it exists
        self._finished: dict | None = None  # the result of a capture that stopped by itself

    def _require_enabled(self) -> Path:
        if self.profile_dir is None:
            raise ApiError(404, "profiling is not enabled on this server; start it with --profile-dir DIR",
                           code="profiling_disabled")
        return self.profile_dir

    def start(self, req: ProfileRequest) -> dict:
        from infertrace.capture.torch_capture import CaptureSession

        root = self._require_enabled().resolve()
        named = req.output_dir or (f"capture-{req.profile_id}" if req.profile_id else None)
        out_dir = resolve_output_dir(root, named)
        try:
            # every tensor-parallel rank records its own trace (the engine's ranks are processes of their own)
            session = CaptureSession(out_dir, activities=req.activities, record_shapes=req.record_shapes,
                                     with_stack=req.with_stack, num_steps=req.num_steps,
                                     label=req.profile_id or LABEL, engine=self.engine)
        except ValueError as e:
            raise bad_request(str(e)) from None
        if self._session is not None:
            raise ApiError(409, f"a capture is already running into {self._out_dir}; POST /stop_profile first",
                           code="capture_running")
        created = [p for p in _below(root, out_dir) if not p.exists()]
        try:
            session.start()
        except (ValueError, RuntimeError, OSError) as e:
            _remove_created(root, created)
            raise bad_request(f"cannot start the capture: {e}") from None
        previous, self._finished = self._finished, None
        self._session, self._out_dir = session, out_dir
        self._dir_id = _identity(root, out_dir)
        result = {"status": "started", "output_dir": str(out_dir), "num_steps": req.num_steps,
                  "activities": list(req.activities)}
        if previous is not None:  # a window that stopped by itself and was never collected: handed over here
            result["previous"] = previous
        return result

    def stop(self) -> dict:
        self._require_enabled()
        result = self._stop(by_itself=False)
        if result is None:
            raise bad_request("no capture is running; POST /start_profile first", code="no_capture")
        if result["status"] == "failed":
            raise ApiError(500, f"the capture into {result['output_dir']} failed: {result['error']}",
                           code="capture_failed")
        return result

    def on_step(self, stats: Any) -> None:
        """After every engine step: count the step; stop when the window is full."""
        if self._session is not None and self._session.on_step(stats):
            self._stop(by_itself=True)

    def _stop(self, by_itself: bool) -> dict | None:
        """Close the running capture and write its files. A capture that stopped by itself is kept for the next
        /stop_profile, a failure included."""
        session, out_dir, dir_id = self._session, self._out_dir, self._dir_id
        if session is None or not session.active:  # nothing running
            finished, self._finished = self._finished, None
            return None if by_itself else finished
        root = self.profile_dir.resolve()
        note = None
        try:
            if dir_id is None or _identity(root, out_dir) != dir_id:
                # the folder was swapped (for a symlink, say) since the start: write to a fresh one instead
                moved = resolve_output_dir(root, None)
                moved.mkdir()
                note = f"{out_dir} was replaced after the capture started; the files went to {moved} instead"
                log.warning("%s", note)
                session.out_dir = out_dir = moved
            paths = [str(p) for p in session.stop()]
            result = {"status": "stopped", "output_dir": str(out_dir), "files": paths,
                      "trace_files": [p for p in paths if ".pt.trace.json" in p]}
            if note:
                result["note"] = note
        except (ValueError, RuntimeError, OSError) as e:  # the session is closed either way (stop's own finally)
            log.warning("capture into %s failed: %s", out_dir, e)
            result = {"status": "failed", "output_dir": str(out_dir), "error": str(e)}
        self._session = None
        if by_itself:
            self._finished = result
        return result
