"""A CPU trace of the HTTP front end's own Python, for /start_profile with "frontend": true.

The front end does not load torch, so torch.profiler is not there to record it; Python's profile hook is: every
function call and return (Python and C) on the event-loop thread and the tokenizer threads, written as a Chrome
trace (`frontend{index}-{pid}.trace.json` beside the engine's traces, in the same capture folder). Timestamps are
microseconds of the wall clock, so the trace lines up with others taken on the same host. A coroutine shows as one
slice per resumption. Recording stops at `MAX_EVENTS` so that a forgotten capture cannot eat the memory.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

MAX_EVENTS = 2_000_000
_OPEN = {"call": True, "c_call": True, "return": False, "c_return": False, "c_exception": False}


class FrontendTrace:
    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.events: list[tuple] = []
        self.truncated = False
        self._origin_ns = 0  # wall clock at perf_counter_ns() == _origin_perf
        self._origin_perf = 0

    def start(self) -> None:
        self._origin_ns, self._origin_perf = time.time_ns(), time.perf_counter_ns()
        events, clock, ident = self.events, time.perf_counter_ns, threading.get_ident

        def hook(frame, event, arg):
            if len(events) >= MAX_EVENTS:
                self.truncated = True
                return
            opening = _OPEN.get(event)
            if opening is None:
                return
            what = arg if event.startswith("c_") else frame.f_code
            events.append((clock(), ident(), opening, what))

        _set_hook(hook)

    def stop(self) -> None:
        _set_hook(None)

    def write(self, out_dir: Path) -> Path:
        """The Chrome trace of what was recorded, as complete ("X") events nested per thread."""
        pid = os.getpid()
        shift_us = (self._origin_ns - self._origin_perf) / 1000
        trace = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"front end {self.index}"}}]
        stacks: dict[int, list[tuple[int, object]]] = {}
        for t_ns, tid, opening, what in self.events:
            stack = stacks.setdefault(tid, [])
            if opening:
                stack.append((t_ns, what))
            elif stack:
                begin, opened = stack.pop()
                trace.append({"ph": "X", "name": _name(opened), "cat": "python", "pid": pid, "tid": tid,
                              "ts": begin / 1000 + shift_us, "dur": (t_ns - begin) / 1000})
        path = Path(out_dir) / f"frontend{self.index}-{pid}.trace.json"
        doc = {"traceEvents": trace, "displayTimeUnit": "ms",
               "otherData": {"source": "infertrace front end", "events": len(self.events),
                             "truncated": self.truncated}}
        tmp = path.with_name(f".{path.name}.tmp")  # renamed when whole: another front end may be waiting for it
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
        self.events = []
        return path


def _set_hook(hook) -> None:
    """The profile hook on every thread (Python 3.12+), or on this one and threads started from now on."""
    setter = getattr(threading, "setprofile_all_threads", None)
    if setter is not None:
        setter(hook)
    else:
        threading.setprofile(hook)
        sys.setprofile(hook)


def _name(what: object) -> str:
    code = getattr(what, "co_qualname", None) or getattr(what, "co_name", None)
    if code is not None:
        return f"{code} ({Path(what.co_filename).name}:{what.co_firstlineno})"
    module = getattr(what, "__module__", None)
    qualname = getattr(what, "__qualname__", None) or repr(what)
    return f"{module}.{qualname}" if module else qualname
