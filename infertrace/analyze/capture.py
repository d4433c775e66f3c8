"""A capture: the trace files of one profiling run (one per rank), loaded into event tables.

Files are found by name (`.json`, `.json.gz`, `.sqlite`, `.nsys-rep`), read whatever their writer (Kineto from
torch.profiler, vLLM, SGLang, nsys exports), and given a rank: the file's `distributedInfo.rank`, else a rank in
its name (`-rank-3`, `rank_3`, SGLang's `-TP-3`), else the lowest free one. A file that cannot be used, or that
claims a rank another file already has, is reported in one line instead of being silently dropped or replaced.
"""

from __future__ import annotations

import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from infertrace.analyze.events import event_frame
from infertrace.analyze.kineto import TraceColumns, TraceError, read_kineto
from infertrace.analyze.nsys import read_nsys_report, read_nsys_sqlite

TRACE_SUFFIXES = (".json", ".json.gz", ".sqlite", ".nsys-rep")
MANIFEST_SUFFIX = ".manifest.json"  # written beside each capture by `infertrace profile`; not a trace
_RANK_IN_NAME = (
    re.compile(r"(?:^|[-_.])rank[-_]?(\d+)(?=[-_.]|$)", re.IGNORECASE),
    re.compile(r"-TP-(\d+)(?=[-_.]|$)"),
)


PARALLEL_MIN_BYTES = 64 << 20  # below this, starting worker processes costs more than it saves


class CaptureError(Exception):
    """Nothing in the input can be analysed (a missing path, an empty directory, no readable trace)."""


@dataclass(slots=True)
class RankTrace:
    rank: int
    path: Path
    events: pd.DataFrame
    metadata: dict
    exact_times: bool
    claimed_rank: int | None  # the rank the file itself gives, if any

    @property
    def device(self) -> str | None:
        props = self.metadata.get("deviceProperties") or []
        names = {p.get("name") for p in props if isinstance(p, dict) and p.get("name")}
        return ", ".join(sorted(names)) or None


@dataclass(slots=True)
class Capture:
    source: Path
    ranks: list[RankTrace]
    problems: list[str] = field(default_factory=list)  # one line each: files skipped, cut short or renumbered
    origin_ns: int = 0  # the first event of the capture; every `ts` counts from here

    def rank(self, rank: int) -> RankTrace:
        return next(r for r in self.ranks if r.rank == rank)


def trace_files(path: Path) -> list[Path]:
    """The trace files at `path` (a file, or the files directly inside a directory), in name order."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and _is_trace_name(p.name))
    exported = {p.name[: -len(".sqlite")] for p in files if p.name.endswith(".sqlite")}
    # a report exported beside itself is read once, from the faster .sqlite
    return [p for p in files if not (p.name.endswith(".nsys-rep") and p.name[: -len(".nsys-rep")] in exported)]


def _is_trace_name(name: str) -> bool:
    return name.endswith(TRACE_SUFFIXES) and not name.endswith(MANIFEST_SUFFIX) and not name.startswith(".")


def read_trace_file(path: Path, keep_python: bool = False) -> TraceColumns:
    if path.name.endswith(".sqlite"):
        return read_nsys_sqlite(path)
    if path.name.endswith(".nsys-rep"):
        return read_nsys_report(path)
    return read_kineto(path, keep_python=keep_python)


def load_capture(path: str | Path, keep_python: bool = False) -> Capture:
    """Load every trace at `path`. Raises CaptureError when not one file is usable."""
    path = Path(path)
    if not path.exists():
        raise CaptureError(f"{path} does not exist")
    files = trace_files(path)
    if not files:
        raise CaptureError(f"no trace files in {path} (looked for {', '.join('*' + s for s in TRACE_SUFFIXES)})")
    problems: list[str] = []
    loaded: list[tuple[Path, TraceColumns]] = []
    for file, (cols, failure) in zip(files, _read_all(files, keep_python)):
        if cols is None:
            problems.append(f"{file.name}: {failure}; skipped")
            continue
        if cols.problem:
            problems.append(f"{file.name}: {cols.problem}")
        if not cols.exact_times:
            problems.append(f"{file.name}: some timestamps could only be read at float precision")
        loaded.append((file, cols))
    if not loaded:
        raise CaptureError(f"no usable trace in {path}: " + "; ".join(problems))
    ranks = _assign_ranks(loaded, problems)
    non_empty = [cols.ts_ns.min() for _, cols in loaded if len(cols)]
    origin = int(min(non_empty)) if non_empty else 0
    traces = [RankTrace(rank, file, event_frame(cols, origin), cols.metadata, cols.exact_times, claimed)
              for (file, cols), (rank, claimed) in zip(loaded, ranks)]
    for trace in traces:
        if trace.events.empty:
            problems.append(f"{trace.path.name}: no complete events")
    return Capture(path, sorted(traces, key=lambda t: t.rank), problems, origin)


def _read_all(files: list[Path], keep_python: bool) -> list[tuple[TraceColumns | None, str | None]]:
    """Read every file, one worker process per core when there are several large files (one per rank)."""
    workers = min(len(files), os.cpu_count() or 1)
    if workers > 1 and sum(f.stat().st_size for f in files) >= PARALLEL_MIN_BYTES:
        try:
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
                return list(pool.map(_read_one, files, [keep_python] * len(files)))
        except (OSError, RuntimeError):  # no processes allowed here: read them one by one
            pass
    return [_read_one(f, keep_python) for f in files]


def _read_one(path: Path, keep_python: bool) -> tuple[TraceColumns | None, str | None]:
    try:
        return read_trace_file(path, keep_python), None
    except TraceError as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - a file we cannot read must not stop the others
        return None, f"unreadable ({type(exc).__name__}: {exc})".splitlines()[0]


def claimed_rank(path: Path, metadata: dict) -> int | None:
    info = metadata.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return info["rank"]
    for pattern in _RANK_IN_NAME:
        if m := pattern.search(path.name):
            return int(m.group(1))
    return None


def _assign_ranks(loaded: list[tuple[Path, TraceColumns]], problems: list[str]) -> list[tuple[int, int | None]]:
    claims = [claimed_rank(file, cols.metadata) for file, cols in loaded]
    owner: dict[int, Path] = {}
    ranks: list[int | None] = []
    for (file, _), claim in zip(loaded, claims):
        if claim is not None and claim not in owner:
            owner[claim] = file
            ranks.append(claim)
        else:
            ranks.append(None)
    free = (r for r in range(10**9) if r not in owner)
    for i, ((file, _), claim) in enumerate(zip(loaded, claims)):
        if ranks[i] is not None:
            continue
        ranks[i] = next(free)
        if claim is not None:
            problems.append(f"{file.name} claims rank {claim} like {owner[claim].name}; "
                            f"both are analysed, this one as rank {ranks[i]}")
        elif len(loaded) > 1:
            problems.append(f"{file.name} names no rank (no distributedInfo); analysed as rank {ranks[i]}")
    return [(r, c) for r, c in zip(ranks, claims)]
