"""The request log beside a capture: when /stop_profile ends a torch-profiler capture, the engine process writes
the log of every request that was in flight during it as `<capture>.request_log.json` next to the traces, so
`infertrace analyze` can list each step's requests by the step numbers in the step ranges (`#N`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("infertrace.server")
SUFFIX = ".request_log.json"


def write_capture_log(request_log: Any, result: dict, started: float | None) -> dict:
    """`result` (the profiler's stop answer) with the log file added to its files, when there is a log and a
    trace to put it beside; a failure to write it is a note, never a failed stop."""
    traces = result.get("trace_files") or []
    if request_log is None or not traces:
        return result
    first = Path(traces[0])
    stem = first.name.split(".rank")[0] if ".rank" in first.name else first.name.split(".pt.trace")[0]
    path = first.with_name(stem + SUFFIX)
    try:
        path.write_text(json.dumps(request_log.read(active_since=started)))
    except OSError as e:
        log.warning("could not write the request log beside the capture: %s", e)
        return {**result, "request_log_note": f"the request log was not written: {e}"}
    return {**result, "files": [*result.get("files", []), str(path)], "request_log": str(path)}
