"""A capture: the trace files of one profiling run (one per rank), loaded into event tables.

Files are found by name (`.json`, `.json.gz`, `.sqlite`, `.nsys-rep`) at any depth, infertrace's own reports,
results and manifests left out whatever their name, and grouped into captures by their writers' own naming
(catalog.py): the newest capture, or the one asked for, is read. Each file is read
whatever its writer (Kineto from torch.profiler, vLLM, SGLang, nsys exports) and given a rank: the file's
`distributedInfo.rank`, else a rank in its name (`-rank-3`, `rank_3`, SGLang's `-TP-3`), else the lowest free one.
SGLang's EXTEND and DECODE files of one rank are read as one rank; vLLM's API-server trace is the frontend, kept
apart. A file that cannot be used, or that claims a rank another file already has, is reported in one line instead
of being silently dropped or replaced.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from infertrace.analyze.catalog import TRACE_SUFFIXES, CaptureGroup, TraceFile, catalog, own_document, select
from infertrace.analyze.kineto import TraceColumns, TraceError, read_kineto
from infertrace.analyze.nsys import read_nsys_report, read_nsys_sqlite

if TYPE_CHECKING:
    import pandas as pd

# pandas (and the event table) are imported where the events are made into tables, not here: planning and reading a
# capture go without them, so `analyze` can start decoding a trace while it imports them (fleet.read_ahead)

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
    name: str | None = None  # the capture's name (vLLM prefix, SGLang profile id, or its directory)
    notes: list[str] = field(default_factory=list)  # which capture of several was read, and the like
    frontend: list[RankTrace] = field(default_factory=list)  # vLLM's API-server CPU trace: not a rank

    def rank(self, rank: int) -> RankTrace:
        return next(r for r in self.ranks if r.rank == rank)


def trace_files(path: Path) -> list[Path]:
    """Every trace file at `path` (a file, or a directory searched to any depth), in name order."""
    return sorted(f.path for group in catalog(path) for f in group.files)


def read_trace_file(path: Path, keep_python: bool = False, workers: int = 1, ahead=None) -> TraceColumns:
    """One trace file's events; `ahead` (kineto.read_ahead's, for a Kineto JSON file) is joined by the reader."""
    if path.name.endswith(".sqlite"):
        return read_nsys_sqlite(path)
    if path.name.endswith(".nsys-rep"):
        return read_nsys_report(path)
    return read_kineto(path, keep_python=keep_python, workers=workers, ahead=ahead)


def load_capture(path: str | Path, keep_python: bool = False, capture: str | None = None,
                 rank: int | None = None, exclude: Iterable[Path] = ()) -> Capture:
    """Load one capture at `path`: the newest there, or the one named `capture`, only `rank` when given; files at
    or under `exclude` (this run's outputs) are not read. Raises CaptureError when not one file is usable, `path`
    is a document infertrace wrote, or the capture or rank asked for is not there."""
    path = Path(path)
    group, notes, units = plan_capture(path, capture, rank, exclude)
    files = [f.path for unit in units for f in unit] + [f.path for f in group.frontend()]
    read = dict(zip(files, _read_all(files, keep_python)))
    problems: list[str] = []
    loaded: list[tuple[Path, list[TraceColumns]]] = []
    for unit in units:
        parts = [cols for cols in (usable(f.path, read[f.path], problems) for f in unit) if cols is not None]
        if parts:
            loaded.append((unit[0].path, parts))
    frontend = [(f.path, cols) for f in group.frontend()
                if (cols := usable(f.path, read[f.path], problems)) is not None]
    if not loaded:
        raise CaptureError(f"no usable trace in {path}: " + "; ".join(problems))
    ranks = _assign_ranks([(file, parts[0]) for file, parts in loaded], problems)
    everything = [cols for _, parts in loaded for cols in parts] + [cols for _, cols in frontend]
    non_empty = [cols.ts_ns.min() for cols in everything if len(cols)]
    origin = int(min(non_empty)) if non_empty else 0
    traces = [RankTrace(r, file, _events(parts, origin), parts[0].metadata, all(c.exact_times for c in parts),
                        claimed)
              for (file, parts), (r, claimed) in zip(loaded, ranks)]
    if all(len(cols) == 0 for cols in everything):
        raise no_events(path, group, problems, exclude)
    for trace in traces:
        if trace.events.empty:
            problems.append(f"{trace.path.name}: no complete events")
    for unit in units:
        if len(unit) > 1:
            notes.append(f"{' and '.join(f.path.name for f in unit)}: stages of one rank, read as one")
    from infertrace.analyze.events import event_frame

    fronts = [RankTrace(-1, file, event_frame(cols, origin), cols.metadata, cols.exact_times, None)
              for file, cols in frontend]
    for front in fronts:
        notes.append(f"{front.path.name}: the API server's CPU trace (the frontend), not a rank")
    return Capture(path, sorted(traces, key=lambda t: t.rank), problems, origin, group.name, notes, fronts)


def no_events(path: Path, group: CaptureGroup, problems: list[str], exclude: Iterable[Path] = ()) -> CaptureError:
    """The error for a capture without a complete event, naming the other captures at `path` with their events,
    so that an idle newest capture points to the one worth reading (--capture)."""
    others = [g for g in catalog(path, exclude) if (g.name, g.directory) != (group.name, group.directory)]
    text = f"no events in {path}: capture {group.name} holds no complete event"
    if others:
        counts = [(g.name, _event_count(g)) for g in others]
        listed = ", ".join(f"{name} ({count:,} events)" for name, count in counts)
        best = max(counts, key=lambda c: c[1])
        text += f"; other captures here: {listed}"
        if best[1] > 0:
            text += f"; analyse one with --capture {best[0]}"
    return CaptureError(text + "".join(f"; {p}" for p in problems))


def _event_count(group: CaptureGroup) -> int:
    count = 0
    for f in group.rank_files():
        cols, _ = _read_one(f.path, False)
        count += len(cols) if cols is not None else 0
    return count


def plan_capture(path: Path, capture: str | None = None, rank: int | None = None,
                 exclude: Iterable[Path] = ()) -> tuple[CaptureGroup, list[str], list[list[TraceFile]]]:
    """The capture to read at `path`, notes on the choice, and its per-rank units of files (`load_capture`)."""
    if not path.exists():
        raise CaptureError(f"{path} does not exist")
    if not path.is_dir() and not path.is_file():
        raise CaptureError(f"{path} is not a regular file or a directory")
    if path.is_file() and (what := own_document(path)) is not None:
        raise CaptureError(f"{path} is {what} written by infertrace, not a trace")
    groups = catalog(path, exclude)
    if not groups:
        raise CaptureError(f"no trace files in {path} (looked for {', '.join('*' + s for s in TRACE_SUFFIXES)})")
    try:
        group, notes = select(groups, capture, rank)
    except LookupError as exc:
        raise CaptureError(str(exc)) from None
    return group, notes, _rank_units(group)


def _rank_units(group: CaptureGroup) -> list[list[TraceFile]]:
    """The capture's per-rank files; SGLang's stage files of one rank together, EXTEND before DECODE."""
    units: dict[object, list[TraceFile]] = {}
    for f in group.rank_files():
        key = ("stage", f.rank) if f.stage is not None and f.rank is not None else f.path
        units.setdefault(key, []).append(f)
    return [sorted(unit, key=lambda f: (f.stage != "EXTEND", f.path.name)) for unit in units.values()]


def usable(path: Path, outcome: tuple[TraceColumns | None, str | None], problems: list[str]) -> TraceColumns | None:
    cols, failure = outcome
    if cols is None:
        problems.append(f"{path.name}: {failure}; skipped")
        return None
    if cols.problem:
        problems.append(f"{path.name}: {cols.problem}")
    problems.extend(f"{path.name}: {warning}" for warning in cols.warnings)
    if not cols.exact_times:
        problems.append(f"{path.name}: some timestamps could only be read at float precision")
    return cols


def _events(parts: list[TraceColumns], origin: int) -> pd.DataFrame:
    import pandas as pd

    from infertrace.analyze.events import event_frame

    frames = [event_frame(cols, origin) for cols in parts]
    return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)


def _read_all(files: list[Path], keep_python: bool) -> list[tuple[TraceColumns | None, str | None]]:
    """Read every file, one worker process per core when there are several large files (one per rank)."""
    workers = min(len(files), os.cpu_count() or 1)
    if workers > 1 and sum(f.stat().st_size for f in files) >= PARALLEL_MIN_BYTES:
        import multiprocessing  # here: planning and one-process reads go without it
        from concurrent.futures import ProcessPoolExecutor

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
    return assign_ranks([(file, claimed_rank(file, cols.metadata)) for file, cols in loaded], problems)


def assign_ranks(claims_of: list[tuple[Path, int | None]], problems: list[str]) -> list[tuple[int, int | None]]:
    """Each file's rank: the one it claims, unless another file claimed it first, else the lowest free one."""
    loaded = claims_of
    claims = [claim for _, claim in claims_of]
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
